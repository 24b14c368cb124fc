"""Speculative decoding with the oracle proposer on the tiny model (CPU): tokens per target step and
wall-clock speedup over plain decoding, at several draft error rates.

    python benchmarks/spec_oracle.py [--concurrency 1] [--k 7] [--max-tokens 96]

The oracle drafts the target's own greedy continuation, each position wrong with probability e, so
the acceptance rate is controlled; the target, the verification, the KV trim and the KDA pending
prefix all run for real. Greedy outputs are checked against plain decoding.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model
from mstar.speculative.oracle import OracleSpeculation
from mstar.tools.make_tiny import write_tiny


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, float]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    steps = 0
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    return [got[f"r{i}"] for i in range(len(prompts))], steps, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--error-rates", default="0,0.1,0.3,0.5,1")
    args = p.parse_args()
    torch.set_num_threads(1)
    target_dir, draft_dir = write_tiny(Path(tempfile.mkdtemp()))
    model, tokenizer = load_model(target_dir), KimiTokenizer.from_dir(target_dir)
    draft = K3DSparkModel.from_checkpoint(draft_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
    refs = {f"r{i}": pr + greedy_generate(model, pr, args.max_tokens) for i, pr in enumerate(prompts)}

    def engine(spec: bool) -> EngineCore:
        c = args.concurrency
        config = EngineConfig(max_seq_len=1024, resources={"mla_kv": {"page_size": 16, "max_num_pages": 64 * (c + 1)},
                                                           "kda_state": {"max_slots": c + 1}},
                              scheduler={"max_num_seqs": c, "max_num_batched_tokens": 4096},
                              model_kwargs={"speculative_tokens": args.k if spec else 0})
        return EngineCore(model, tokenizer, config, SpeculativeModels(draft) if spec else None)

    plain_out, plain_steps, plain_s = run(engine(False), prompts, args.max_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"## Oracle-proposer speculation, tiny K3 on CPU (1 thread), C={args.concurrency}, k={args.k}, "
          f"{args.prompt_len} in / {args.max_tokens} out (commit {commit})\n")
    print(f"Command: `python benchmarks/spec_oracle.py {' '.join(sys.argv[1:])}`\n")
    print("| draft error rate | mean accepted length | output tokens / target step | wall s | speedup |")
    print("|---|---|---|---|---|")
    out_tokens = args.concurrency * args.max_tokens
    print(f"| plain decoding | 1.00 | {out_tokens / plain_steps:.2f} | {plain_s:.2f} | 1.00x |")
    for e in [float(x) for x in args.error_rates.split(",")]:
        eng = engine(True)
        eng.spec = OracleSpeculation(eng.spec, refs, e, seed=1)
        outs, steps, secs = run(eng, prompts, args.max_tokens)
        assert outs == plain_out, "speculative greedy output differs from plain decoding"
        stats = eng.stats()
        print(f"| {e:.1f} | {stats.spec_mean_accepted_length:.2f} | {out_tokens / steps:.2f} | {secs:.2f} | "
              f"{plain_s / secs:.2f}x |")


if __name__ == "__main__":
    main()
