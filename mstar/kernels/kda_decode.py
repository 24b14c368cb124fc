"""A KDA layer's decode step between its input projections and o_proj, and its parts, as Triton kernels.

- `decode_step`: everything of a decode step (one row per sequence, no pending prefix) after the stacked
  input GEMM, in one launch: the gate's f_b projection, the short conv of q, k, v continued from each
  slot's window (shifted in place), the gated delta rule from each slot's state (stored back in place)
  and the gated head norm of its output, ready for o_proj. It replaces a chain of four launches (the f_b
  GEMV, `decode_conv`, fla's recurrent kernel, `gated_head_norm`) and rounds where that chain rounded,
  up to DECODE_STEP_MAX_ROWS rows; larger decode steps still run that chain (kda_fla.decode).
- `decode_conv`: the short causal conv of one new row per sequence for q, k and v, continued from each
  slot's window in the pool, with SiLU; the windows are shifted in place. Torch spends ~9 launches
  on it (stack, gather, cat, casts, multiply, sum, SiLU, scatter, transpose) per KDA layer.
- `gated_head_norm`: o_norm (RMSNorm over each head's channels, times sigmoid(gate)); ~9 launches in
  torch (models/kimi_k3/kda.py, `GatedHeadNorm`), one here, for any number of rows (prefill too).

All compute in fp32 and round where the references do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.kernels import pdl
from mstar.kernels.kda_blocks import delta_rule_row


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


# decode_step's warps a program. A program owns one head of one sequence: its whole [K, K] state tile in
# registers (64 KB in fp32 at K = 128: 128 registers a thread at 4 warps), so that the head's RMSNorm of o
# needs no second launch. bench_small_kernels.py's "kda decode_step" cases time the candidates; 4 warps were
# the fastest at every batch on an H100 (benchmarks/kernels/results/h100_ca793e9_kda_decode_step.md).
DECODE_STEP_WARPS = 4
DECODE_STEP_WARP_CHOICES = (4, 8, 16)
# Up to this many rows a decode step takes `decode_step`; beyond, the chain of launches it replaced (f_b GEMV,
# `decode_conv`, fla's recurrent kernel, `gated_head_norm`), which splits each head's state columns over programs
# where decode_step has one program a head (768 programs of a 64 KB state each at 64 rows). On an H100, since its
# loads were hoisted (00d2e31), the two tie at 64 rows (55.2 against 55.6 us) and the one launch wins below
# (17.1 against 26.2 at 16 rows, 11.4 against 18.6 at 8: benchmarks/kernels/results/h100_2c991be_kda_decode_step.md);
# before, it lost at 64 (62.8) and the bound was 16.
DECODE_STEP_MAX_ROWS = 64


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_a: torch.Tensor, beta: torch.Tensor,
                gate: torch.Tensor, conv: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                conv_weight: torch.Tensor, f_b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                norm_weight: torch.Tensor, *, scale: float, lower_bound: float | None, l2_eps: float,
                norm_eps: float, out: torch.Tensor | None = None, warps: int | None = None) -> torch.Tensor:
    """A KDA layer's decode step from its input projections to o_proj's input, in one launch.

    Row b continues slot slots[b] ([B]; no slot has a pending prefix). q, k, v [B, H*K] are the pre-conv
    rows, f_a [B, F] the gate's low-rank input, beta [B, H] before its sigmoid, gate [B, H*K] the output
    gate: each with unit column stride and any row stride (column slices of one stacked GEMM). conv
    [slots, 3, W-1, H*K] and states [slots, H, K, K] (K = V = head_dim) are one layer's windows and
    states, updated in place at the step's slots; conv_weight fp32 [3, W, H*K] (taps oldest first), f_b
    [H*K, F] (f_b_proj's weight), a_log [H] and dt_bias [H*K] fp32, norm_weight [K] (o_norm's).
    lower_bound: K3's gate bound; None: Kimi-Linear's softplus gate.

    Returns norm_weight * RMSNorm(o) * sigmoid(gate) [B, H*K] in gate's dtype (into `out`, contiguous, if
    given). Rounds where the four-launch chain it replaces rounded: f to f_a's dtype (the f_b GEMM's
    output), the conv's SiLU to q's dtype (`decode_conv`), o to v's dtype (the recurrence's output)."""
    (B, width), (H, K), F = q.shape, states.shape[1:3], f_a.shape[1]
    rows = (q, k, v, f_a, beta, gate)
    if (width != H * K or states.shape[1:] != (H, K, K) or states.stride()[1:] != (K * K, K, 1)
            or f_b.shape != (width, F) or beta.shape != (B, H) or any(x.stride(-1) != 1 for x in (*rows, conv, f_b))):
        raise ValueError(f"decode_step: rows {tuple(q.shape)}, f_a {tuple(f_a.shape)}, beta {tuple(beta.shape)}, "
                         f"f_b {tuple(f_b.shape)} and states {tuple(states.shape)} do not fit one layer of heads "
                         "of K = V columns with unit column strides")
    out = torch.empty(B, width, dtype=gate.dtype, device=q.device) if out is None else out
    _decode_step_kernel[(B, H)](
        *rows, *(x.stride(0) for x in rows), conv, conv.stride(0), conv.stride(1), conv.stride(2), conv_weight,
        states, states.stride(0), slots, f_b, f_b.stride(0), a_log, dt_bias, norm_weight, out, scale,
        0.0 if lower_bound is None else lower_bound, norm_eps, H=H, K=K, F=F, HIST=conv.shape[2],
        HIST_PAD=triton.next_power_of_2(conv.shape[2]),
        HAS_LOWER_BOUND=lower_bound is not None, EPS=l2_eps, num_warps=warps or DECODE_STEP_WARPS,
        **pdl.options(_decode_step_kernel, q.device),
    )
    return out


@triton.jit
def _taps(w_ptrs, width, HIST: tl.constexpr, HIST_PAD: tl.constexpr):
    """(the window's taps [HIST_PAD, K] fp32, oldest first, zero past HIST; the new row's tap [K]) of one of q, k,
    v at columns w_ptrs (tap j at w_ptrs + j * width)."""
    taps = tl.arange(0, HIST_PAD)[:, None]
    return tl.load(w_ptrs[None, :] + taps * width, mask=taps < HIST, other=0), tl.load(w_ptrs + HIST * width)


@triton.jit
def _window_rows(window, s_hist, HIST: tl.constexpr, HIST_PAD: tl.constexpr):
    """A window's rows [HIST_PAD, K] at columns `window` (its oldest row), oldest first."""
    taps = tl.arange(0, HIST_PAD)[:, None]
    return tl.load(window[None, :] + taps * s_hist, mask=taps < HIST, other=0)


