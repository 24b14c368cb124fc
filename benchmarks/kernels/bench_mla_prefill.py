"""Absorbed MLA prefill (`paged_mla_prefill`) on one GPU, by tile, against its FLOP floor and against FlashAttention.

One K3 TP8 rank: 12 heads, cached rows of 576 bf16 (512 latent + 64 rope), pages of 64 rows; one fresh sequence
of T tokens attending causally to itself (a prompt's single prefill chunk). Each tile is first checked against
the fp32 torch reference on a short prompt, then timed as CUDA-graph replays (median).

Floors at 750 TFLOP/s (bf16 dense), causal pairs T (T + 1) / 2 a head:
- absorbed (what the kernel computes): 2 (576 + 512) FLOPs a pair and head;
- expanded (the other form of the issue's roofline: K = [W_UK c | k_pe] of 192 columns, V = W_UV c of 128):
  2 (192 + 128) a pair and head, plus the expansion GEMM of the T cached rows (2 T 512 H 256).
The peer is torch's scaled_dot_product_attention (its FlashAttention backend, which needs one head size: V padded
to 192) on the expanded form, timed the same way, expansion not included.

    python3 benchmarks/kernels/bench_mla_prefill.py [--tokens 1024 8192] [--tiles 64x32x8x2 128x64x8x2 ...]

A tile is BLOCK_MxBLOCK_NxWARPSxSTAGES; the first row of each length is the default (`default_config`).
Full rows go to $OUT/bench_mla_prefill.json when OUT is set.
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

PEAK_FLOPS = 750e12
HEADS, WIDTH, LATENT, ROPE, NOPE, V_DIM, PAGE = 12, 576, 512, 64, 128, 128, 64
SCALE = 192**-0.5
DEFAULT_TILES = ["64x32x8x2", "64x64x8x2", "64x32x4x2", "64x32x8x3", "128x32x8x2", "128x64x8x2", "64x16x4x2"]


class Prompt:
    """One sequence of t tokens: its cache pages (shuffled), q_abs, out."""

    def __init__(self, t: int):
        self.t = t
        pages = -(-t // PAGE)
        self.cache = torch.randn(pages, PAGE, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
        self.q = torch.randn(t, HEADS, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(t, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
        self.cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        self.lens = torch.tensor([t], dtype=torch.int32, device="cuda")

    def call(self, config: mla.KernelConfig | None) -> torch.Tensor:
        return mla.paged_mla_prefill(self.q[..., :LATENT], self.q[..., LATENT:], self.cache, self.table, self.cu,
                                     self.lens, SCALE, self.out, config=config)

    def error(self, config: mla.KernelConfig | None) -> float:
        self.out.fill_(float("nan"))
        got = self.call(config).float()
        ref = mla.paged_mla_prefill_reference(self.q.float(), self.cache, self.table, self.cu, self.lens, SCALE)
        return relative_error(got, ref)


def floors_ms(t: int) -> tuple[float, float]:
    pairs = t * (t + 1) / 2 * HEADS
    absorbed = pairs * 2 * (WIDTH + LATENT)
    expanded = pairs * 2 * (NOPE + ROPE + V_DIM) + 2 * t * LATENT * HEADS * (NOPE + V_DIM)
    return absorbed / PEAK_FLOPS * 1e3, expanded / PEAK_FLOPS * 1e3


def peer_ms(t: int, reps: int) -> float:
    """SDPA (FlashAttention backend) on the expanded form, V padded to the 192 columns of Q and K."""
    q, k, v = (torch.randn(1, HEADS, t, NOPE + ROPE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)

    return time_graphs([capture(run)], reps) / 1e3


def parse_tile(spec: str) -> mla.KernelConfig:
    m, n, w, s = (int(x) for x in spec.split("x"))
    return mla.KernelConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, metavar="MxNxWARPSxSTAGES")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_prefill: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    check = Prompt(300)  # a few pages, a partial last one
    configs = [("default", None)] + [(spec, parse_tile(spec)) for spec in args.tiles]
    rows = []
    for t in args.tokens:
        prompt = Prompt(t)
        absorbed, expanded = floors_ms(t)
        peer = peer_ms(t, args.reps)
        for name, config in configs:
            try:
                err = check.error(config)
                ms = time_graphs([capture(lambda c=config, p=prompt: p.call(c))], args.reps) / 1e3
            except Exception as e:  # a tile that does not compile (shared memory, registers) is reported, not fatal
                print(f"T={t} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                continue
            rows.append({"tokens": t, "tile": name, "ms": ms, "rel_err": err, "absorbed_floor_ms": absorbed,
                         "expanded_floor_ms": expanded, "sdpa_expanded_ms": peer})
            print(f"T={t} {name}: {ms:.3f} ms ({ms / absorbed:.1f}x absorbed floor), rel err {err:.1e}",
                  file=sys.stderr)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_mla_prefill.json").write_text(json.dumps(rows, indent=1))
    print("\n| T | tile | ms | absorbed floor ms | × | expanded floor ms | SDPA expanded ms | rel err |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['tile']} | {r['ms']:.3f} | {r['absorbed_floor_ms']:.3f} | "
              f"{r['ms'] / r['absorbed_floor_ms']:.1f} | {r['expanded_floor_ms']:.3f} | {r['sdpa_expanded_ms']:.3f} | "
              f"{r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
