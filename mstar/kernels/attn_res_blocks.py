"""A closed AttnRes block's statistics for every later sublayer, in one pass over the block.

Each sublayer input mixes the stored blocks and the live partial sum (models/kimi_k3/attn_res.py); the stats
stage of `attn_res_norm` needs two numbers per source and row, sum(V^2) and <V, w_q> (w_q the sublayer's
pseudo-query, res_norm.weight * proj.weight in fp32). A block never changes once closed, yet every later
sublayer read it again for them: at prefill rows that was most of the stats stage's bytes (K3: up to 8 closed
blocks and the partial sum, 186 mixes a step). So when a block closes, one pass computes its row square sums
and its dot with the pseudo-query of every sublayer still to come,

    stats[t, 0]     = sum_d V[t, d]^2
    stats[t, 1 + q] = sum_d V[t, d] * W[q, d]        for q >= first (W: [Q, D] fp32, the sublayers' w in order)

a [rows, queries] GEMM whose dots run on the tensor cores in tf32x3 (each fp32 operand split into a tf32 pair:
fp32-accurate; bf16 sources are exact in tf32), and the mixes then read only the partial sum
(`attn_res_norm(..., closed=...)`). Columns 1 .. first of `stats` are left as they are (no later sublayer
reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl

# tf32x3 holds each fp32 operand as two tf32 parts: 64-column steps over 4 warps spilled (ptxas for sm_90); 32-column
# steps over 8 warps take 174 registers a thread and none spilled
BLOCK_ROWS, BLOCK_QUERIES, BLOCK_D, WARPS = 64, 64, 32, 8


def closed_block_stats_reference(block: torch.Tensor, queries: torch.Tensor, first: int) -> torch.Tensor:
    """[T, 1 + Q] fp32 (module doc) for block [T, D] and queries [Q, D]; columns 1 .. first are zero."""
    v = block.float()
    stats = torch.zeros(v.shape[0], 1 + queries.shape[0], dtype=torch.float32, device=block.device)
    stats[:, 0] = v.pow(2).sum(-1)
    stats[:, 1 + first:] = v @ queries[first:].float().T
    return stats


def closed_block_stats(block: torch.Tensor, queries: torch.Tensor, first: int, out: torch.Tensor) -> torch.Tensor:
    """Fill out [T, 1 + Q] fp32 (rows of any stride, unit column stride) with the module doc's stats of block
    [T, D] (unit column stride) against queries [Q, D] fp32 (contiguous), for the queries from `first` on."""
    T, D = block.shape
    Q = queries.shape[0]
    if (queries.dtype != torch.float32 or queries.dim() != 2 or queries.shape[1] != D
            or not queries.is_contiguous()):
        raise ValueError(f"queries must be a contiguous [Q, {D}] fp32 tensor, got {tuple(queries.shape)} "
                         f"{queries.dtype}")
    if not 0 <= first <= Q:
        raise ValueError(f"first={first}: need 0 <= first <= {Q} queries")
    if out.shape != (T, 1 + Q) or out.dtype != torch.float32 or out.stride(1) != 1 or block.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {1 + Q}] fp32 with unit column stride (got {tuple(out.shape)} "
                         f"{out.dtype}) and block unit column stride (got {block.stride()})")
    grid = (triton.cdiv(T, BLOCK_ROWS), max(1, triton.cdiv(Q - first, BLOCK_QUERIES)))
    _closed_block_stats_kernel[grid](
        block, block.stride(0), queries, first, Q, out, out.stride(0), T,
        D=D, BLOCK_T=BLOCK_ROWS, BLOCK_Q=BLOCK_QUERIES, BLOCK_K=BLOCK_D, num_warps=WARPS,
        **pdl.options(_closed_block_stats_kernel, block.device),
    )
    return out


@triton.jit
def _closed_block_stats_kernel(v_ptr, stride_vt, w_ptr, first, num_queries, out_ptr, stride_ot, rows,
                               D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                               PDL: tl.constexpr):
    """Rows BLOCK_T * program 0 .. and queries first + BLOCK_Q * program 1 ..: their dots; the programs of the
    first query tile also the rows' square sums."""
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    q = first + tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok, q_ok = t < rows, q < num_queries
    v_rows = v_ptr + t.to(tl.int64)[:, None] * stride_vt
    w_rows = w_ptr + q.to(tl.int64)[:, None] * D
    k = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_T, BLOCK_Q], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_K):
        c = d0 + k
        c_ok = c < D
        v = tl.load(v_rows + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0).to(tl.float32)
        w = tl.load(w_rows + c[None, :], mask=q_ok[:, None] & c_ok[None, :], other=0)
        dots = tl.dot(v, tl.trans(w), dots, input_precision="tf32x3")
        squares += tl.sum(v * v, axis=1)
    out_rows = out_ptr + t.to(tl.int64) * stride_ot
    tl.store(out_rows[:, None] + 1 + q[None, :], dots, mask=row_ok[:, None] & q_ok[None, :])
    if tl.program_id(1) == 0:
        tl.store(out_rows, squares, mask=row_ok)
