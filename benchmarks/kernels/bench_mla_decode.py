"""Absorbed MLA decode over the paged latent cache (`paged_mla_decode`) on one GPU, against the byte floor.

One K3 TP8 rank: 12 heads, rows of 576 bf16 (512 latent + 64 rope), pages of 64 rows, one query per
sequence. The floor is the bytes a decode call must move (every cached row once, q once, out once) over
the H200's measured copy bandwidth, 4.26 TB/s. Each shape is first checked against the fp32 torch
reference, then timed as CUDA-graph replays (median of many). Small shapes rotate over several input
sets inside one graph, so that one pass reads well past the 50 MB L2 and the time is HBM's, not L2's;
the time per call includes the launch gaps a decode graph would have.

Run from the repository root on the GPU machine (no install needed):
    python3 benchmarks/kernels/bench_mla_decode.py            # the table (about a minute)
    python3 benchmarks/kernels/bench_mla_decode.py --sweep    # also other tiles, split counts and minimum
                                                              # piece lengths (a few minutes)
    python3 benchmarks/kernels/bench_mla_decode.py --heads 96 # one TP1 rank
Full results go to $OUT/bench_mla_decode.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mstar.kernels import mla_attention as mla  # noqa: E402

HBM_BYTES_PER_S = 4.26e12  # measured copy bandwidth of the H200 (DESIGN.md)
ROTATE_BYTES = 256 << 20  # one graph replay reads at least this much: ~5x the L2
MAX_SETS = 256
WIDTH, LATENT = 576, 512
SCALE = 192**-0.5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Shape:
    """Input sets for one (batch, context): disjoint shuffled pages of one cache, q and out per set."""

    def __init__(self, batch: int, context: int, heads: int, page_size: int):
        self.batch, self.context, self.heads = batch, context, heads
        self.bytes = mla.decode_bytes(batch, context, heads)
        self.sets = max(1, min(MAX_SETS, cdiv(ROTATE_BYTES, self.bytes)))
        per_seq = cdiv(context, page_size)
        num_pages = self.sets * batch * per_seq
        self.cache = torch.randn(num_pages, page_size, WIDTH, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_pages, device="cuda", dtype=torch.int32)
        self.tables = perm.view(self.sets, batch, per_seq)
        self.q = torch.randn(self.sets, batch, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(self.sets, batch, heads, LATENT, device="cuda", dtype=torch.bfloat16)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def call(self, s: int, num_splits: int, workspace, config, min_split: int) -> None:
        q = self.q[s]  # the query's parts as views of one q_abs
        mla.paged_mla_decode(q[..., :LATENT], q[..., LATENT:], self.cache, self.tables[s], self.lens, SCALE,
                             self.out[s], num_splits=num_splits, workspace=workspace, config=config,
                             min_split_tokens=min_split)

    def check(self, num_splits: int, config, min_split: int = mla.DEFAULT_MIN_SPLIT_TOKENS) -> float:
        """Relative error of set 0 against the fp32 reference (output poisoned first)."""
        self.out[0].fill_(float("nan"))
        self.call(0, num_splits, None, config, min_split)
        # fp32 q makes the reference upcast each sequence's gathered rows: fp32 math, no fp32 copy of the cache.
        ref = mla.paged_mla_decode_reference(self.q[0].float(), self.cache, self.tables[0], self.lens, SCALE)
        out = self.out[0].float()
        if not torch.isfinite(out).all():
            return float("nan")
        return ((out - ref).norm() / ref.norm()).item()

    def time_us(self, num_splits: int, config, min_split: int = mla.DEFAULT_MIN_SPLIT_TOKENS,
                replays: int = 30) -> float:
        """Median microseconds per decode call, from graph replays over all input sets."""
        workspace = (mla.split_workspace(num_splits, self.batch, self.heads, LATENT, "cuda")
                     if num_splits > 1 else None)
        self.call(0, num_splits, workspace, config, min_split)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in range(self.sets):
                self.call(s, num_splits, workspace, config, min_split)
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.sets)
        del graph
        return statistics.median(times)


def kernel_resources() -> list[str]:
    """Registers, spills and shared memory of every compiled variant (read off Triton's cache)."""
    lines = []
    for fn in (mla._mla_attn_kernel, mla._mla_merge_kernel):
        for caches in fn.device_caches.values():
            for kernel in caches[0].values():
                try:  # constexprs are keyed by argument position; keep the named tile options
                    names = [fn.arg_names[k[0]] for k in kernel.src.constants]
                    consts = {n: v for n, v in zip(names, kernel.src.constants.values(), strict=True) if n.isupper()}
                except (AttributeError, IndexError, TypeError):
                    consts = {}
                meta = kernel.metadata
                lines.append(f"{fn.__name__} {consts} warps={meta.num_warps} stages={getattr(meta, 'num_stages', '?')} "
                             f"regs={kernel.n_regs} spills={kernel.n_spills} shared={meta.shared}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=12, help="heads on this rank (12 = TP8, 96 = TP1)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--sweep", action="store_true", help="also time other tiles and split counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode needs a CUDA GPU")
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    num_sms = props.multi_processor_count
    import triton

    print(f"{props.name}, {num_sms} SMs, capability {props.major}.{props.minor}, torch {torch.__version__}, "
          f"triton {triton.__version__}; supported() = {mla.supported(device)}")
    print(f"heads {args.heads}, page size {args.page_size}, floor at {HBM_BYTES_PER_S / 1e12:.2f} TB/s")

    rows, sweep_rows = [], []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            shape = Shape(batch, context, args.heads, args.page_size)
            base = mla.default_config(args.heads, args.page_size, multi_query=False)
            splits = mla.num_splits_for(batch, args.heads, context, num_sms=num_sms)
            err = shape.check(splits, base)
            us = shape.time_us(splits, base)
            floor_us = shape.bytes / HBM_BYTES_PER_S * 1e6
            row = dict(batch=batch, context=context, splits=splits, sets=shape.sets, floor_us=floor_us, us=us,
                       ratio=us / floor_us, tb_s=shape.bytes / us / 1e6, rel_err=err, config=base.__dict__)
            rows.append(row)
            print(f"B={batch:3d} ctx={context:6d} splits={splits:3d}: {us:9.2f} us, floor {floor_us:8.2f} us, "
                  f"x{us / floor_us:5.2f}, err {err:.1e}", flush=True)
            if args.sweep:
                configs = [base]
                if args.heads <= 16:
                    configs += [mla.KernelConfig(16, 32, 4, 2), mla.KernelConfig(16, 64, 4, 3),
                                mla.KernelConfig(16, 64, 8, 2), mla.KernelConfig(16, 128, 8, 2)]
                for cfg in configs:
                    for min_split in (64, 128, 256):
                        best_s = mla.num_splits_for(batch, args.heads, context, num_sms=num_sms,
                                                    min_split_tokens=min_split)
                        for s in sorted({1, max(1, best_s // 2), best_s, min(256, best_s * 2)}):
                            if s > 1 and cdiv(context, s) < min_split // 2:
                                continue  # pieces would be clamped to min_split: same as fewer splits
                            try:
                                t = shape.time_us(s, cfg, min_split, replays=15)
                                e = shape.check(s, cfg, min_split)
                            except Exception as exc:  # e.g. a tile that does not fit in shared memory
                                print(f"  sweep {cfg} splits={s}: {type(exc).__name__}: {str(exc)[:120]}")
                                continue
                            sweep_rows.append(dict(batch=batch, context=context, splits=s, min_split=min_split,
                                                   config=cfg.__dict__, us=t, ratio=t / floor_us, rel_err=e))
                            print(f"  sweep bm={cfg.block_m} bn={cfg.block_n} w={cfg.num_warps} "
                                  f"st={cfg.num_stages} min_split={min_split:3d} splits={s:3d}: {t:9.2f} us "
                                  f"x{t / floor_us:5.2f} err {e:.1e}", flush=True)
            del shape
            torch.cuda.empty_cache()

    resources = kernel_resources()
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_mla_decode.json"
        path.write_text(json.dumps(dict(device=props.name, heads=args.heads, page_size=args.page_size, rows=rows,
                                        sweep=sweep_rows, kernels=resources), indent=1))
        print(f"wrote {path}")
    print("\ncompiled kernels:")
    for line in resources:
        print("  " + line)
    if sweep_rows:
        print("\nbest of the sweep per shape:")
        for batch in sorted({r["batch"] for r in sweep_rows}):
            for context in sorted({r["context"] for r in sweep_rows}):
                best = min((r for r in sweep_rows if (r["batch"], r["context"]) == (batch, context)),
                           key=lambda r: r["us"], default=None)
                if best:
                    c = best["config"]
                    print(f"  B={batch:3d} ctx={context:6d}: {best['us']:9.2f} us x{best['ratio']:5.2f} "
                          f"(bm={c['block_m']} bn={c['block_n']} w={c['num_warps']} st={c['num_stages']} "
                          f"splits={best['splits']} min_split={best['min_split']})")

    print(f"\npaged_mla_decode, H={args.heads}, page {args.page_size}, bf16, CUDA graph median per call")
    print(f"| {'B':>3} | {'context':>7} | {'splits':>6} | {'floor µs':>9} | {'measured µs':>11} | {'ratio':>6} | "
          f"{'TB/s':>5} | {'rel err':>7} |")
    print(f"|{'-' * 5}|{'-' * 9}|{'-' * 8}|{'-' * 11}|{'-' * 13}|{'-' * 8}|{'-' * 7}|{'-' * 9}|")
    for r in rows:
        print(f"| {r['batch']:>3} | {r['context']:>7} | {r['splits']:>6} | {r['floor_us']:>9.2f} | {r['us']:>11.2f} | "
              f"{r['ratio']:>6.2f} | {r['tb_s']:>5.2f} | {r['rel_err']:>7.1e} |")


if __name__ == "__main__":
    main()
