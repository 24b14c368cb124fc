"""The small fused kernels of a decode step against their byte floors and the torch ops they replace, at
one TP8 rank of pruned75 (hidden 7168, 12 KDA heads of 128, AttnRes with 9 sources, 224 experts top-16,
shared-expert width 768):

    python3 benchmarks/kernels/bench_small_kernels.py [--tokens 1 8 64] [--reps 200] [--only attn_res]
    python3 benchmarks/kernels/bench_small_kernels.py --tokens 1024 8192 --attn-res-tiles 1024x4 512x2 \
        --attn-res-sources 5 9     # AttnRes's three launches at prefill sizes, by tiling, with and without
                                   # the closed blocks' stats, and closed_block_stats itself
    python3 benchmarks/kernels/bench_small_kernels.py --only decode_step --tokens 1 8 16 64
    python3 benchmarks/kernels/bench_small_kernels.py --only "latent kv write" --tokens 1 8 64 1024

T is the step's token rows, except for fold_recurrent (a verify step's KDA recurrence), where it is the
sequences, each a block of VERIFY_ROWS rows after PENDING_ROWS accepted ones folded from its slot's state;
that kernel is timed at each of its candidate tiles (kda_blocks.FOLD_TILES, the default marked).
kda_decode.decode_step (a KDA layer's decode step after its input GEMM, one launch) is timed at each of its
candidate warp counts (kda_decode.DECODE_STEP_WARP_CHOICES) against the chain of launches it replaced (the
f_b GEMV, decode_conv, fla's recurrent kernel, gated_head_norm), which its "torch µs" column holds. The latent KV
write (an MLA layer's new rows [c_kv | k_pe] into their slots, kv_slots.write_latent_rows) is timed against the
cat and index_put it replaced.

Each kernel is first checked against its torch reference (relative error), then captured in a CUDA
graph that runs it over several input sets in turn (so that one pass reads past the 50 MB L2, as a
model's 93 layers do) and replayed behind a GPU sleep (`bench_moe_mxfp4.time_graphs`); the time per
call is the median replay over the sets. The floor is the bytes the call must move (inputs once,
outputs once, weights once) at 4.3 TB/s; at these sizes launch and latency dominate, which is what the
table shows: "torch µs" is the eager torch path captured the same way (its launches, not its host
time). Prints the table last; $OUT/bench_small_kernels.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe_mxfp4 import capture, time_graphs  # noqa: E402

from mstar.kernels import (  # noqa: E402
    attn_res_blocks,
    attn_res_norm,
    gated_mlp,
    kda_blocks,
    kda_decode,
    kv_slots,
    router_topk,
    skinny_gemm,
)
from mstar.models.kimi_k3 import attn_res, norm  # noqa: E402
from mstar.models.kimi_k3.kda import GatedHeadNorm, kda_gate, kda_recurrent, l2_normalize  # noqa: E402
from mstar.models.kimi_k3.mlp import situ  # noqa: E402

HBM = 4.3e12
D, HEADS, HEAD_DIM, SOURCES, EXPERTS, TOP_K, SHARED = 7168, 12, 128, 9, 224, 16, 768
LATENT, ROPE, PAGE, KV_PAGES = 512, 64, 64, 512  # an MLA layer's rows; the pages each set writes into
QUERIES = 186  # K3's AttnRes mixes a forward pass (precomputed_stream.sublayer_queries): each a pseudo-query
SETS = 8
VERIFY_ROWS, PENDING_ROWS = 8, 2  # DSpark k = 7
BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench(name: str, tokens: int, floor_bytes: int, make: Callable[[], tuple[Callable, Callable]], reps: int) -> dict:
    """`make()` -> (fused(), reference()) over one input set; SETS sets are made and rotated."""
    sets = [make() for _ in range(SETS)]
    err = rel(sets[0][0](), sets[0][1]())
    fused_us = time_graphs([capture(lambda: [fused() for fused, _ in sets])], reps) / SETS
    torch_us = time_graphs([capture(lambda: [ref() for _, ref in sets])], reps) / SETS
    floor_us = floor_bytes / HBM * 1e6
    return {"kernel": name, "tokens": tokens, "rel_err": err, "floor_us": floor_us, "us": fused_us,
            "x_floor": fused_us / floor_us, "torch_us": torch_us}


def attn_res_case(t: int, one_launch: bool | None = None, tile: tuple[int, int] | None = None, sources: int = SOURCES,
                  closed: bool = False):
    """The default path (one launch where it fits), or the one forced (False: the three launches; a `tile`: the
    three launches of that tiling, one tile a program). `closed`: the stats launch reads the first sources' stats
    from a table closed_block_stats filled once (models/kimi_k3/precomputed_stream.py), not the sources."""
    src = torch.randn(sources, t, D, device="cuda", dtype=BF16)
    proj, res_w, out_w = (torch.randn(1, D, device="cuda", dtype=BF16) * D**-0.5,
                          torch.ones(D, device="cuda", dtype=BF16), torch.ones(D, device="cuda", dtype=BF16))
    splits = None if tile is None else -(-D // tile[0])
    table = None
    if closed:
        queries = torch.randn(QUERIES, D, device="cuda") * D**-0.5
        queries[0] = res_w.float() * proj[0].float()  # this mix's pseudo-query
        table = torch.empty(sources, t, 1 + QUERIES, device="cuda")
        for j in range(sources - 1):
            attn_res_blocks.closed_block_stats(src[j], queries, 0, out=table[j])
    return (lambda: attn_res_norm.attn_res_norm(src, proj, res_w, 1e-6, out_w, 1e-6, one_launch=one_launch,
                                                tile=tile, splits=splits, closed=(table, 0) if closed else None),
            lambda: attn_res.attn_res_norm(src, proj, res_w, 1e-6, out_w, 1e-6))


def block_stats_case(t: int):
    """One closed block's stats against every sublayer of K3 (first = 0: the most queries a block meets)."""
    block = torch.randn(t, D, device="cuda", dtype=BF16)
    queries = torch.randn(QUERIES, D, device="cuda") * D**-0.5
    out = torch.empty(t, 1 + QUERIES, device="cuda")
    return (lambda: attn_res_blocks.closed_block_stats(block, queries, 0, out),
            lambda: attn_res_blocks.closed_block_stats_reference(block, queries, 0))


