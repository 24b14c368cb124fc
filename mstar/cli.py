"""Command-line entry points."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        msg = f"--prompt-ids takes integers separated by commas or spaces, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def generate_main(argv: list[str] | None = None) -> None:
    """`mstar-generate`: greedy decoding with the CPU reference model, to see a checkpoint run."""
    from mstar.models.kimi_k3.generate import greedy_tokens
    from mstar.models.kimi_k3.weights import load_model

    p = argparse.ArgumentParser(prog="mstar-generate", description=generate_main.__doc__)
    p.add_argument("--checkpoint", type=Path, required=True, help="HF checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text (needs the tokenizer files in the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-message token")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")

    tokenizer = None
    if (args.checkpoint / "tiktoken.model").exists():
        from mstar.models.kimi_k3.tokenizer import KimiTokenizer

        tokenizer = KimiTokenizer.from_dir(args.checkpoint)
    if args.prompt is not None and tokenizer is None:
        p.error(f"--prompt needs a tokenizer (tiktoken.model) in {args.checkpoint}; use --prompt-ids instead")
    prompt_ids = args.prompt_ids if args.prompt is None else tokenizer.encode(args.prompt)

    model = load_model(args.checkpoint, dtype=_DTYPES[args.dtype])
    stop = () if args.ignore_eos else (model.config.eos_token_id,)
    print(f"prompt ids: {prompt_ids}", file=sys.stderr)
    out: list[int] = []
    for token in greedy_tokens(model, prompt_ids, args.max_new_tokens, stop):
        out.append(token)
        print(token, end=" ", flush=True)
    print()
    if tokenizer is not None:
        print(tokenizer.decode(out))


if __name__ == "__main__":
    generate_main()
