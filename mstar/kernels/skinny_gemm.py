"""y = x W^T for a few rows of x (decode: 1-16 tokens), streaming W once at close to HBM bandwidth.

At decode a K3 rank's dense projections (KDA's stacked inputs, MLA's, the latent MoE's 3584-wide
projections, shared experts, lm_head) are ~23 GB a step of 93 layers: 5.4 ms at 4.3 TB/s. cuBLAS ran
them in 9.2 ms on the H200 (its GEMV and split-K kernels reach 2.9-3.4 TB/s on the large ones, less on
the small), the largest holder of a batch-1 step after the experts.

The kernel computes y^T = W x^T so that W's rows are the tensor-core M side (a [BLOCK_N, BLOCK_K] tile
of W against x's [M_PAD, BLOCK_K] rows, x padded to 16 rows): every weight is loaded once, as a wide
coalesced tile, and the multiply-adds cost nothing next to the loads. Split K gives the small
matrices enough programs to keep every SM loading (their partial sums [split, M, N] in fp32 are added
in a fixed order by a second launch: deterministic, and tiny next to W).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16  # x rows the kernel takes (one tensor-core N tile); more rows: F.linear
BLOCK_N, BLOCK_K = 64, 256
TARGET_PROGRAMS = 264  # about two per SM of an H100/H200


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this call: a CUDA (or interpreted) 16-bit GEMM of <= MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), through the skinny kernel where it applies."""
    return skinny_linear(x, weight) if supported(x, weight) else F.linear(x, weight)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  splits: int | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K]^T -> [..., N] in x's dtype, fp32 accumulation.
    `splits`: K parts (default: enough programs for the GPU)."""
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"skinny_linear: x has {K} columns, weight is {tuple(weight.shape)}")
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows, got {M}: use F.linear")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out.view(M, N)
    k_chunk, split = _k_parts(N, K, splits)
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 (CPU tests): exact products, no TF32
    grid = (triton.cdiv(N, BLOCK_N), split)
    if split == 1:
        _skinny_kernel[grid](rows, weight, out, M, N, K, rows.stride(0), weight.stride(0), K_CHUNK=k_chunk,
                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, M_PAD=MAX_ROWS, PRECISION=precision, num_warps=4,
                             num_stages=4)
    else:
        parts = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        _skinny_kernel[grid](rows, weight, parts, M, N, K, rows.stride(0), weight.stride(0), K_CHUNK=k_chunk,
                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, M_PAD=MAX_ROWS, PRECISION=precision, num_warps=4,
                             num_stages=4)
        _sum_parts_kernel[(triton.cdiv(M * N, 1024),)](parts, out, M * N, SPLIT=split, BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], N)


def _k_parts(N: int, K: int, splits: int | None) -> tuple[int, int]:
    """(K columns per part, a multiple of BLOCK_K; parts)."""
    k_tiles = triton.cdiv(K, BLOCK_K)
    if splits is None:
        splits = triton.cdiv(TARGET_PROGRAMS, triton.cdiv(N, BLOCK_N))
    if splits < 1:
        raise ValueError(f"splits={splits}: need at least one K part")
    per_part = triton.cdiv(k_tiles, min(splits, k_tiles))
    return per_part * BLOCK_K, triton.cdiv(k_tiles, per_part)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, K_CHUNK: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """Program (n, s): out[s?, :, n tile] = x[:, K part s] @ W[n tile, K part s]^T (fp32 out: a part)."""
    pn = tl.program_id(0)
    part = tl.program_id(1)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn[:, None] < N
    m_ok = rm[:, None] < M
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    k_lo = part * K_CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, K), BLOCK_K):
        kk = k0 + rk[None, :]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk, mask=n_ok & (kk < K), other=0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk, mask=m_ok & (kk < K), other=0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    # out is [M, N] (or part [M, N] of [SPLIT, M, N]): acc^T
    dest = out_ptr + part.to(tl.int64) * M * N + rm[None, :] * N + rn[:, None]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=n_ok & (rm[None, :] < M))


@triton.jit
def _sum_parts_kernel(parts_ptr, out_ptr, size, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over the SPLIT parts, in part order (fp32), rounded once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(parts_ptr + s * size + i, mask=ok, other=0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)
