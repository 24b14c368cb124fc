"""Large steps of one TP8 rank of pruned75's routed experts: the MXFP4 W4A16 kernels (moe_mxfp4) against
the bf16 path (moe_bf16: dequantize the layer's experts once, bf16 grouped GEMMs), against the FLOP floor.

    python benchmarks/kernels/bench_moe_bf16.py [--tokens 2048 6144 8192] [--reps 50]

Shapes, weights, routing and timing as benchmarks/kernels/bench_moe_mxfp4.py (E = 224, top-16, H_lat =
3584, I = 384; each step captured in a CUDA graph, replays rotating over weight copies, median of CUDA-event
times). The bf16 path's graphs share one scratch, as the layers of a model do; 'dequant' times its first
two launches alone (they do not depend on T), 'GEMMs+SiTU' its two torch._grouped_mm and SiTU alone, and
'rest' is what remains: the sort, the gather of z's rows and the combine.

Floors: FLOPs 2 x 3 x H x I per (token, expert) pair at 750 TFLOP/s (bf16 tensor cores, DESIGN.md),
1.44 ms at T = 8192; the dequantization moves 491 MB in and 1.85 GB out, 0.55 ms at 4.26 TB/s. 'TFLOP/s'
is the step's GEMM FLOPs over its time. MSTAR_MOE_BF16_TOKENS (default 6144) should sit where the bf16
column overtakes the MXFP4 one. Full results go to $OUT/bench_moe_bf16.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from bench_moe_mxfp4 import (
    DEVICE,
    SETS,
    E,
    H,
    I,
    K,
    MstarStep,
    capture,
    make_inputs,
    make_weights,
    permuted,
    relative_error,
    time_graphs,
)

from mstar.config import NO_ENV
from mstar.kernels import moe_bf16
from mstar.kernels import moe_mxfp4 as moe
from mstar.kernels.gated_mlp import situ_and_mul


class Bf16Step:
    """moe_bf16 at one token count: an output and one captured graph per weight copy, one shared scratch."""

    def __init__(self, sets, scratch: moe_bf16.DequantizedExperts, z, ids, weights):
        self.sets, self.scratch, self.z, self.ids, self.weights = sets, scratch, z, ids, weights
        self.out = torch.empty(z.shape[0], H, device=DEVICE)

    def run(self, stacked):
        return moe_bf16.moe_bf16(self.z, self.ids, self.weights, *stacked, scratch=self.scratch, out=self.out)

    def check(self, ref: torch.Tensor) -> float:
        self.out.fill_(float("nan"))
        self.scratch.w13.fill_(float("nan"))
        self.run(self.sets[0])
        return relative_error(self.out, ref)

    def time(self, reps: int) -> float:
        return time_graphs([capture(lambda s=s: self.run(s)) for s in self.sets], reps)


def time_dequant(sets, scratch, reps: int) -> float:
    return time_graphs([capture(lambda s=s: moe_bf16.dequantize_experts(s, scratch)) for s in sets], reps)


def time_gemms(scratch, z, ids, reps: int) -> float:
    """The bf16 path's gate/up GEMM, SiTU and down GEMM alone, on rows already sorted and gathered: the rest
    of its time (bf16 us - dequant us - this) is the sort, the gather and the combine."""
    pairs = ids.numel()
    sorted_pair, pair_row = (torch.empty(pairs, dtype=torch.int32, device=DEVICE) for _ in range(2))
    expert_end = torch.empty(E, dtype=torch.int32, device=DEVICE)
    moe.sort_by_expert(ids, E, sorted_pair, expert_end, pair_row)
    rows = moe_bf16._gather_rows(z, sorted_pair, expert_end, K)

    def gemms():
        gate_up = torch._grouped_mm(rows, scratch.w13.transpose(1, 2), offs=expert_end)
        act = situ_and_mul(gate_up, moe.SITU_BETA, moe.SITU_LINEAR_BETA)
        return torch._grouped_mm(act, scratch.w2.transpose(1, 2), offs=expert_end)

    return time_graphs([capture(gemms)], reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 6144, 8192])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_bf16: needs a CUDA GPU")
    if not moe_bf16.supported("cuda"):
        sys.exit(f"bench_moe_bf16: the bf16 path serves on compute capability 9.0 only, this GPU is "
                 f"{torch.cuda.get_device_capability()}")

    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"MSTAR_MOE_BF16_TOKENS default {NO_ENV.moe_bf16_tokens}")
    gen = torch.Generator(device=DEVICE)
    print(f"seed = {gen.seed()}")
    sets = [make_weights(gen)]
    sets += [permuted(sets[0], gen) for _ in range(SETS - 1)]
    scratch = moe_bf16.DequantizedExperts.allocate(E, H, I, DEVICE)
    dequant_us = time_dequant(sets, scratch, args.reps)
    weights_out = E * 3 * H * I
    dequant_floor_us = (moe.expert_bytes(H, I) * E + 2 * weights_out) / moe.HBM_BYTES_PER_S * 1e6
    print(f"weights ready; dequantization {dequant_us:.1f} us (floor {dequant_floor_us:.1f}) "
          f"({time.time() - t0:.0f} s)")

    results = []
    for num_tokens in args.tokens:
        z, ids, weights = make_inputs(num_tokens, gen)
        ref = moe.moe_mxfp4_reference(z, ids, weights, *sets[0])
        flops = 6 * H * I * num_tokens * K
        floor_us = moe_bf16.flop_floor_s(num_tokens, K, H, I) * 1e6
        mxfp4 = MstarStep(sets, z, ids, weights, moe.default_config(num_tokens, K, E))
        bf16 = Bf16Step(sets, scratch, z, ids, weights)
        row = {"tokens": num_tokens, "flops": flops, "floor_us": floor_us,
               "mxfp4_err": mxfp4.check(ref), "mxfp4_us": mxfp4.time(args.reps),
               "bf16_err": bf16.check(ref), "bf16_us": bf16.time(args.reps), "dequant_us": dequant_us,
               "gemms_us": time_gemms(scratch, z, ids, args.reps), "mxfp4_config": str(mxfp4.config)}
        results.append(row)
        print(f"T={num_tokens}: mxfp4 {row['mxfp4_us']:.1f} us, bf16 {row['bf16_us']:.1f} us (floor {floor_us:.1f}); "
              f"errors {row['mxfp4_err']:.1e} / {row['bf16_err']:.1e} ({time.time() - t0:.0f} s)")
        del mxfp4, bf16
        torch.cuda.empty_cache()

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_moe_bf16.json"), "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "dequant_floor_us": dequant_floor_us,
                       "results": results}, f, indent=1)
    print()
    print(f"Routed experts at large T, one TP8 rank of pruned75 (E={E}, top-{K}, H_lat={H}, I={I}); CUDA graph, "
          f"median; FLOP floor at {moe_bf16.BF16_FLOPS / 1e12:.0f} TFLOP/s; dequantization {dequant_us:.1f} us "
          f"of every bf16 step (floor {dequant_floor_us:.1f} us)")
    head = ["T", "floor us", "mxfp4 us", "x floor", "TFLOP/s", "bf16 us", "x floor", "TFLOP/s", "bf16 speedup",
            "bf16 GEMMs+SiTU us (TFLOP/s)", "bf16 rest us", "rel err mxfp4 / bf16"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        cells = [str(r["tokens"]), f"{r['floor_us']:.1f}"]
        for name in ("mxfp4", "bf16"):
            us = r[f"{name}_us"]
            cells += [f"{us:.1f}", f"{us / r['floor_us']:.2f}x", f"{r['flops'] / us / 1e6:.0f}"]
        gemms, rest = r["gemms_us"], r["bf16_us"] - r["dequant_us"] - r["gemms_us"]
        cells += [f"{r['mxfp4_us'] / r['bf16_us']:.2f}x", f"{gemms:.1f} ({r['flops'] / gemms / 1e6:.0f})",
                  f"{rest:.1f}", f"{r['mxfp4_err']:.1e} / {r['bf16_err']:.1e}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
