"""Multi-turn conversations with the prefix cache on and off: time to first token per turn, and throughput.

    PYTHONPATH=. python benchmarks/prefix_cache_multi_turn.py [--checkpoint DIR] [--device cpu] [--out FILE.md]
    PYTHONPATH=. python benchmarks/prefix_cache_multi_turn.py --config configs/kimi_k3_mini.yaml \
        --set dtype=bfloat16 model_kwargs.cuda_graphs=true --out FILE.md       # a served config, as served

Each of --conversations chats runs --turns turns one after another; turn t's prompt is turn t-1's prompt,
its answer and a new message of --message tokens (random ids), the first prompt --first tokens. The chats
take turns (one request in the engine at a time), so TTFT is a turn's own prefill; each engine first plays
the same conversations on other tokens (untimed: every step shape compiles), whose cache it then resets.
Greedy: the answers, and so the prompts, are the same with the cache on and off, which the script checks.
Without --checkpoint it writes the tiny checkpoint (mstar-make-tiny's) to a temporary folder. With --config it
builds the engine that `mstar-serve --config` would (its dtype, device, CUDA graphs and DSpark draft; --set
overrides keys as mstar-serve's --set does), the cache switched on and off by `prefix_cache.enabled`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mstar.config import EngineConfig, load_serve_config, resolve_device, torch_dtype
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.tokenizer import NUM_SPECIAL_SLOTS, KimiTokenizer
from mstar.models.kimi_k3.weights import load_model
from mstar.tools.make_tiny import write_tiny


def serve_turn(engine: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(answer, seconds to its first token, cached prompt tokens) of one request alone in the engine."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    ttft, cached = 0.0, 0
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and not tokens:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, ttft, cached


def tiny_engine(model, tokenizer, args, enabled: bool) -> EngineCore:
    cfg = EngineConfig(max_seq_len=args.max_seq_len,
                       resources={"mla_kv": {"page_size": args.page_size, "max_num_pages": args.pages},
                                  "kda_state": {"max_slots": 8}},
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": args.budget},
                       prefix_cache={"enabled": enabled, "kda_snapshot_interval": args.interval},
                       model_kwargs={"cuda_graphs": False})
    return EngineCore(model, tokenizer, cfg)


def served_engine(args, enabled: bool) -> tuple[EngineCore, str]:
    """The engine of a serve config (model and draft loaded again for each setting: CUDA graphs are captured
    per engine), and a line naming what it runs."""
    cfg = load_serve_config(args.config, [*args.set, f"prefix_cache.enabled={str(enabled).lower()}"])
    device = resolve_device(cfg)
    model = load_model(cfg.checkpoint, dtype=torch_dtype(cfg.dtype), device=device)
    engine = EngineCore(model, KimiTokenizer.from_dir(cfg.checkpoint), cfg, SpeculativeModels.for_config(cfg, device))
    kw = cfg.model_kwargs
    what = (f"{args.config} {' '.join(args.set)}: {device}, {cfg.dtype}, page {cfg.resources.mla_kv.page_size}, "
            f"snapshot interval {cfg.prefix_cache.kda_snapshot_interval}, CUDA graphs {kw.cuda_graphs}, "
            f"DSpark k={kw.speculative_tokens if cfg.speculative else 0}")
    return engine, what


def run(engine: EngineCore, args, messages) -> dict:
    """The conversations once untimed on other tokens of the same lengths (so every step shape has compiled and
    autotuned: on a GPU the first step of a new length costs up to ~0.6 s eager), the cache reset, then timed."""
    vocab = message_vocab(engine)
    play(engine, args, [[[(t + 1) % vocab for t in m] for m in chat] for chat in messages], "warm")
    engine.reset_prefix_cache()
    return play(engine, args, messages, "c")


def message_vocab(engine: EngineCore) -> int:
    """Message tokens are random ids below this: the vocabulary less as many ids as the tokenizer has special
    slots, which K3's vocabulary puts after its BPE ranks."""
    return engine.model_config.vocab_size - NUM_SPECIAL_SLOTS


def play(engine: EngineCore, args, messages, name: str) -> dict:
    prompts = [[] for _ in messages]
    by_turn = [[] for _ in range(args.turns)]
    answers, cached_tokens, prompt_tokens, output_tokens = [], 0, 0, 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, chat in enumerate(messages):
            prompts[c] = prompts[c] + chat[turn]
            tokens, ttft, cached = serve_turn(engine, f"{name}{c}t{turn}", prompts[c], args.answer)
            by_turn[turn].append(ttft)
            answers.append(tokens)
            cached_tokens += cached
            prompt_tokens += len(prompts[c])
            output_tokens += len(tokens)
            prompts[c] = prompts[c] + tokens
    wall = time.perf_counter() - start
    return {"ttft_ms": [statistics.mean(t) * 1e3 for t in by_turn], "answers": answers, "wall": wall,
            "cached": cached_tokens, "prompt": prompt_tokens, "tok_s": (prompt_tokens + output_tokens) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default=None, help="a serve YAML: benchmark the engine it serves")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --config's keys")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first", type=int, default=384)
    ap.add_argument("--message", type=int, default=48)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=513)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            engines = {enabled: served_engine(args, enabled) for enabled in (False, True)}
        else:
            checkpoint = Path(args.checkpoint) if args.checkpoint else write_tiny(Path(tmp))[0]
            model = load_model(checkpoint, dtype=torch.float32).to(args.device)
            tokenizer = KimiTokenizer.from_dir(checkpoint)
            engines = {enabled: (tiny_engine(model, tokenizer, args, enabled),
                                 f"{args.device}, fp32, {checkpoint.name}, page {args.page_size}, "
                                 f"snapshot interval {args.interval}, step budget {args.budget}")
                       for enabled in (False, True)}
    rng = random.Random(0)
    vocab = message_vocab(engines[False][0])
    messages = [[[rng.randrange(vocab) for _ in range(args.first if t == 0 else args.message)]
                 for t in range(args.turns)] for _ in range(args.conversations)]
    off = run(engines[False][0], args, messages)
    on = run(engines[True][0], args, messages)
    if on["answers"] != off["answers"]:
        raise SystemExit("the answers differ with the cache on and off")
    lines = [f"{args.conversations} conversations x {args.turns} turns: first prompt {args.first} tokens, then "
             f"+{args.answer} answer +{args.message} message per turn; {engines[True][1]}",
             "", "| turn | prompt tokens | TTFT off ms | TTFT on ms | speedup |", "|---|---|---|---|---|"]
    length = args.first
    for turn in range(args.turns):
        a, b = off["ttft_ms"][turn], on["ttft_ms"][turn]
        lines.append(f"| {turn + 1} | {length} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
        length += args.answer + args.message
    lines += ["", f"cached prompt tokens: {on['cached']} of {on['prompt']} "
              f"({100 * on['cached'] / on['prompt']:.0f}%); tokens/s (prompt + output over the wall time): "
              f"off {off['tok_s']:.0f}, on {on['tok_s']:.0f}; wall off {off['wall']:.1f} s, on {on['wall']:.1f} s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