@triton.jit
def _conv_silu(x, history, taps, last_tap, dtype: tl.constexpr):
    """SiLU(short conv) of a new row x [K] after its window's rows `history`, summed in fp32 from values in the
    row's dtype and rounded to it, as `_decode_conv_kernel` does; returned as fp32."""
    acc = x.to(tl.float32) * last_tap + tl.sum(history.to(dtype).to(tl.float32) * taps, axis=0)
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(dtype).to(tl.float32)


@triton.jit
def _shift_window(window, history, x, s_hist, HIST: tl.constexpr, HIST_PAD: tl.constexpr):
    """The window moved past row x: its rows 1.. to 0.., x last (`history`: its rows as loaded)."""
    taps = tl.arange(0, HIST_PAD)[:, None]
    tl.store(window[None, :] + (taps - 1) * s_hist, history, mask=(taps > 0) & (taps < HIST))
    tl.store(window + (HIST - 1) * s_hist, x.to(window.dtype.element_ty))


@triton.jit
def _decode_step_kernel(q_ptr, k_ptr, v_ptr, fa_ptr, beta_ptr, gate_ptr, sq, sk, sv, sfa, sbeta, sgate, conv_ptr,
                        s_slot, s_which, s_hist, conv_w_ptr, states_ptr, s_state, slots_ptr, fb_ptr, sfb, a_log_ptr,
                        dt_bias_ptr, norm_w_ptr, out_ptr, scale, lower_bound, norm_eps, H: tl.constexpr,
                        K: tl.constexpr, F: tl.constexpr, HIST: tl.constexpr, HIST_PAD: tl.constexpr,
                        HAS_LOWER_BOUND: tl.constexpr, EPS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ks = tl.arange(0, K)
    fs = tl.arange(0, F)
    cols = h * K + ks  # the head's columns of q, k, v, f, the gate and the output
    width = H * K
    dtype = q_ptr.dtype.element_ty
    # The layer's parameters load before the wait, while the kernel before (the input GEMM) may still run: no
    # kernel writes them. The rows, the slots, the states and the windows are read only after it: earlier
    # kernels write those (the GEMM the rows, the step's staging the slots, the pool's slot copies the states).
    fb = tl.load(fb_ptr + cols[:, None] * sfb + fs[None, :])  # [K, F]: the head's rows of f_b
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + cols).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + ks).to(tl.float32)
    q_taps, q_last = _taps(conv_w_ptr + cols, width, HIST, HIST_PAD)
    k_taps, k_last = _taps(conv_w_ptr + (HIST + 1) * width + cols, width, HIST, HIST_PAD)
    v_taps, v_last = _taps(conv_w_ptr + 2 * (HIST + 1) * width + cols, width, HIST, HIST_PAD)
    pdl.wait_for_inputs(PDL)
    # Every load of the step's data is issued before any arithmetic: the program is a chain of dependent
    # reductions, and a load waiting for its turn behind one put a memory round trip in the chain.
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state_ptrs = states_ptr + slot * s_state + h * K * K + ks[:, None] * K + ks[None, :]
    S = tl.load(state_ptrs).to(tl.float32)  # [K, K]: the longest load, issued first
    f_a = tl.load(fa_ptr + b * sfa + fs).to(tl.float32)
    window = conv_ptr + slot * s_slot + cols
    q_hist = _window_rows(window, s_hist, HIST, HIST_PAD)
    k_hist = _window_rows(window + s_which, s_hist, HIST, HIST_PAD)
    v_hist = _window_rows(window + 2 * s_which, s_hist, HIST, HIST_PAD)
    q_row = tl.load(q_ptr + b * sq + cols)
    k_row = tl.load(k_ptr + b * sk + cols)
    v_row = tl.load(v_ptr + b * sv + cols)
    bt = tl.load(beta_ptr + b * sbeta + h).to(tl.float32)
    gt = tl.load(gate_ptr + b * sgate + cols).to(tl.float32)
    # The windows move on only once every thread has read them: a [K] vector may be held by several threads at
    # once (more threads than columns), and a copy that shifted a row in place before another copy had read it
    # gave that copy the shifted row (wrong outputs at 8 and 16 warps on an H100).
    tl.debug_barrier()
    _shift_window(window, q_hist, q_row, s_hist, HIST, HIST_PAD)
    _shift_window(window + s_which, k_hist, k_row, s_hist, HIST, HIST_PAD)
    _shift_window(window + 2 * s_which, v_hist, v_row, s_hist, HIST, HIST_PAD)
    f = tl.sum(fb.to(tl.float32) * f_a[None, :], axis=1)
    z = f.to(fa_ptr.dtype.element_ty).to(tl.float32) + bias  # f rounded as the f_b GEMM's output was
    qt = _conv_silu(q_row, q_hist, q_taps, q_last, dtype)
    kt = _conv_silu(k_row, k_hist, k_taps, k_last, dtype)
    vt = _conv_silu(v_row, v_hist, v_taps, v_last, dtype)
    S, o = delta_rule_row(S, qt, kt, vt, z, bt, rate, lower_bound, scale, HAS_LOWER_BOUND, EPS)
    tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty))
    # the gated head norm of o in v's dtype (as the recurrence stored it), as _gated_head_norm_kernel computes it
    o = o.to(v_ptr.dtype.element_ty).to(tl.float32)
    normed = o / tl.sqrt(tl.sum(o * o, axis=0) / K + norm_eps)
    y = norm_w * normed * (1.0 / (1.0 + tl.exp(-gt)))
    tl.store(out_ptr + b * width + cols, y.to(out_ptr.dtype.element_ty))
