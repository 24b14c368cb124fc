"""KDA over short blocks of rows per sequence (speculative verify, a decode row after a verify, short
prompts), with each sequence's state read from its pool slot and only an accepted prefix folded back.

Speculative decoding keeps a slot's state as a checkpoint and the last verify block's layer inputs as a
pending prefix (resources/recurrent_pool.py). The next step must fold the accepted part of that
prefix into the checkpoint and run its own rows from there, without folding them if they are a
verify block. Here both happen in one pass per layer: each sequence's rows are [accepted prefix ;
new rows], `fold_lens[b]` says how many of them fold (prefix only for a verify block, all for an
ordinary row), and

- `block_conv`: the short causal conv of every row continued from the slot's window (one launch),
  then `fold_windows` moves each window past the folded rows (one launch);
- `fold_recurrent`: the gated delta rule of kda.py's `kda_recurrent` from the slot's state, storing
  the state once, after the last folded row (one launch; fla's state-indexed kernel would store a
  state after every row, 786 KB per row at one TP8 rank of K3).

The conv kernels take each row's sequence and each sequence's first row and fold count from device
tensors, so they serve sequences of any length: a captured prefill step runs its conv through them too
(kda_fla.prefill), with its recurrence in fla's chunked kernel.

The gate (K3's bounded form or Kimi-Linear's softplus form), the L2 norms of q and k and the sigmoid
of beta are computed in the kernel, all in fp32, as in kda.py. Loops over a sequence's rows are
`while` loops: Triton 3.6's interpreter cannot `range` over a run-time bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl

# gather_block_rows' source codes: c >= 0 is row c of x, PREFIX_ROW - j (<= -2) row j of the flattened
# pending prefixes, ZERO_ROW a row of zeros (outside every sequence)
ZERO_ROW = -1
PREFIX_ROW = -2
_ROW_BLOCK = 1024  # columns a row-movement program copies
# fold_recurrent's (state columns, warps) a program: each row is a chain of reductions over K, so the
# rows of a verify block are latency-bound. One warp keeps the reductions inside the warp (no shared-memory
# round trip a row) and 16 columns keep its state tile in 64 registers a thread; bench_small_kernels.py's
# "fold_recurrent" cases time the candidates (results: h200_57a6be2_small_kernels.md).
FOLD_TILE = (16, 1)
FOLD_TILES = ((32, 4), (16, 2), (16, 1), (8, 1), (8, 2), (4, 1))  # the candidates the benchmark times
PREFIX_ROW_C = tl.constexpr(PREFIX_ROW)  # kernels read only constexpr globals


def gather_block_rows(x: torch.Tensor, prefix: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """rows[r] = x[c], prefix[PREFIX_ROW - c] (cast to x's dtype) or zeros, for c = sources[r]: a step's
    combined rows [M, D] from its rows x [N, D] and the layer's pending prefixes `prefix` [P, D], in one
    launch (torch spent a zero fill, a gather and two scatters)."""
    M, D = sources.shape[0], x.shape[1]
    if prefix.shape[1] != D or x.stride(1) != 1 or prefix.stride(1) != 1:
        raise ValueError(f"x [N, D] and prefix [P, D] need the same D and unit column strides, got "
                         f"{tuple(x.shape)} and {tuple(prefix.shape)}")
    rows = torch.empty(M, D, dtype=x.dtype, device=x.device)
    if M:
        _gather_block_rows_kernel[(M, triton.cdiv(D, _ROW_BLOCK))](
            x, prefix, sources, rows, x.stride(0), prefix.stride(0), D, BLOCK=_ROW_BLOCK, num_warps=4,
            **pdl.options(_gather_block_rows_kernel, x.device))
    return rows


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor | None, dst: torch.Tensor, dst_rows: torch.Tensor | None,
              live: torch.Tensor | None = None) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] (cast to dst's dtype) for every i, in one launch; rows [., D] with
    unit column stride, the destination rows distinct. A row list left None is i itself (one of the two must be
    given); with `live` ([n] ints) the rows i with live[i] == 0 are not copied."""
    index = src_rows if src_rows is not None else dst_rows
    if index is None:
        raise ValueError("copy_rows: give the source rows, the destination rows or both")
    (n,), D = index.shape, src.shape[1]
    listed = [r for r in (src_rows, dst_rows, live) if r is not None]
    if any(r.shape != (n,) for r in listed) or dst.shape[1] != D or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(f"copy_rows: row lists {[tuple(r.shape) for r in listed]} must all be [{n}]; src "
                         f"{tuple(src.shape)} and dst {tuple(dst.shape)} need one D and unit column strides")
    if n:
        _copy_rows_kernel[(n, triton.cdiv(D, _ROW_BLOCK))](
            src, index if src_rows is None else src_rows, dst, index if dst_rows is None else dst_rows,
            index if live is None else live, src.stride(0), dst.stride(0), D, SRC_LISTED=src_rows is not None,
            DST_LISTED=dst_rows is not None, MASKED=live is not None, BLOCK=_ROW_BLOCK, num_warps=4,
            **pdl.options(_copy_rows_kernel, src.device))


@triton.jit
def _gather_block_rows_kernel(x_ptr, prefix_ptr, sources_ptr, rows_ptr, stride_x, stride_p, D,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    c = tl.load(sources_ptr + r).to(tl.int64) + cols * 0  # a full tensor: the interpreter masks with no scalar
    from_x = ok & (c >= 0)
    from_prefix = ok & (c <= PREFIX_ROW_C)
    a = tl.load(x_ptr + tl.maximum(c, 0) * stride_x + cols, mask=from_x, other=0)
    b = tl.load(prefix_ptr + tl.maximum(PREFIX_ROW_C - c, 0) * stride_p + cols, mask=from_prefix, other=0)
    value = tl.where(from_x, a, b.to(a.dtype))
    tl.store(rows_ptr + r * D + cols, value.to(rows_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _copy_rows_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, live_ptr, stride_s, stride_d, D,
                      SRC_LISTED: tl.constexpr, DST_LISTED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    i = tl.program_id(0)
    if MASKED:  # noqa: SIM102 (a constexpr branch: without a live list there is nothing to load)
        if tl.load(live_ptr + i) == 0:
            return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    s = tl.load(src_rows_ptr + i).to(tl.int64) if SRC_LISTED else i.to(tl.int64)
    d = tl.load(dst_rows_ptr + i).to(tl.int64) if DST_LISTED else i.to(tl.int64)
    value = tl.load(src_ptr + s * stride_s + cols, mask=ok)
    tl.store(dst_ptr + d * stride_d + cols, value.to(dst_ptr.dtype.element_ty), mask=ok)


def block_conv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
               row_seq: torch.Tensor, seq_starts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(short conv) of rows q, k, v [M, width] (unit column stride) of B sequences: row r belongs to
    sequence row_seq[r], whose rows start at seq_starts[b] and continue slot slots[b]'s window in `conv`
    [slots, 3, W-1, width]; weight fp32 [3, W, width]. Returns [3, M, width] in q's dtype."""
    M, width = q.shape
    out = torch.empty(3, M, width, dtype=q.dtype, device=q.device)
    block = min(1024, triton.next_power_of_2(width))
    _block_conv_kernel[(M, 3, triton.cdiv(width, block))](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), conv, conv.stride(0), conv.stride(1), conv.stride(2),
        slots, row_seq, seq_starts, weight, out, width, HIST=conv.shape[2], BLOCK=block, num_warps=4,
        **pdl.options(_block_conv_kernel, q.device),
    )
    return out


def fold_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                 seq_starts: torch.Tensor, fold_lens: torch.Tensor) -> None:
    """Move each slot's window past the first fold_lens[b] rows of its sequence (in place; run after
    `block_conv`, which reads the old windows)."""
    B = slots.shape[0]
    width = q.shape[1]
    block = min(1024, triton.next_power_of_2(width))
    _fold_windows_kernel[(B, 3, triton.cdiv(width, block))](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), conv, conv.stride(0), conv.stride(1), conv.stride(2),
        slots, seq_starts, fold_lens, width, HIST=conv.shape[2], HIST_PAD=triton.next_power_of_2(conv.shape[2]),
        BLOCK=block, num_warps=4, **pdl.options(_fold_windows_kernel, q.device),
    )


@triton.jit
def _row_value(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, window, s_hist, start, i, which, cols, ok,
               HIST: tl.constexpr):
    """Pre-conv value of the sequence's position i (i < 0: the window's row HIST + i), as fp32 of the rows'
    dtype (the window is cast to it first, as the torch path casts it)."""
    dtype = q_ptr.dtype.element_ty
    row = start + tl.maximum(i, 0)
    # masks are built from full tensors: Triton 3.9's interpreter makes `bool tensor & scalar` an int32 mask
    at = i + cols * 0
    in_rows = ok & (at >= 0)
    if which == 0:
        x = tl.load(q_ptr + row * q_stride + cols, mask=in_rows, other=0)
    elif which == 1:
        x = tl.load(k_ptr + row * k_stride + cols, mask=in_rows, other=0)
    else:
        x = tl.load(v_ptr + row * v_stride + cols, mask=in_rows, other=0)
    w = tl.load(window + (HIST + tl.minimum(i, -1)) * s_hist + cols, mask=ok & (at < 0), other=0)
    return tl.where(at >= 0, x.to(tl.float32), w.to(dtype).to(tl.float32))


@triton.jit
def _block_conv_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, conv_ptr, s_slot, s_which, s_hist,
                       slots_ptr, row_seq_ptr, starts_ptr, w_ptr, out_ptr, width, HIST: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    b = tl.load(row_seq_ptr + r).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int64)
    window = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * s_slot + which * s_which
    pos = r - start
    w_row = w_ptr + which * (HIST + 1) * width + cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(HIST + 1):  # tap j reads position pos - HIST + j
        x = _row_value(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, window, s_hist, start, pos - HIST + j,
                       which, cols, ok, HIST)
        acc += x * tl.load(w_row + j * width, mask=ok, other=0)
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    M = tl.num_programs(0)
    tl.store(out_ptr + which * M * width + r * width + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fold_windows_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, conv_ptr, s_slot, s_which, s_hist,
                         slots_ptr, starts_ptr, fold_ptr, width, HIST: tl.constexpr, HIST_PAD: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    start = tl.load(starts_ptr + b).to(tl.int64)
    fold = tl.load(fold_ptr + b).to(tl.int64)
    window = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * s_slot + which * s_which
    # the new window is positions fold - HIST .. fold - 1; read them all before writing any
    rows = tl.arange(0, HIST_PAD)
    live = rows < HIST
    values = tl.zeros([HIST_PAD, BLOCK], dtype=tl.float32)
    for j in tl.static_range(HIST):
        x = _row_value(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, window, s_hist, start, fold - HIST + j,
                       which, cols, ok, HIST)
        values = tl.where(rows[:, None] == j, x[None, :], values)
    dest = window + rows[:, None] * s_hist + cols[None, :]
    tl.store(dest, values.to(conv_ptr.dtype.element_ty), mask=live[:, None] & (ok & (fold + cols * 0 > 0))[None, :])


def fold_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, lower_bound: float | None,
                   l2_eps: float, states: torch.Tensor, slots: torch.Tensor, seq_starts: torch.Tensor,
                   seq_ends: torch.Tensor, fold_lens: torch.Tensor,
                   tile: tuple[int, int] | None = None) -> torch.Tensor:
    """The gated delta rule over rows of B sequences (see the module doc): sequence b is rows
    seq_starts[b] .. seq_ends[b] - 1. q, k, f [M, H, K] and v [M, H, V] with unit inner strides, beta
    [M, H] (pre-sigmoid), a_log fp32 [H], dt_bias fp32 [H*K]; states fp32 [slots, H, K, V] (one layer of
    the pool), read at slots[b] and written there after row seq_starts[b] + fold_lens[b] - 1 when
    fold_lens[b] > 0. Returns o [M, H, V] in v's dtype (rows outside every sequence are not written).
    `tile`: (state columns a program owns, its warps); default `FOLD_TILE`."""
    M, H, K = q.shape
    V = v.shape[-1]
    B = slots.shape[0]
    out = torch.empty(M, H, V, dtype=v.dtype, device=v.device)
    block_v, warps = FOLD_TILE if tile is None else tile
    block_v = min(block_v, triton.next_power_of_2(V))
    _fold_recurrent_kernel[(B * H, triton.cdiv(V, block_v))](
        q, k, v, f, beta, q.stride(0), k.stride(0), v.stride(0), f.stride(0), beta.stride(0), a_log, dt_bias,
        states, states.stride(0), slots, seq_starts, seq_ends, fold_lens, out, scale,
        0.0 if lower_bound is None else lower_bound, H=H, K=K, V=V, BLOCK_V=block_v,
        HAS_LOWER_BOUND=lower_bound is not None, EPS=l2_eps, num_warps=warps,
        **pdl.options(_fold_recurrent_kernel, q.device),
    )
    return out


