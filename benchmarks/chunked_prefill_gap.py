"""Running streams' worst inter-token gap while a long prompt is prefilled, chunked and whole (issue 22).

    PYTHONPATH=. python benchmarks/chunked_prefill_gap.py [--checkpoint DIR] [--out FILE.md]

--streams greedy requests decode; once every one has its first token, a prompt of --prompt tokens
arrives. With chunked prefill and mixed steps, each step carries every stream's decode row and one chunk
of the prompt (the step budget less the decode rows), so a stream waits one step between two tokens,
and that step costs a decode step plus one chunk. For each --budgets value the script times each step
(wall clock, after the step returns its outputs), and reports the decode-only step before the prompt,
the worst gap a stream saw while the prompt prefilled, in ms and in steps, and the slowest step. The
last row prefills the prompt whole (chunked_prefill off, a budget that holds it): its gap is that one
step. The script fails if a chunked run lets a stream wait more than one step. Without --checkpoint it
writes the tiny checkpoint (mstar-make-tiny's) to a temporary folder.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model
from mstar.tools.make_tiny import write_tiny

GREEDY = dict(temperature=0, ignore_eos=True)
DECODE_STEPS = 8  # decode-only steps timed before the prompt arrives


def max_seq_len(args) -> int:
    return args.prompt + 64


def run(model, tokenizer, args, budget: int, chunked: bool, rng: random.Random) -> dict:
    cfg = EngineConfig(max_seq_len=max_seq_len(args),
                       resources={"mla_kv": {"page_size": 16, "max_num_pages": 2 * (args.prompt // 16) + 64},
                                  "kda_state": {"max_slots": args.streams + 2}},
                       scheduler={"max_num_seqs": args.streams + 1, "max_num_batched_tokens": budget,
                                  "chunked_prefill": chunked},
                       model_kwargs={"mixed_prefill_decode": True, "cuda_graphs": False})
    engine = EngineCore(model, tokenizer, cfg)
    vocab = model.config.vocab_size - 256
    streams = [f"s{i}" for i in range(args.streams)]
    for rid in streams:  # long enough to outlast the prompt's prefill
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(8)],
                           SamplingParams(max_tokens=args.prompt // 8 + 64, **GREEDY))
    started: set[str] = set()
    while started != set(streams):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    decode_ms = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        decode_ms.append((time.perf_counter() - start) * 1e3)

    prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=1, **GREEDY))
    last = dict.fromkeys(streams, (time.perf_counter(), 0))  # per stream: (time, step) of its last token
    worst_ms, worst_steps, step_ms, step, done = 0.0, 0, [], 0, False
    while not done:
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_ms.append((now - start) * 1e3)
        step += 1
        for out in outputs:
            done |= out.request_id == "long" and out.finished
            if out.request_id in last and out.new_token_ids:
                then, then_step = last[out.request_id]
                worst_ms = max(worst_ms, (now - then) * 1e3)
                worst_steps = max(worst_steps, step - then_step)
                last[out.request_id] = (now, step)
    return {"decode_ms": statistics.median(decode_ms), "worst_ms": worst_ms, "worst_steps": worst_steps,
            "steps": step, "slowest_ms": max(step_ms), "prefill_ms": sum(step_ms)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--budgets", type=int, nargs="+", default=[72, 136, 264, 520])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else write_tiny(Path(tmp))[0]
        model = load_model(checkpoint, dtype=torch.float32)
        tokenizer = KimiTokenizer.from_dir(checkpoint)
    rng = random.Random(0)
    run(model, tokenizer, args, args.budgets[0], True, rng)  # warm-up: the first steps of a process are slower
    lines = [f"{args.streams} greedy streams decoding while a {args.prompt}-token prompt prefills; cpu, fp32, eager, "
             f"{checkpoint.name}; mixed prefill and decode steps", "",
             "| prefill | step budget | chunk tokens | steps to prefill | decode step ms (median, before) | "
             "worst gap ms | worst gap steps | slowest step ms | whole prefill ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    failures = []
    # unchunked, the budget must hold a whole prompt of max_seq_len
    for budget, chunked in [(b, True) for b in args.budgets] + [(max_seq_len(args) + args.streams, False)]:
        r = run(model, tokenizer, args, budget, chunked, rng)
        chunk = budget - args.streams if chunked else args.prompt
        lines.append(f"| {'chunked' if chunked else 'whole'} | {budget} | {chunk} | {r['steps']} | "
                     f"{r['decode_ms']:.1f} | {r['worst_ms']:.1f} | {r['worst_steps']} | {r['slowest_ms']:.1f} | "
                     f"{r['prefill_ms']:.0f} |")
        if chunked and r["worst_steps"] != 1:
            failures.append(f"budget {budget}: a stream waited {r['worst_steps']} steps for a token")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if failures:
        raise SystemExit("decode rows did not ride in every step: " + "; ".join(failures))


if __name__ == "__main__":
    main()
