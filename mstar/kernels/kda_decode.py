"""The elementwise parts of a KDA layer's decode step as two Triton kernels, beside their torch references.

- `decode_conv`: the short causal conv of one new row per sequence for q, k and v, continued from each
  slot's window in the pool, with SiLU; the windows are shifted in place. Torch spends ~9 launches
  on it (stack, gather, cat, casts, multiply, sum, SiLU, scatter, transpose) per KDA layer.
- `gated_head_norm`: o_norm (RMSNorm over each head's channels, times sigmoid(gate)); ~9 launches in
  torch (models/kimi_k3/kda.py, `GatedHeadNorm`), one here, for any number of rows (prefill too).

Both compute in fp32 and round once, as the references do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.kernels import pdl


def decode_conv_reference(rows: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, 3, width] (new pre-conv q, k, v rows), windows [B, 3, W-1, width] (oldest first),
    weight [3, W, width] -> (SiLU(conv) [3, B, width] in the rows' dtype, new windows [B, 3, W-1, width])."""
    full = torch.cat([windows.to(rows.dtype), rows[:, :, None]], dim=2)  # [B, 3, W, width]
    xf = full.float() if rows.dtype in (torch.bfloat16, torch.float16) else full
    out = F.silu((xf * weight.to(xf.dtype)).sum(2)).to(rows.dtype)
    return out.transpose(0, 1).contiguous(), full[:, :, 1:].to(windows.dtype)


def decode_conv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """The kernel: q, k, v [B, width] pre-conv rows (unit column stride), conv [slots, 3, W-1, width] one
    layer's windows (updated in place at `slots` [B]), weight fp32 [3, W, width]. Returns [3, B, width]."""
    B, width = q.shape
    out = torch.empty(3, B, width, dtype=q.dtype, device=q.device)
    block = min(1024, triton.next_power_of_2(width))
    _decode_conv_kernel[(B, 3, triton.cdiv(width, block))](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), conv, conv.stride(0), conv.stride(1), conv.stride(2), slots,
        weight, out, width, HIST=conv.shape[2], BLOCK=block, num_warps=4,
        **pdl.options(_decode_conv_kernel, q.device),
    )
    return out


@triton.jit
def _decode_conv_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, conv_ptr, s_slot, s_which, s_hist,
                        slots_ptr, w_ptr, out_ptr, width, HIST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)  # 0: q, 1: k, 2: v
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    if which == 0:
        x = tl.load(q_ptr + b * q_stride + cols, mask=ok, other=0)
    elif which == 1:
        x = tl.load(k_ptr + b * k_stride + cols, mask=ok, other=0)
    else:
        x = tl.load(v_ptr + b * v_stride + cols, mask=ok, other=0)
    dtype = out_ptr.dtype.element_ty
    window = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * s_slot + which * s_which + cols
    w_row = w_ptr + which * (HIST + 1) * width + cols
    acc = x.to(dtype).to(tl.float32) * tl.load(w_row + HIST * width, mask=ok, other=0)
    previous = tl.load(window, mask=ok, other=0)
    for j in tl.static_range(HIST):
        acc += previous.to(dtype).to(tl.float32) * tl.load(w_row + j * width, mask=ok, other=0)
        if j + 1 < HIST:
            following = tl.load(window + (j + 1) * s_hist, mask=ok, other=0)
            tl.store(window + j * s_hist, following, mask=ok)  # shift the window by one row
            previous = following
    tl.store(window + (HIST - 1) * s_hist, x.to(window.dtype.element_ty), mask=ok)
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + which * tl.num_programs(0) * width + b * width + cols, y.to(dtype), mask=ok)


def gated_head_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                    tokens: torch.Tensor | None = None) -> torch.Tensor:
    """o [..., H, K], gate with the same number of elements (any shape whose rows are heads of K) ->
    (weight * RMSNorm(o) * sigmoid(gate)) in o's dtype, shaped as o. With `tokens` [N] (o [M, H, K]): only
    those token rows, in that order, [N, H, K] (the gather is the kernel's own loads)."""
    K, H = o.shape[-1], o.shape[-2]
    rows = o.reshape(-1, K)
    gates = gate.reshape(-1, K)
    n = rows.shape[0] if tokens is None else tokens.shape[0] * H
    out = torch.empty(n, K, dtype=o.dtype, device=o.device)
    _gated_head_norm_kernel[(n,)](rows, gates, weight, out, rows.stride(0), gates.stride(0), eps,
                                  rows if tokens is None else tokens, H, K=K, BLOCK=triton.next_power_of_2(K),
                                  GATHER=tokens is not None, num_warps=1,
                                  **pdl.options(_gated_head_norm_kernel, o.device))
    return out.view(o.shape) if tokens is None else out.view(tokens.shape[0], H, K)


@triton.jit
def _gated_head_norm_kernel(o_ptr, g_ptr, w_ptr, out_ptr, o_stride, g_stride, eps, tokens_ptr, H,
                            K: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    src = r
    if GATHER:  # output head row r is head r % H of token tokens[r // H]
        src = tl.load(tokens_ptr + r // H).to(tl.int64) * H + r % H
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    o = tl.load(o_ptr + src * o_stride + cols, mask=ok, other=0).to(tl.float32)
    g = tl.load(g_ptr + src * g_stride + cols, mask=ok, other=0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0).to(tl.float32)
    normed = o / tl.sqrt(tl.sum(o * o, axis=0) / K + eps)
    y = w * normed * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + r * K + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
