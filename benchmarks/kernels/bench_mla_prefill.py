"""MLA prefill on one GPU, the absorbed and the expanded form by tile, against their FLOP floors and FlashAttention.

The absorbed kernel (`paged_mla_prefill`), and the expanded path (mstar/kernels/mla_expanded.py) whole and by part.

One K3 TP8 rank: 12 heads, cached rows of 576 bf16 (512 latent + 64 rope), pages of 64 rows, kv_b_proj of
12 x (128 + 128) rows. Each tile is first checked against the fp32 torch reference on a short prompt (the expanded
ones on a 300-token chunk after 100 cached rows), then timed as CUDA-graph replays (median).

Floors at 750 TFLOP/s (bf16 dense), causal pairs T (T + 1) / 2 a head:
- absorbed (what the absorbed kernel computes): 2 (576 + 512) FLOPs a pair and head;
- expanded (K = [W_UK c | k_pe] of 192 columns, V = W_UV c of 128): 2 (192 + 128) a pair and head, plus the
  expansion GEMM of the T new rows (2 T 512 H 256); with a prefix of P cached rows, its absorbed pass
  (2 T P (576 + 512) H) and the queries' W_UK^T and the output's W_UV (2 T 512 H 256): `mla_expanded.expanded_flops`;
- the expanded kernel alone: its pairs only.
The peer is torch's scaled_dot_product_attention (its FlashAttention backend, which needs one head size: V padded
to 192) on the expanded form of a fresh prompt, timed the same way, expansion not included.

Second table, a chunk of T new tokens after P cached rows (P = 0: a fresh prompt), as GpuMixerOps.mla runs it
(`_mla_expanded`): the new rows gathered from their slots, the expansion GEMM (cuBLAS), the prefix pass (W_UK^T q,
the absorbed kernel with causal=False and its lse, W_UV; skipped at P = 0 as a step whose host knows there is no
prefix skips it), the expanded kernel; each part also timed alone. "absorbed path": W_UK^T q, the absorbed kernel
over all P + T rows (its default tile), W_UV: what the step runs without the expanded form.

    python3 benchmarks/kernels/bench_mla_prefill.py [--tokens 1024 8192] [--prefixes 0 4096]
        [--tiles 64x32x8x2 ...] [--expanded-tiles 128x64x8x2 ...]

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
from mstar.kernels import mla_expanded as mx  # noqa: E402

PEAK_FLOPS = 750e12
HEADS, WIDTH, LATENT, ROPE, NOPE, V_DIM, PAGE = 12, 576, 512, 64, 128, 128, 64
SCALE = 192**-0.5
DEFAULT_TILES = ["64x32x8x2", "64x64x8x2", "64x32x4x2", "64x32x8x3", "128x32x8x2", "128x64x8x2", "64x16x4x2"]
EXPANDED_TILES = ["128x64x8x2", "128x64x8x3", "64x64x4x2", "128x32x8x2", "64x32x4x2", "128x128x8x2"]


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


class Chunk:
    """T new tokens of one sequence after P cached rows, in place as a prefill step leaves them: the cache pages
    (shuffled) holding all P + T rows, the queries [T, H, 192] (q_nope and q_pe views), kv_b_proj's weight, the
    new rows' slots; outputs and intermediates preallocated, so that each part captures alone."""

    def __init__(self, t: int, prefix: int):
        self.t, self.prefix = t, prefix
        ctx = prefix + t
        pages = -(-ctx // PAGE)
        self.cache = torch.randn(pages, PAGE, WIDTH, device="cuda", dtype=torch.bfloat16)
        self.table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
        positions = torch.arange(prefix, ctx, device="cuda")
        self.slots = self.table[0, positions // PAGE].long() * PAGE + positions % PAGE
        self.q = torch.randn(t, HEADS, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
        self.q_nope, self.q_pe = self.q[..., :NOPE], self.q[..., NOPE:]
        self.weight = (torch.randn(HEADS * (NOPE + V_DIM), LATENT, device="cuda") * LATENT**-0.5).bfloat16()
        w = self.weight.view(HEADS, NOPE + V_DIM, LATENT)
        self.w_uk, self.w_uv = w[:, :NOPE], w[:, NOPE:]
        self.cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        self.lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        self.prefix_lens = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        self.out = torch.empty(t, HEADS, V_DIM, device="cuda", dtype=torch.bfloat16)
        self.o_lat = torch.empty(t, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
        # the parts' results, for timing the later parts alone
        self.rows = self.gather()
        self.kv = self.expand()
        self.state = self.prefix_pass() if prefix else None

    def gather(self) -> torch.Tensor:
        return self.cache.view(-1, WIDTH)[self.slots]

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return mx.expand_kv(self.rows[:, :LATENT], self.weight, HEADS, NOPE)

    def prefix_pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        q_lat = torch.einsum("thd,hdr->thr", self.q_nope, self.w_uk)
        splits = mla.num_splits_for(1, HEADS, self.prefix + self.t, query_rows=self.t)  # as step_metadata splits
        return mx.prefix_state(q_lat, self.q_pe, self.cache, self.table, self.cu, self.prefix_lens, SCALE, self.w_uv,
                               max_query_len=self.t, num_splits=splits)

    def kernel(self, config: mla.KernelConfig | None) -> torch.Tensor:
        k_nope, v = self.kv
        return mx.mla_prefill_expanded(self.q_nope, self.q_pe, k_nope, v, self.rows[:, LATENT:], self.cu, self.lens,
                                       SCALE, self.out, prefix=self.state, max_query_len=self.t, config=config)

    def expanded(self, config: mla.KernelConfig | None) -> torch.Tensor:
        """The whole path, as `GpuMixerOps._mla_expanded` runs it."""
        rows = self.gather()
        k_nope, v = mx.expand_kv(rows[:, :LATENT], self.weight, HEADS, NOPE)
        state = self.prefix_pass() if self.prefix else None
        return mx.mla_prefill_expanded(self.q_nope, self.q_pe, k_nope, v, rows[:, LATENT:], self.cu, self.lens, SCALE,
                                       self.out, prefix=state, max_query_len=self.t, config=config)

    def absorbed(self) -> torch.Tensor:
        """The absorbed path of the same step: W_UK^T q, the absorbed kernel over all rows, W_UV."""
        q_lat = torch.einsum("thd,hdr->thr", self.q_nope, self.w_uk)
        splits = mla.num_splits_for(1, HEADS, self.prefix + self.t, query_rows=self.t)
        mla.paged_mla_prefill(q_lat, self.q_pe, self.cache, self.table, self.cu, self.lens, SCALE, self.o_lat,
                              max_query_len=self.t, num_splits=splits)
        return torch.einsum("thr,hvr->thv", self.o_lat, self.w_uv)

    def error(self, config: mla.KernelConfig | None) -> float:
        self.out.fill_(float("nan"))
        got = self.expanded(config).float()
        ref = mx.paged_mla_expanded_reference(self.q_nope.float(), self.q_pe.float(), self.cache.float(), self.table,
                                              self.cu.cpu(), self.lens.cpu(), SCALE, self.w_uk.float(),
                                              self.w_uv.float())
        return relative_error(got, ref)


def replay_ms(fn, reps: int) -> float:
    return time_graphs([capture(fn)], reps) / 1e3


def expanded_rows(t: int, prefix: int, tiles: list[str], reps: int, check: Chunk, peer: float | None) -> list[dict]:
    """The second table's rows for a chunk of t tokens after `prefix` cached rows, one per expanded tile."""
    chunk = Chunk(t, prefix)
    floor = mx.expanded_flops(t, HEADS, prefix=prefix) / PEAK_FLOPS * 1e3
    kernel_floor = t * (t + 1) / 2 * HEADS * 2 * (NOPE + ROPE + V_DIM) / PEAK_FLOPS * 1e3
    parts = {"gather_ms": replay_ms(chunk.gather, reps), "gemm_ms": replay_ms(chunk.expand, reps),
             "prefix_ms": replay_ms(chunk.prefix_pass, reps) if prefix else 0.0,
             "absorbed_path_ms": replay_ms(chunk.absorbed, reps)}
    rows = []
    for name, config in [("default", None)] + [(spec, parse_tile(spec)) for spec in tiles]:
        try:
            err = check.error(config)
            kernel = replay_ms(lambda c=config: chunk.kernel(c), reps)
            total = replay_ms(lambda c=config: chunk.expanded(c), reps)
        except Exception as e:  # a tile that does not compile (shared memory, registers) is reported, not fatal
            print(f"T={t} P={prefix} expanded {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                  file=sys.stderr)
            continue
        rows.append({"tokens": t, "prefix": prefix, "tile": name, "total_ms": total, "kernel_ms": kernel, **parts,
                     "expanded_floor_ms": floor, "kernel_floor_ms": kernel_floor, "sdpa_expanded_ms": peer,
                     "rel_err": err})
        print(f"T={t} P={prefix} expanded {name}: {total:.3f} ms ({total / floor:.1f}x floor), kernel {kernel:.3f} ms "
              f"({kernel / kernel_floor:.1f}x), absorbed path {parts['absorbed_path_ms']:.3f} ms, rel err {err:.1e}",
              file=sys.stderr)
    return rows


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
    parser.add_argument("--tiles", nargs="*", default=DEFAULT_TILES, metavar="MxNxWARPSxSTAGES",
                        help="absorbed tiles besides the default (none: the default only)")
    parser.add_argument("--expanded-tiles", nargs="*", default=EXPANDED_TILES, metavar="MxNxWARPSxSTAGES",
                        help="expanded tiles besides the default (none: the default only)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 4096],
                        help="cached rows before the chunk, for the expanded table (0: a fresh prompt)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_prefill: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    check = Prompt(300)  # a few pages, a partial last one
    configs = [("default", None)] + [(spec, parse_tile(spec)) for spec in args.tiles]
    rows, peers = [], {}
    for t in args.tokens:
        prompt = Prompt(t)
        absorbed, expanded = floors_ms(t)
        peers[t] = peer = peer_ms(t, args.reps)
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
    expanded, check_chunk = [], Chunk(300, 100)
    for t in args.tokens:
        for prefix in args.prefixes:
            expanded += expanded_rows(t, prefix, args.expanded_tiles, args.reps, check_chunk,
                                      None if prefix else peers[t])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_mla_prefill.json").write_text(json.dumps(rows + expanded, indent=1))
    print("\n| T | tile | ms | absorbed floor ms | × | expanded floor ms | SDPA expanded ms | rel err |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['tile']} | {r['ms']:.3f} | {r['absorbed_floor_ms']:.3f} | "
              f"{r['ms'] / r['absorbed_floor_ms']:.1f} | {r['expanded_floor_ms']:.3f} | {r['sdpa_expanded_ms']:.3f} | "
              f"{r['rel_err']:.1e} |")
    print("\n| T | prefix | tile | total ms | kernel ms | gather ms | GEMM ms | prefix pass ms | expanded floor ms "
          "| × | kernel floor ms | kernel × | absorbed path ms | SDPA expanded ms | rel err |")
    print("|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in expanded:
        sdpa = f"{r['sdpa_expanded_ms']:.3f}" if r["sdpa_expanded_ms"] is not None else "-"
        print(f"| {r['tokens']} | {r['prefix']} | {r['tile']} | {r['total_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['gather_ms']:.3f} | {r['gemm_ms']:.3f} | {r['prefix_ms']:.3f} | {r['expanded_floor_ms']:.3f} | "
              f"{r['total_ms'] / r['expanded_floor_ms']:.1f} | {r['kernel_floor_ms']:.3f} | "
              f"{r['kernel_ms'] / r['kernel_floor_ms']:.1f} | {r['absorbed_path_ms']:.3f} | {sdpa} | "
              f"{r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