def attn_res_bytes(sources: int):
    return lambda t: (sources + 1) * t * D * 2 + 3 * D * 2


def attn_res_tile_cases(tiles: list[str], sources: list[int]) -> dict:
    """--attn-res-tiles COLSxWARPS ...: the three launches at each tiling, for each source count."""
    cases = {}
    for n in sources:
        for spec in tiles:
            tile = tuple(int(x) for x in spec.split("x"))
            cases[f"attn_res_norm, {n} sources, tile {spec}"] = (
                lambda t, tile=tile, n=n: attn_res_case(t, one_launch=False, tile=tile, sources=n), attn_res_bytes(n))
        cases[f"attn_res_norm, {n} sources, default"] = (
            lambda t, n=n: attn_res_case(t, sources=n), attn_res_bytes(n))
        cases[f"attn_res_norm, {n} sources, closed blocks' stats"] = (
            lambda t, n=n: attn_res_case(t, one_launch=False, sources=n, closed=True), attn_res_bytes(n))
    cases["closed_block_stats"] = (block_stats_case, lambda t: t * D * 2 + QUERIES * D * 4 + t * (1 + QUERIES) * 4)
    return cases


def rms_case(t: int):
    x, w = torch.randn(t, D, device="cuda", dtype=BF16), torch.ones(D, device="cuda", dtype=BF16)
    return lambda: attn_res_norm.rms_norm_rows(x, w, 1e-6), lambda: norm.rms_norm(x, w, 1e-6)


