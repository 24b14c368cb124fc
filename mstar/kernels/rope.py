"""Interleaved (GPT-J) RoPE of the DSpark draft's q_pe / k_pe rows in one launch.

Given x [T, d] or [T, M, d] (row t at some position, M heads sharing it; any row and head strides, unit
inner stride) and that position's tables cos, sin [T, d/2] (fp32, the magnitude factor already in them:
`YarnRotaryEmbedding.cos_sin`), pairs (2i, 2i + 1) rotate by angle i:

    out[.., 2i]     = x[.., 2i] cos_i - x[.., 2i+1] sin_i
    out[.., 2i + 1] = x[.., 2i] sin_i + x[.., 2i+1] cos_i

in fp32, rounded once to x's dtype: `YarnRotaryEmbedding.rotate` (models/dspark/rope.py) is the reference,
and with the same tables the results are bit-identical (the kernel is compiled without FMA contraction, so
each product is rounded as torch rounds it). The torch rotation is ~8 launches (casts, the two halves,
four products, the stack, the cast back) and the draft rotates q and k of every layer in every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, d] or [T, M, d] rotated by cos, sin [T, d/2] (module doc); a new contiguous tensor of x's dtype."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"rotate_interleaved takes x [T, d] or [T, M, d] with unit inner stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    rows = x if x.dim() == 3 else x[:, None, :]
    T, M, d = rows.shape
    if d % 2 or cos.shape != (T, d // 2) or sin.shape != (T, d // 2):
        raise ValueError(f"x {tuple(x.shape)} needs an even last dim and cos, sin [{T}, {d // 2}]; got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32 tables, got {cos.dtype} and {sin.dtype}")
    out = torch.empty(T, M, d, dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T,)](rows, cos.contiguous(), sin.contiguous(), out, rows.stride(0), rows.stride(1), M,
                           HALF=d // 2, M_PAD=triton.next_power_of_2(M), num_warps=1 if M * d <= 1024 else 4,
                           enable_fp_fusion=False, **pdl.options(_rope_kernel, x.device))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_m, M, HALF: tl.constexpr, M_PAD: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, M_PAD)
    pairs = tl.arange(0, HALF)
    ok = (heads < M)[:, None] & (pairs < HALF)[None, :]
    at = x_ptr + t * stride_t + heads[:, None] * stride_m + 2 * pairs[None, :]
    even = tl.load(at, mask=ok, other=0).to(tl.float32)
    odd = tl.load(at + 1, mask=ok, other=0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + pairs)[None, :]
    s = tl.load(sin_ptr + t * HALF + pairs)[None, :]
    dest = out_ptr + t * M * 2 * HALF + heads[:, None] * 2 * HALF + 2 * pairs[None, :]
    tl.store(dest, (even * c - odd * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dest + 1, (even * s + odd * c).to(out_ptr.dtype.element_ty), mask=ok)