@triton.jit
def _row_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, sq, sk, sv, sf, sb, t, end, h, ks, vs, v_ok,
                K: tl.constexpr, V: tl.constexpr):
    """Row t's q, k, v, f (before its bias) and beta of head h, fp32; past the sequence's last row (end - 1)
    that row's again (a valid address; the caller does not use them)."""
    t = tl.minimum(t, tl.maximum(end - 1, 0))
    qt = tl.load(q_ptr + t * sq + h * K + ks).to(tl.float32)
    kt = tl.load(k_ptr + t * sk + h * K + ks).to(tl.float32)
    vt = tl.load(v_ptr + t * sv + h * V + vs, mask=v_ok, other=0).to(tl.float32)
    ft = tl.load(f_ptr + t * sf + h * K + ks).to(tl.float32)
    bt = tl.load(beta_ptr + t * sb + h).to(tl.float32)
    return qt, kt, vt, ft, bt


@triton.jit
def delta_rule_row(S, qt, kt, vt, z, bt, rate, lower_bound, scale, HAS_LOWER_BOUND: tl.constexpr, EPS: tl.constexpr):
    """One row of kda.py's gated delta rule on a state tile S [K, columns] fp32, all in fp32: q and k L2-normalised,
    the gate of z = f + dt_bias (K3's lower_bound * sigmoid(exp(A_log) z), or Kimi-Linear's -exp(A_log)
    softplus(z)), beta's sigmoid. (q, k, z [K]; v and the returned o [columns]; rate = exp(A_log).) Returns
    (the new S, o = S^T (scale q))."""
    qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + EPS)
    kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + EPS)
    if HAS_LOWER_BOUND:
        g = lower_bound / (1.0 + tl.exp(-rate * z))
    else:
        g = -rate * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    S = S * tl.exp(g)[:, None]
    predicted = tl.sum(S * kt[:, None], axis=0)  # S^T k
    S = S + kt[:, None] * ((1.0 / (1.0 + tl.exp(-bt))) * (vt - predicted))[None, :]
    return S, tl.sum(S * (scale * qt)[:, None], axis=0)


