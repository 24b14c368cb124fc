"""One routed-expert step of a TP8 rank of pruned75 per token count, for Nsight Compute: what the hardware counters
say holds the MoE GEMM kernels back (issue slots, warp stalls, occupancy, DRAM throughput).

    ncu --clock-control none -k regex:'_gate_up_kernel|_down_kernel' --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 benchmarks/kernels/profile_moe_mxfp4.py --tokens 64

Each token count runs the step twice with `default_config` (the first call compiles, so --launch-skip 2 skips it)
on the shapes and random weights of bench_moe_mxfp4.py, one weight copy (the profiler flushes caches between
kernels itself).
"""

from __future__ import annotations

import argparse

import torch
from bench_moe_mxfp4 import E, H, I, K, make_inputs, make_weights

from mstar.kernels import moe_mxfp4 as moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_moe_mxfp4: needs a CUDA GPU")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    stacked = make_weights(gen)
    for num_tokens in args.tokens:
        z, ids, weights = make_inputs(num_tokens, gen)
        for _ in range(2):
            moe.moe_mxfp4(z, ids, weights, *stacked)
        torch.cuda.synchronize()
        print(f"T={num_tokens}: {moe.fit_config(moe.default_config(num_tokens, K, E), H, I)}")


if __name__ == "__main__":
    main()
