"""Absorbed MLA over short query blocks (`paged_mla_prefill` as verify and the DSpark draft run it) on one GPU, by
split count and minimum piece length, against the byte floor.

A verify block at one TP8 rank of pruned75 is k + 1 query rows x 12 heads over ~1,000 cached rows (576 bf16 each):
a few programs, so the kernel is latency-bound and how the context is cut decides its time. The draft's block is
k rows x 64 heads, bidirectional over its context and its own rows (`causal=False`). Each case is checked against
the fp32 torch reference, then timed as CUDA-graph replays (median; the merge launch of split runs included).
The floor is the bytes the call must move (each sequence's cached rows, q and out once) at 4.26 TB/s.

    python3 benchmarks/kernels/bench_mla_verify.py [--batches 1 16] [--contexts 1024 8192] [--min-splits 32 64 128]

The first row of each shape is today's choice (`num_splits_for` at DEFAULT_MIN_SPLIT_TOKENS). Full rows go to
$OUT/bench_mla_verify.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe_mxfp4 import capture, relative_error, time_graphs  # noqa: E402

from mstar.kernels import mla_attention as mla  # noqa: E402

HBM_BYTES_PER_S = 4.26e12
WIDTH, LATENT, PAGE = 576, 512, 64
SCALE = 192**-0.5
# (name, heads, query rows, causal): the target's verify block at k = 7 and the draft's block of 7
SHAPES = (("verify k=7", 12, 8, True), ("draft k=7", 64, 7, False))


class Blocks:
    """B sequences of `context` cached rows (shuffled pages), each with its block of `rows` queries at the end."""

    def __init__(self, batch: int, context: int, heads: int, rows: int, causal: bool):
        self.batch, self.heads, self.rows, self.causal = batch, heads, rows, causal
        pages = -(-context // PAGE)
        self.cache = torch.randn(batch * pages + 1, PAGE, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.table = (1 + torch.randperm(batch * pages, device="cuda", dtype=torch.int32)).view(batch, pages)
        self.q = torch.randn(batch * rows, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(batch * rows, heads, LATENT, device="cuda", dtype=torch.bfloat16)
        self.cu = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda")
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.bytes = batch * context * WIDTH * 2 + self.q.numel() * 2 + self.out.numel() * 2

    def call(self, splits: int, min_split: int, workspace) -> torch.Tensor:
        return mla.paged_mla_prefill(self.q[..., :LATENT], self.q[..., LATENT:], self.cache, self.table, self.cu,
                                     self.lens, SCALE, self.out, max_query_len=self.rows, num_splits=splits,
                                     min_split_tokens=min_split, workspace=workspace, causal=self.causal)

    def workspace(self, splits: int):
        return mla.split_workspace(splits, self.q.shape[0], self.heads, LATENT, "cuda") if splits > 1 else None

    def error(self, splits: int, min_split: int) -> float:
        self.out.fill_(float("nan"))
        got = self.call(splits, min_split, self.workspace(splits)).float()
        ref = mla.paged_mla_prefill_reference(self.q.float(), self.cache, self.table, self.cu, self.lens, SCALE,
                                              causal=self.causal)
        return relative_error(got, ref)

    def time_us(self, splits: int, min_split: int, reps: int) -> float:
        workspace = self.workspace(splits)
        return time_graphs([capture(lambda: self.call(splits, min_split, workspace))], reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--min-splits", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_verify: needs a CUDA GPU")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {num_sms} SMs, torch {torch.__version__}", file=sys.stderr)
    rows = []
    for name, heads, q_rows, causal in SHAPES:
        for batch in args.batches:
            for context in args.contexts:
                blocks = Blocks(batch, context, heads, q_rows, causal)
                floor_us = blocks.bytes / HBM_BYTES_PER_S * 1e6
                today = mla.num_splits_for(batch, heads, context, query_rows=q_rows, num_sms=num_sms)
                cases = [(today, mla.DEFAULT_MIN_SPLIT_TOKENS)]
                for m in args.min_splits:
                    s = mla.num_splits_for(batch, heads, context, query_rows=q_rows, num_sms=num_sms,
                                           min_split_tokens=m)
                    cases += [(s, m)] if (s, m) not in cases else []
                for splits, m in cases:
                    err = blocks.error(splits, m)
                    us = blocks.time_us(splits, m, args.reps)
                    rows.append({"shape": name, "heads": heads, "rows": q_rows, "batch": batch, "context": context,
                                 "splits": splits, "min_split": m, "us": us, "floor_us": floor_us, "rel_err": err,
                                 "today": (splits, m) == cases[0]})
                    print(f"{name} B={batch} ctx={context} splits={splits} min_split={m}: {us:.1f} us "
                          f"({us / floor_us:.1f}x floor), rel err {err:.1e}", file=sys.stderr)
                del blocks
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_mla_verify.json").write_text(json.dumps(rows, indent=1))
    print("\n| block | B | context | splits | min piece | µs | floor µs | × floor | rel err |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        mark = " (today)" if r["today"] else ""
        print(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['splits']}{mark} | {r['min_split']} | "
              f"{r['us']:.1f} | {r['floor_us']:.2f} | {r['us'] / r['floor_us']:.1f} | {r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
