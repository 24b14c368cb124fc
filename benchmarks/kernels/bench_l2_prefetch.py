"""Does a side-stream L2 prefetch during a collective's wait speed up the projection after it? (kernels/l2_prefetch.py)

Per decode projection of a TP8 rank of pruned75 (the shapes bench_skinny_gemm.py lists), and for the routed experts
of one token (16 random experts of 224, MXFP4): a CUDA graph of `copies` rounds of [a modeled 6 us collective
(gpu_delay), then the projection], each round on its own copy of the weights (together over 4x the L2, so
that no round finds the previous one's bytes), timed three ways:

- wait only: the rounds' waits alone;
- plain: wait, then the projection (`skinny_gemm.linear`: ours or cuBLAS by the measured table; `moe_mxfp4`);
- prefetch: the same, with `l2_prefetch.prefetch` of that round's weights on a side stream forked as the wait
  begins (the experts': the slices of the round's ids).

The projection's cost is the round's time less the wait's; the floor is its bytes at 4.3 TB/s. Run on the GPU:

    python3 benchmarks/kernels/bench_l2_prefetch.py [--wait-us 6] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mstar.kernels import gpu_delay, l2_prefetch, moe_mxfp4, skinny_gemm

HBM_BYTES_PER_S = 4.3e12
L2_ROTATION_BYTES = 200 * 2**20  # the rounds' weights together: 4x the 50 MB L2
# (name, N, K) of a TP8 rank of pruned75 at decode (bench_skinny_gemm.py's decode_projections)
PROJECTIONS = (("MoE inputs (router, latent down, shared gate/up)", 2208, 7168), ("latent MoE output", 7168, 1216),
               ("o_proj", 7168, 1536), ("MLA inputs (q_a, kv_a, gate)", 3648, 7168), ("KDA inputs", 6288, 7168))
EXPERTS, TOP_K, H_LATENT, INTER = 224, 16, 3584, 384


def graph_time(rounds, reps: int) -> float:
    """Median µs of one replay of the graph of `rounds` (callables, captured in order on the current stream)."""
    for r in rounds:  # compile / allocate outside the capture
        r()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in rounds:
            r()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


class Rounds:
    """The three graphs over one list of (work, segments, ids) rounds."""

    def __init__(self, wait_ns: int, side: torch.cuda.Stream):
        self.wait_ns, self.side = wait_ns, side
        self.tally = torch.zeros(3, dtype=torch.int64, device="cuda")

    def wait(self):
        gpu_delay.delay(self.wait_ns, 0, self.tally)

    def fork_prefetch(self, segments, ids):
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            l2_prefetch.prefetch(segments, ids)

    def time(self, rounds, reps: int) -> dict:
        n = len(rounds)
        wait_us = graph_time([self.wait] * n, reps) / n

        def plain(work):
            return lambda: (self.wait(), work())

        def fetched(work, segments, ids):
            def go():
                self.fork_prefetch(segments, ids)
                self.wait()
                work()
            return go

        def joined(calls):
            return [*calls, lambda: torch.cuda.current_stream().wait_stream(self.side)]

        plain_us = graph_time([plain(w) for w, _, _ in rounds], reps) / n - wait_us
        prefetch_us = graph_time(joined([fetched(*r) for r in rounds]), reps) / n - wait_us
        return {"wait_us": wait_us, "plain_us": plain_us, "prefetch_us": prefetch_us}


def projection_rounds(n: int, k: int):
    nbytes = n * k * 2
    copies = max(4, -(-L2_ROTATION_BYTES // nbytes))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return nbytes, [(lambda w=w: skinny_gemm.linear(x, w), [l2_prefetch.Segment.of(w)], None) for w in weights]


def expert_rounds():
    g = torch.Generator(device="cuda").manual_seed(0)
    stacked = moe_mxfp4.StackedExperts(
        torch.randint(0, 256, (EXPERTS, 2 * INTER, H_LATENT // 2), dtype=torch.uint8, device="cuda", generator=g),
        torch.randint(118, 124, (EXPERTS, 2 * INTER, H_LATENT // 32), dtype=torch.uint8, device="cuda", generator=g),
        torch.randint(0, 256, (EXPERTS, H_LATENT, INTER // 2), dtype=torch.uint8, device="cuda", generator=g),
        torch.randint(118, 124, (EXPERTS, H_LATENT, INTER // 32), dtype=torch.uint8, device="cuda", generator=g))
    per_expert = moe_mxfp4.expert_bytes(H_LATENT, INTER)
    rounds_n = max(4, -(-L2_ROTATION_BYTES // (TOP_K * per_expert)))
    z = torch.randn(1, H_LATENT, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(1, TOP_K, device="cuda")
    segments = [l2_prefetch.Segment.of(t, per_expert=True) for t in stacked]
    rounds = []
    for _ in range(rounds_n):
        ids = torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K].reshape(1, TOP_K).to(torch.int32)
        out = torch.empty(1, H_LATENT, device="cuda", dtype=torch.float32)
        ws = moe_mxfp4.MoEWorkspace.allocate(1, TOP_K, EXPERTS, H_LATENT, INTER,
                                             moe_mxfp4.fit_config(moe_mxfp4.default_config(1, TOP_K, EXPERTS),
                                                                  H_LATENT, INTER), z.device)
        rounds.append((lambda ids=ids, out=out, ws=ws: moe_mxfp4.moe_mxfp4(z, ids, weights, *stacked, out=out,
                                                                              workspace=ws), segments, ids))
    return TOP_K * per_expert, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wait-us", type=float, default=6.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not (torch.cuda.is_available() and l2_prefetch.supported("cuda")):
        sys.exit("bench_l2_prefetch: needs a CUDA GPU of compute capability 9.0+")
    gpu_delay.calibrate("cuda")
    timer = Rounds(round(args.wait_us * 1e3), torch.cuda.Stream())
    cases = [(name, *projection_rounds(n, k)) for name, n, k in PROJECTIONS]
    cases.append(("routed experts, 1 token (16 of 224, MXFP4)", *expert_rounds()))
    rows = []
    print(f"{torch.cuda.get_device_name()}: a {args.wait_us:g} us modeled wait, then the projection; µs per round")
    print("| projection | MB | floor µs | plain µs | prefetch µs | saved µs | plain/floor | prefetch/floor |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, nbytes, rounds in cases:
        t = timer.time(rounds, args.reps)
        floor = nbytes / HBM_BYTES_PER_S * 1e6
        rows.append({"name": name, "bytes": nbytes, "floor_us": floor, **t})
        plain, fetched = t["plain_us"], t["prefetch_us"]
        print(f"| {name} | {nbytes / 1e6:.1f} | {floor:.2f} | {plain:.2f} | {fetched:.2f} | {plain - fetched:.2f} | "
              f"{plain / floor:.2f} | {fetched / floor:.2f} |")
        del rounds
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"wait_us": args.wait_us, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
