"""AttnRes (score + softmax over depth + mix) fused with the RMSNorm that follows it, in one launch.

Every K3 sublayer input is `out_norm(attn_res_mix(sources))` (models/kimi_k3/attn_res.py, norm.py):
eager torch spends ~23 small launches on it (stack, casts, pow, mean, rsqrt, softmax, sums, the norm),
twice per layer, which at decode costs more than reading the layer's weights. Here one program per
token row does, over the n stored sources V_i [D] (n <= 16; K3: at most 8 blocks + the partial sum):

    pass 1: s_i = <V_i, w> * rsqrt(mean(V_i^2) + eps_res)      w = res_norm.weight * proj.weight (fp32)
            alpha = softmax(s)
    pass 2: m = sum_i alpha_i V_i, rounded to the stream dtype (as `attn_res_mix` returns it), written
            to a scratch row, with sum(m^2) accumulated
    pass 3: y = out_norm.weight * (m * rsqrt(mean(m^2) + eps_out)).to(dtype)   (as `rms_norm`)

All statistics in fp32, as the torch path (`attn_res.attn_res_norm` and `norm.rms_norm`, the references
the tests hold it to). Without mixing (`rms_norm_rows`) pass 3 alone is a plain
RMSNorm of a row. Bytes: the sources twice, the scratch row twice, the output once; at decode these
are a few hundred KB, so the launch, not HBM, is the cost it removes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SOURCES = 16


def attn_res_norm(sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor, res_eps: float,
                  out_norm_weight: torch.Tensor, out_eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel: `sources` [n, T, D] (n <= MAX_SOURCES, unit column stride) -> [T, D] (into `out`)."""
    n, T, D = sources.shape
    if not 1 <= n <= MAX_SOURCES:
        raise ValueError(f"attn_res_norm mixes 1..{MAX_SOURCES} sources, got {n}")
    out = torch.empty(T, D, dtype=sources.dtype, device=sources.device) if out is None else out
    scratch = torch.empty_like(out)
    _launch(sources, sources.stride(0), sources.stride(1), n, proj_weight.reshape(-1), res_norm_weight, res_eps,
            out_norm_weight, out_eps, scratch, out, mix=True)
    return out


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm(x, weight, eps)` for x [..., D] in one launch (into `out`, contiguous, if given)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if out is None else out.view(rows.shape)
    _launch(rows, 0, rows.stride(0), 1, weight, weight, 0.0, weight, eps, rows, out, mix=False)
    return out.view(x.shape)


def _launch(src, stride_n, stride_t, n, proj_w, res_w, res_eps, out_w, out_eps, scratch, out, *, mix: bool) -> None:
    T, D = out.shape
    # Tiles of [sources, columns] with ~4K elements (16 fp32 registers a thread at 8 warps): the first
    # version tiled [16, 1024] for any n and ran at 16 us per row on the H200 (spilled, latency-bound).
    n_pad = triton.next_power_of_2(n) if mix else 1
    block = min(triton.next_power_of_2(D), max(256, 4096 // n_pad))
    _attn_res_norm_kernel[(T,)](
        src, stride_n, stride_t, n, proj_w, res_w, res_eps, out_w, out_eps, scratch, out,
        D=D, BLOCK_D=block, N_PAD=n_pad, MIX=mix, num_warps=8,
    )


@triton.jit
def _attn_res_norm_kernel(src_ptr, stride_n, stride_t, n_sources, proj_ptr, res_w_ptr, res_eps, out_w_ptr, out_eps,
                          scratch_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr,
                          MIX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    row_src = src_ptr + t * stride_t
    row_scratch = scratch_ptr + t * D
    row_out = out_ptr + t * D
    cols = tl.arange(0, BLOCK_D)
    ss_mixed = tl.zeros([BLOCK_D], dtype=tl.float32)
    if MIX:
        srcs = tl.arange(0, N_PAD)
        live = srcs < n_sources
        sq = tl.zeros([N_PAD], dtype=tl.float32)
        dot = tl.zeros([N_PAD], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # pass 1: each source's RMS and its score against the query
            c = d0 + cols
            ok = c < D
            w = tl.load(res_w_ptr + c, mask=ok, other=0).to(tl.float32) * tl.load(proj_ptr + c, mask=ok,
                                                                                  other=0).to(tl.float32)
            v = tl.load(row_src + srcs[:, None] * stride_n + c[None, :], mask=live[:, None] & ok[None, :],
                        other=0).to(tl.float32)
            sq += tl.sum(v * v, axis=1)
            dot += tl.sum(v * w[None, :], axis=1)
        score = tl.where(live, dot / tl.sqrt(sq / D + res_eps), float("-inf"))
        e = tl.exp(score - tl.max(score, axis=0))
        alpha = e / tl.sum(e, axis=0)
        for d0 in range(0, D, BLOCK_D):  # pass 2: the mix, in the stream dtype, and its square sum
            c = d0 + cols
            ok = c < D
            v = tl.load(row_src + srcs[:, None] * stride_n + c[None, :], mask=live[:, None] & ok[None, :],
                        other=0).to(tl.float32)
            m = tl.sum(alpha[:, None] * v, axis=0).to(dtype)
            tl.store(row_scratch + c, m, mask=ok)
            mf = m.to(tl.float32)
            ss_mixed += mf * mf
    else:
        for d0 in range(0, D, BLOCK_D):  # a plain RMSNorm: the input row is the "mix"
            c = d0 + cols
            x = tl.load(row_src + c, mask=c < D, other=0).to(tl.float32)
            ss_mixed += x * x
        row_scratch = row_src
    r = 1.0 / tl.sqrt(tl.sum(ss_mixed, axis=0) / D + out_eps)
    for d0 in range(0, D, BLOCK_D):  # pass 3: normalise, round as rms_norm does, scale by the weight
        c = d0 + cols
        ok = c < D
        m = tl.load(row_scratch + c, mask=ok, other=0).to(tl.float32)
        normed = (m * r).to(dtype).to(tl.float32)
        w = tl.load(out_w_ptr + c, mask=ok, other=0).to(tl.float32)
        tl.store(row_out + c, (w * normed).to(dtype), mask=ok)