def router_case(t: int):
    """Both return the k weights ordered by expert id (the kernel's pick order is free)."""
    x = torch.randn(t, D, device="cuda", dtype=BF16)
    w = torch.randn(EXPERTS, D, device="cuda", dtype=BF16) * D**-0.5
    bias = torch.zeros(EXPERTS, device="cuda")

    def fused():
        ids, weights = router_topk.route(x, w, bias, TOP_K, True, 1.0)
        return weights.gather(1, ids.argsort(-1))

    def reference():  # the torch Router's arithmetic
        scores = torch.sigmoid(x.float() @ w.float().T)
        ids = (scores + bias).topk(TOP_K, dim=-1, sorted=False).indices.sort(-1).values
        weights = scores.gather(1, ids)
        return weights / weights.sum(-1, keepdim=True)

    return fused, reference


def gated_norm_case(t: int):
    o = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    gate = torch.randn(t, HEADS * HEAD_DIM, device="cuda", dtype=BF16)
    module = GatedHeadNorm(HEAD_DIM, 1e-6).to("cuda", BF16)
    return (lambda: kda_decode.gated_head_norm(o, gate, module.weight, module.eps),
            lambda: module(o, gate.view(t, HEADS, HEAD_DIM)))


def situ_case(t: int):
    gu = torch.randn(t, 2 * SHARED, device="cuda", dtype=BF16) * 3
    return (lambda: gated_mlp.situ_and_mul(gu, 4.0, 25.0), lambda: situ(gu[:, :SHARED], gu[:, SHARED:], 4.0, 25.0))


def decode_conv_case(t: int):
    width = HEADS * HEAD_DIM
    q, k, v = (torch.randn(t, width, device="cuda", dtype=BF16) for _ in range(3))
    conv = torch.randn(t + 1, 3, 3, width, device="cuda", dtype=BF16)
    slots = torch.arange(1, t + 1, device="cuda")
    weight = torch.randn(3, 4, width, device="cuda")
    windows = conv[slots].clone()  # the kernel shifts the pool's windows in place; the check runs it first
    return (lambda: kda_decode.decode_conv(q, k, v, conv, slots, weight),
            lambda: kda_decode.decode_conv_reference(torch.stack([q, k, v], 1), windows, weight)[0])