@triton.jit
def _fold_recurrent_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, sq, sk, sv, sf, sb, a_log_ptr, dt_bias_ptr,
                           states_ptr, s_slot, slots_ptr, starts_ptr, ends_ptr, fold_ptr, o_ptr, scale, lower_bound,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
                           HAS_LOWER_BOUND: tl.constexpr, EPS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    ks = tl.arange(0, K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vs < V
    start = tl.load(starts_ptr + b).to(tl.int64)
    end = tl.load(ends_ptr + b).to(tl.int64)
    last_folded = start + tl.load(fold_ptr + b).to(tl.int64) - 1
    state_ptrs = states_ptr + tl.load(slots_ptr + b).to(tl.int64) * s_slot + h * K * V + ks[:, None] * V + vs[None, :]
    S = tl.load(state_ptrs, mask=v_ok[None, :], other=0).to(tl.float32)  # [K, BLOCK_V]
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + h * K + ks).to(tl.float32)
    # Row t + 1's inputs are loaded while row t updates the state: the loop is a chain of dependent state
    # updates, and loading each row only when its turn comes put a memory round trip in every step.
    t = start
    qn, kn, vn, zn, bn = _row_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, sq, sk, sv, sf, sb, t, end, h, ks, vs,
                                     v_ok, K, V)
    while t < end:
        qt, kt, vt, bt = qn, kn, vn, bn
        z = zn + bias
        qn, kn, vn, zn, bn = _row_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, sq, sk, sv, sf, sb, t + 1, end, h,
                                         ks, vs, v_ok, K, V)
        S, ot = delta_rule_row(S, qt, kt, vt, z, bt, rate, lower_bound, scale, HAS_LOWER_BOUND, EPS)
        tl.store(o_ptr + t * H * V + h * V + vs, ot.to(o_ptr.dtype.element_ty), mask=v_ok)
        folds_here = v_ok & (t + vs * 0 == last_folded)  # a full tensor (see _row_value)
        tl.store(state_ptrs, S.to(states_ptr.dtype.element_ty), mask=folds_here[None, :])
        t += 1
