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


def closed_block_stats(block: torch.Tensor, queries: torch.Tensor, first: int, out: torch.Tensor,
                       parts: int | None = None) -> torch.Tensor:
    """Fill out [T, 1 + Q] fp32 (rows of any stride, unit column stride) with the module doc's stats of block
    [T, D] (unit column stride) against queries [Q, D] fp32 (contiguous), for the queries from `first` on.

    The D columns are cut into `parts` (default: enough programs to fill the GPU twice over), each part's sums kept
    apart and added in a fixed order after: a prefill step's closed block has few (row, query) tiles (128 rows a
    rank under sequence parallelism, under 200 queries: 6 tiles), and one program a tile walking all of D left the
    GPU idle (H100 945e83c: 308 us a block at 1,024 and at 8,192 tokens)."""
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
    tiles = (triton.cdiv(T, BLOCK_ROWS), max(1, triton.cdiv(Q - first, BLOCK_QUERIES)))
    steps = triton.cdiv(D, BLOCK_D)
    if parts is None:
        parts = triton.cdiv(2 * _multiprocessors(block.device), tiles[0] * tiles[1])
    span = triton.cdiv(steps, max(1, min(parts, steps))) * BLOCK_D  # columns of a part: whole steps
    parts = triton.cdiv(D, span)
    target = out if parts == 1 else torch.empty(parts, T, 1 + Q, dtype=torch.float32, device=block.device)
    _closed_block_stats_kernel[(*tiles, parts)](
        block, block.stride(0), queries, first, Q, target, target.stride(-2), T * (1 + Q), T, span,
        D=D, BLOCK_T=BLOCK_ROWS, BLOCK_Q=BLOCK_QUERIES, BLOCK_K=BLOCK_D, num_warps=WARPS,
        **pdl.options(_closed_block_stats_kernel, block.device),
    )
    if parts > 1:
        sums = target.sum(0)  # in part order: the same bits every run
        out[:, 0] = sums[:, 0]
        out[:, 1 + first:] = sums[:, 1 + first:]
    return out


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@triton.jit
def _closed_block_stats_kernel(v_ptr, stride_vt, w_ptr, first, num_queries, out_ptr, stride_ot, part_stride, rows,
                               span, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr,
                               BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Rows BLOCK_T * program 0 .., queries first + BLOCK_Q * program 1 .. and columns span * program 2 ..: their
    dots; the programs of the first query tile also the rows' square sums. Part p writes its sums at
    out + p * part_stride (one part: out itself)."""
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    q = first + tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    part = tl.program_id(2)
    row_ok, q_ok = t < rows, q < num_queries
    v_rows = v_ptr + t.to(tl.int64)[:, None] * stride_vt
    w_rows = w_ptr + q.to(tl.int64)[:, None] * D
    k = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_T, BLOCK_Q], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    start = part * span
    for d0 in range(start, tl.minimum(start + span, D), BLOCK_K):
        c = d0 + k
        c_ok = c < D
        v = tl.load(v_rows + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0).to(tl.float32)
        w = tl.load(w_rows + c[None, :], mask=q_ok[:, None] & c_ok[None, :], other=0)
        dots = tl.dot(v, tl.trans(w), dots, input_precision="tf32x3")
        squares += tl.sum(v * v, axis=1)
    out_rows = out_ptr + part.to(tl.int64) * part_stride + t.to(tl.int64) * stride_ot
    tl.store(out_rows[:, None] + 1 + q[None, :], dots, mask=row_ok[:, None] & q_ok[None, :])
    if tl.program_id(1) == 0:
        tl.store(out_rows, squares, mask=row_ok)