def fold_case(t: int, tile: tuple[int, int]):
    """t sequences of PENDING_ROWS + VERIFY_ROWS rows; the pending rows fold. The reference reads a copy of
    the states as they were (the kernel folds into them in place)."""
    n = PENDING_ROWS + VERIFY_ROWS
    q, k, f = (torch.randn(t * n, HEADS, HEAD_DIM, device="cuda", dtype=BF16) for _ in range(3))
    v = torch.randn(t * n, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    beta = torch.randn(t * n, HEADS, device="cuda", dtype=BF16)
    a_log, dt_bias = torch.randn(HEADS, device="cuda") * 0.5, torch.randn(HEADS * HEAD_DIM, device="cuda") * 0.5
    states = torch.randn(t + 1, HEADS, HEAD_DIM, HEAD_DIM, device="cuda") * 0.05
    initial = states.clone()
    index = [torch.arange(t, device="cuda", dtype=torch.int32) * n + offset for offset in (0, n)]
    slots = torch.arange(1, t + 1, device="cuda", dtype=torch.int32)
    folds = torch.full((t,), PENDING_ROWS, device="cuda", dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def fused():
        return kda_blocks.fold_recurrent(q, k, v, f, beta, a_log, dt_bias, scale, -5.0, 1e-6, states, slots, *index,
                                         folds, tile=tile)

    def reference():
        g, b = kda_gate(f, a_log, dt_bias, -5.0), torch.sigmoid(beta.float())
        qn, kn = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        rows = [slice(i * n, (i + 1) * n) for i in range(t)]
        return torch.cat([kda_recurrent(qn[r], kn[r], v[r], g[r], b[r], scale, initial[i + 1])[0]
                          for i, r in enumerate(rows)])

    return fused, reference


def fold_bytes(t: int) -> int:
    """Each sequence's state read and written, its rows' q, k, f, v, beta read and o written."""
    rows = t * (PENDING_ROWS + VERIFY_ROWS)
    return t * 2 * HEADS * HEAD_DIM * HEAD_DIM * 4 + rows * HEADS * (5 * HEAD_DIM + 1) * 2


def decode_step_case(t: int, warps: int):
    """t sequences' decode rows as the stacked input GEMM leaves them (column slices of one output), on slots
    1..t of a pool each side owns a copy of (both write theirs in place; the check's first calls start equal)."""
    width = HEADS * HEAD_DIM
    proj = torch.randn(t, 4 * width + HEAD_DIM + HEADS, device="cuda", dtype=BF16)
    q, k, v, gate, f_a, beta = proj.split([width] * 4 + [HEAD_DIM, HEADS], dim=1)
    f_b = torch.randn(width, HEAD_DIM, device="cuda", dtype=BF16) * HEAD_DIM**-0.5
    conv_weight = torch.randn(3, 4, width, device="cuda") * 0.5
    a_log, dt_bias = torch.randn(HEADS, device="cuda") * 0.5, torch.randn(width, device="cuda") * 0.5 - 1
    norm_w = torch.ones(HEAD_DIM, device="cuda", dtype=BF16)
    conv = torch.randn(t + 1, 3, 3, width, device="cuda", dtype=BF16)
    states = torch.randn(t + 1, HEADS, HEAD_DIM, HEAD_DIM, device="cuda") * 0.05
    chain_conv, chain_states = conv.clone(), states.clone()
    slots = torch.arange(1, t + 1, device="cuda")
    scale, eps = HEAD_DIM**-0.5, 1e-6

    def fused():
        return kda_decode.decode_step(q, k, v, f_a, beta, gate, conv, states, slots, conv_weight, f_b, a_log, dt_bias,
                                      norm_w, scale=scale, lower_bound=-5.0, l2_eps=eps, norm_eps=eps, warps=warps)

    def chain():  # GpuMixerOps' decode step before decode_step (bf16: the stacked GEMM's outputs through GpuLayerOps)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        f = skinny_gemm.linear(f_a, f_b)
        qc, kc, vc = kda_decode.decode_conv(q, k, v, chain_conv, slots, conv_weight).view(3, t, 1, HEADS, HEAD_DIM)
        o, _ = fused_recurrent_kda_fwd(
            q=qc, k=kc, v=vc, g=f.view(t, 1, HEADS, HEAD_DIM), beta=beta.contiguous().view(t, 1, HEADS),
            initial_state=chain_states, inplace_final_state=True, ssm_state_indices=slots, out=torch.empty_like(vc),
            A_log=a_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        o = o.view(t, HEADS, HEAD_DIM)
        return kda_decode.gated_head_norm(o, gate.reshape(o.shape), norm_w, eps).view(t, width)

    return fused, chain


def decode_step_bytes(t: int) -> int:
    """The states and conv windows read and written, the rows read and the output written, f_b and the conv
    weights read once."""
    width = HEADS * HEAD_DIM
    return (t * 2 * HEADS * HEAD_DIM * HEAD_DIM * 4 + t * 2 * 3 * 3 * width * 2
            + t * (5 * width + HEAD_DIM + HEADS) * 2 + width * HEAD_DIM * 2 + 3 * 4 * width * 4)


def kv_write_case(t: int):
    """t rows as the MLA layer leaves them (c_kv a tensor of its own, k_pe the last columns of kv_a) into distinct
    random slots of a layer's pages; each side writes its own copy of the pages, which it returns."""
    c_kv = torch.randn(t, LATENT, device="cuda", dtype=BF16)
    k_pe = torch.randn(t, LATENT + ROPE, device="cuda", dtype=BF16)[:, LATENT:]
    slots = torch.randperm(KV_PAGES * PAGE, device="cuda")[:t]
    fused_cache, torch_cache = (torch.zeros(KV_PAGES, PAGE, LATENT + ROPE, device="cuda", dtype=BF16)
                                for _ in range(2))

    def fused():
        kv_slots.write_latent_rows(fused_cache, slots, c_kv, k_pe)
        return fused_cache

    def reference():  # GpuMixerOps before the kernel: PagedLatentKV.write of the cat
        torch_cache.view(-1, LATENT + ROPE)[slots] = torch.cat([c_kv, k_pe], dim=-1)
        return torch_cache

    return fused, reference


DECODE_STEP_CASES = {
    f"kda decode_step {w} warps{' (default)' if w == kda_decode.DECODE_STEP_WARPS else ''}":
    (lambda t, w=w: decode_step_case(t, w), decode_step_bytes) for w in kda_decode.DECODE_STEP_WARP_CHOICES}

FOLD_CASES = {f"kda fold_recurrent {bv}x{w}{' (default)' if (bv, w) == kda_blocks.FOLD_TILE else ''}":
              (lambda t, tile=(bv, w): fold_case(t, tile), fold_bytes) for bv, w in kda_blocks.FOLD_TILES}

CASES = {  # name -> (inputs, floor bytes for t tokens)
    "attn_res_norm": (attn_res_case, attn_res_bytes(SOURCES)),
    "attn_res_norm, three launches": (lambda t: attn_res_case(t, one_launch=False), attn_res_bytes(SOURCES)),
    "rms_norm_rows": (rms_case, lambda t: 2 * t * D * 2 + D * 2),
    "router (GEMM + select)": (router_case, lambda t: EXPERTS * D * 2 + t * D * 2 + t * TOP_K * 12),
    "kda gated_head_norm": (gated_norm_case, lambda t: 3 * t * HEADS * HEAD_DIM * 2),
    "situ_and_mul": (situ_case, lambda t: 3 * t * SHARED * 2),
    "kda decode_conv": (decode_conv_case, lambda t: t * HEADS * HEAD_DIM * 3 * 2 * (1 + 3 + 3 + 1)),
    "latent kv write": (kv_write_case, lambda t: t * ((LATENT + ROPE) * 2 * 2 + 8)),
    **FOLD_CASES,
    **DECODE_STEP_CASES,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--only", help="time only the kernels whose name contains this")
    parser.add_argument("--attn-res-tiles", nargs="+", metavar="COLSxWARPS",
                        help="time only AttnRes's three launches at these tilings (one tile a program) and the default")
    parser.add_argument("--attn-res-sources", type=int, nargs="+", default=[SOURCES],
                        help="source counts of the --attn-res-tiles sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_small_kernels: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    cases = attn_res_tile_cases(args.attn_res_tiles, args.attn_res_sources) if args.attn_res_tiles else CASES
    for name, (make, floor) in cases.items():
        if args.only and args.only not in name:
            continue
        for t in args.tokens:
            results.append(bench(name, t, floor(t), lambda make=make, t=t: make(t), args.reps))
            r = results[-1]
            print(f"{name} T={t}: {r['us']:.2f} us ({r['x_floor']:.1f}x floor), torch {r['torch_us']:.2f} us, "
                  f"rel err {r['rel_err']:.1e}", file=sys.stderr)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_small_kernels.json").write_text(json.dumps(results, indent=1))
    print("\n| kernel | T | floor µs | fused µs | × floor | torch µs | rel err |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for r in results:
        print(f"| {r['kernel']} | {r['tokens']} | {r['floor_us']:.2f} | {r['us']:.2f} | {r['x_floor']:.1f} | "
              f"{r['torch_us']:.2f} | {r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
