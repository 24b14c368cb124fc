"""A step's latent KV addressing and its new rows' writes, one launch each.

Addressing (`shifted_slots`), when a verify step in flight shifts the step's positions: planned while that
step runs, sequence b's new rows sit advance[b] positions past what the host knows (resources/latent_kv.py):
each row's position, its slot (page_table[b, pos // page_size] * page_size + pos % page_size) and each
sequence's cached length follow on the device. In torch that is eight launches (two gathers, adds, a floor
division, a remainder), twice a speculative step (the target's KV and the draft's), each costing the host a
dispatch; here it is one.

Writes (`write_latent_rows`): an MLA layer's new rows [c_kv | k_pe] go to their slots of the layer's pages. In
torch that is a cat and an index_put (a gather-scatter kernel far slower than its bytes: ~4.3 us for one row on
the H200); here one launch reads both parts where the layer left them (k_pe a column slice of kv_a) and stores
each row once. Its programs can also normalize the query's first projection (the MLA layer's q_a_layernorm, of
the same GEMM's output) beside the rows, instead of a launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl

_BLOCK = 256


def shifted_slots(page_table: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                  advance: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """page_table [B, P], row_seq [N] (each row's sequence), positions [N] and lens [B] as the host knows them,
    advance [B] (all long, on one device; trusted: every shifted position lies within its sequence's pages) ->
    (slot_mapping [N], context_lens [B] = lens + advance)."""
    B, N = page_table.shape[0], positions.shape[0]
    if page_table.dim() != 2 or row_seq.shape != (N,) or lens.shape != (B,) or advance.shape != (B,):
        raise ValueError(f"shifted_slots takes page_table [B, P], row_seq and positions [N], lens and advance [B]; "
                         f"got {tuple(page_table.shape)}, {tuple(row_seq.shape)}, {tuple(positions.shape)}, "
                         f"{tuple(lens.shape)}, {tuple(advance.shape)}")
    slots = torch.empty(N, dtype=torch.long, device=positions.device)
    context_lens = torch.empty(B, dtype=torch.long, device=positions.device)
    grid = (triton.cdiv(max(N, B, 1), _BLOCK),)
    _shifted_slots_kernel[grid](page_table, row_seq, positions, lens, advance, slots, context_lens,
                                page_table.stride(0), N, B, page_size, BLOCK=_BLOCK, num_warps=4)
    return slots, context_lens


@triton.jit
def _shifted_slots_kernel(table_ptr, row_seq_ptr, pos_ptr, lens_ptr, advance_ptr, slots_ptr, context_lens_ptr,
                          stride_table, N, B, page_size, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = i < N
    seq = tl.load(row_seq_ptr + i, mask=row, other=0)
    pos = tl.load(pos_ptr + i, mask=row, other=0) + tl.load(advance_ptr + seq, mask=row, other=0)
    page = tl.load(table_ptr + seq * stride_table + pos // page_size, mask=row, other=0)
    tl.store(slots_ptr + i, page * page_size + pos % page_size, mask=row)
    seqs = i < B
    shifted = tl.load(lens_ptr + i, mask=seqs, other=0) + tl.load(advance_ptr + i, mask=seqs, other=0)
    tl.store(context_lens_ptr + i, shifted, mask=seqs)


def write_latent_rows(cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      norm: tuple[torch.Tensor, float] | None = None,
                      query: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> None:
    """cache.view(-1, W)[slots] = torch.cat([c_kv, k_pe], -1).to(cache.dtype), in one launch.

    cache [num_pages, page_size, W] is one layer of the paged latent cache (contiguous); slots [N] int32/int64
    (contiguous) the flat rows (page * page_size + offset) the step's rows go to, trusted to lie in the cache
    (no host sync; the runner pads a captured bucket's rows onto the sink slot 0, where, as in torch, one of
    them wins); c_kv [N, R] and k_pe [N, W - R] with unit column strides (any row strides: views of the
    projections are read where they are), each cast to the cache's dtype as it is stored.

    norm = (weight [R] in c_kv's dtype, eps): c_kv is the latent before the layer's kv_a_layernorm, and the rows
    stored are `rms_norm(c_kv, weight, eps)` (statistics in fp32, rounded as models/kimi_k3/norm.py rounds): the
    norm's own launch and its output's round trip are saved.

    query = (q [N, Q] with unit column stride, weight [Q] in q's dtype, eps, out [N, Q] contiguous in q's dtype):
    out = rms_norm(q, weight, eps) too, in programs of their own in the same launch."""
    _check_latent_rows(cache, slots, c_kv, k_pe)
    weight, eps = norm if norm is not None else (c_kv, 0.0)  # unread stand-in without a norm
    if norm is not None:
        _check_norm_weight(weight, c_kv, "norm")
    q, q_weight, q_eps, q_out = query if query is not None else (c_kv, c_kv, 0.0, c_kv)  # unread stand-ins
    if query is not None:
        _check_norm_weight(q_weight, q, "query")
        if (q.dim() != 2 or q.shape[0] != slots.shape[0] or q.stride(1) != 1 or q_out.shape != q.shape
                or q_out.dtype != q.dtype or not q_out.is_contiguous()):
            raise ValueError(f"write_latent_rows: query takes q [N={slots.shape[0]}, Q] with unit column stride and "
                             f"out of its shape and dtype, contiguous; got q {tuple(q.shape)} strides {q.stride()}, "
                             f"out {tuple(q_out.shape)} {q_out.dtype}")
    if slots.shape[0] == 0:
        return
    latent, rope, width = c_kv.shape[1], k_pe.shape[1], q.shape[1]
    _write_latent_rows_kernel[(slots.shape[0], 2 if query is not None else 1)](
        cache, slots, c_kv, k_pe, c_kv.stride(0), k_pe.stride(0), weight, eps, q, q.stride(0), q_weight, q_eps, q_out,
        LATENT=latent, ROPE=rope, QUERY=width, BLOCK_LATENT=triton.next_power_of_2(latent),
        BLOCK_ROPE=triton.next_power_of_2(rope), BLOCK_QUERY=triton.next_power_of_2(width), NORM=norm is not None,
        num_warps=1, **pdl.options(_write_latent_rows_kernel, cache.device))


def _check_norm_weight(weight: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"write_latent_rows: the {name} weight must be [{x.shape[1]}] contiguous {x.dtype} (its "
                         f"rows' width and dtype), got {tuple(weight.shape)} {weight.dtype}")


def _check_latent_rows(cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Raise a ValueError naming every shape unless the arguments are what write_latent_rows takes."""
    N = slots.shape[0] if slots.dim() == 1 else -1
    if (cache.dim() != 3 or not cache.is_contiguous() or N < 0 or not slots.is_contiguous()
            or slots.dtype not in (torch.int32, torch.int64) or c_kv.dim() != 2 or k_pe.dim() != 2
            or c_kv.shape[0] != N or k_pe.shape[0] != N or c_kv.shape[1] + k_pe.shape[1] != cache.shape[-1]
            or c_kv.stride(1) != 1 or k_pe.stride(1) != 1):
        raise ValueError(f"write_latent_rows takes a contiguous cache [pages, page_size, W], contiguous int slots "
                         f"[N], c_kv [N, R] and k_pe [N, W - R] with unit column strides; got cache "
                         f"{tuple(cache.shape)}, slots {tuple(slots.shape)} {slots.dtype}, c_kv {tuple(c_kv.shape)} "
                         f"strides {c_kv.stride()}, k_pe {tuple(k_pe.shape)} strides {k_pe.stride()}")


@triton.jit
def _write_latent_rows_kernel(cache_ptr, slots_ptr, c_ptr, pe_ptr, stride_c, stride_pe, w_ptr, eps, q_ptr, stride_q,
                              q_w_ptr, q_eps, q_out_ptr, LATENT: tl.constexpr, ROPE: tl.constexpr,
                              QUERY: tl.constexpr, BLOCK_LATENT: tl.constexpr, BLOCK_ROPE: tl.constexpr,
                              BLOCK_QUERY: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (row, 0): the row's cache write; (row, 1): its query row normalized (`query`)."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        cols = tl.arange(0, BLOCK_QUERY)
        ok = cols < QUERY
        q = tl.load(q_ptr + row * stride_q + cols, mask=ok, other=0)
        tl.store(q_out_ptr + row * QUERY + cols, _rms_norm_row(q, q_w_ptr, q_eps, cols, ok, QUERY), mask=ok)
        return
    # a constexpr row width lets the compiler prove every cache row's alignment (vector stores)
    dst = cache_ptr + tl.load(slots_ptr + row).to(tl.int64) * (LATENT + ROPE)
    cols = tl.arange(0, BLOCK_LATENT)
    ok = cols < LATENT
    c = tl.load(c_ptr + row * stride_c + cols, mask=ok, other=0)
    if NORM:
        c = _rms_norm_row(c, w_ptr, eps, cols, ok, LATENT)
    tl.store(dst + cols, c.to(cache_ptr.dtype.element_ty), mask=ok)
    cols = tl.arange(0, BLOCK_ROPE)
    pe = tl.load(pe_ptr + row * stride_pe + cols, mask=cols < ROPE)
    tl.store(dst + LATENT + cols, pe.to(cache_ptr.dtype.element_ty), mask=cols < ROPE)


@triton.jit
def _rms_norm_row(x, w_ptr, eps, cols, ok, WIDTH: tl.constexpr):
    """rms_norm of one row x (zero past WIDTH): w * (x * rsqrt(mean(x^2) + eps)).to(dtype), the product rounded
    to x's dtype, statistics in fp32 (as attn_res_norm's norm kernel computes it)."""
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / WIDTH + eps)
    normed = (xf * r).to(x.dtype).to(tl.float32)
    return (tl.load(w_ptr + cols, mask=ok, other=0).to(tl.float32) * normed).to(x.dtype)
