"""Per-token cost of structured outputs (engine/structured_output.py) at batch 1 and 64: the host's
bitmask fill for every constrained row, and its application to the logits on the device.

    PYTHONPATH=. python benchmarks/grammar_mask.py [--tokenizer models/kimi_k3_mini] [--device cpu]

Each of B requests follows a JSON Schema, its token chosen greedily from random logits under the mask,
for up to --steps steps (requests whose grammar completes are restarted).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mstar.engine.structured_output import Grammar, GrammarCompiler, apply_token_bitmask
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="models/kimi_k3_mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    tok = KimiTokenizer.from_dir(args.tokenizer)
    vocab = tok.vocab_size
    device = torch.device(args.device)
    compiler = GrammarCompiler(tok.encoding, vocab, tuple(tok.stop_ids))
    grammar = Grammar("json_schema", json.dumps(SCHEMA), "bench")
    for batch in (1, 64):
        matchers = [compiler.matcher(grammar) for _ in range(batch)]
        rows = torch.arange(batch, device=device)
        fill = apply = 0.0
        for _ in range(args.steps):
            logits = torch.randn(batch, vocab, device=device)
            t0 = time.perf_counter()
            mask = compiler.bitmask([(m, []) for m in matchers], device)
            t1 = time.perf_counter()
            tokens = apply_token_bitmask(logits, rows, mask).argmax(-1).tolist()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            fill, apply = fill + t1 - t0, apply + t2 - t1
            for i, (m, t) in enumerate(zip(matchers, tokens, strict=True)):
                m.consume_token(t)
                if m.is_stopped():
                    matchers[i] = compiler.matcher(grammar)
        print(f"vocab {vocab} batch {batch:3d}: bitmask fill {fill / args.steps * 1e6:8.1f} us/step "
              f"({fill / args.steps / batch * 1e6:6.1f} us/row), apply+argmax {apply / args.steps * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
