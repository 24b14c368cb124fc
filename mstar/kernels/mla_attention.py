"""Absorbed MLA attention over the paged latent cache: Triton kernels and the torch functions they must equal.

Every K3 MLA head attends over the same cached rows [c_kv (512) | k_pe (64)] (one latent "KV head": the
model's `mla.absorbed_attention`, which the torch references here equal, tests/kernels/test_kernel_mla.py).
Decode is memory-bound on those rows, so a program loads each 576-wide row once and uses it for every head
it holds, twice: as the key (all 576 columns, against the absorbed query q_abs = [W_UK^T q_nope | q_pe]) and
as the value (the first 512 columns, weighted by the softmax). The kernels take q_abs's two parts as separate
tensors, q_lat = W_UK^T q_nope (the einsum's output) and q_pe (a view of the query projection), and load each
once a program from where it was computed, so no cat builds q_abs; the references take q_abs whole.

Layout of one program (both entry points use the same kernel):

    rows   BLOCK_M (token, head) pairs of one sequence, flattened token-major: one query token times
           all its heads in decode (H=12 fits one tile of 16; H=96 takes two tiles of 64), several
           tokens times all heads in verify/prefill, so the query tokens of a block share the row loads too.
    keys   one split of the sequence's context, walked in tiles of BLOCK_N rows gathered through the
           page table (one page id per tile when BLOCK_N divides the page size, one per row otherwise).
    math   s = q_lat.kv_lat^T + q_pe.kv_pe^T (fp32 accumulate), online softmax in fp32 in the exp2
           domain, acc += p.kv_lat. Padded and causally hidden keys are masked per row.

Split-KV: with `num_splits` > 1 the context of each sequence is cut into equal pieces (a multiple of BLOCK_N
and at least `min_split_tokens`, computed on the device from `context_lens`), every piece writes a
normalised partial output and its log-sum-exp (base 2), and a second kernel merges the pieces. The grid,
the workspace and `num_splits` depend only on shapes, so one capture per bucket replays for any lengths.
A multi-row call may also return each row's whole log-sum-exp (`lse`, written by the kernel or the merge):
the expanded prefill (mla_expanded.py) resumes its online softmax from it and the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from mstar.kernels import pdl
except ImportError:  # the torch references stay usable without triton
    triton = None

LOG2E = 1.4426950408889634
DEFAULT_MIN_SPLIT_TOKENS = 128  # two 64-row tiles: shorter pieces cost more in prologue and partials than they save


# --- configuration -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of the attention kernel."""

    block_m: int  # (token, head) rows per program
    block_n: int  # cache rows per inner iteration
    num_warps: int
    num_stages: int


PREFILL_QUERY_ROWS = 256  # query tokens a sequence from which a multi-query call counts as a prefill chunk


def default_config(num_heads: int, page_size: int, *, multi_query: bool, query_rows: int = 1) -> KernelConfig:
    """Tiles that keep the fp32 accumulator [block_m, 512] in registers (ptxas for sm_90: no spills in decode).

    Decode puts all heads of a token in one tile when they fit (H <= 64): each row load then serves every
    head, which is the whole bandwidth argument. H=12 (TP8) runs 16-row tiles on mma.sync (about 30 FLOP per
    cache byte, far under the ridge); 64-row tiles (H=48, 96, and verify/prefill) run on wgmma. A tile of
    keys stays inside one page when block_n divides the page size (one page-id load, contiguous rows).
    Prefill chunks (`query_rows` >= PREFILL_QUERY_ROWS a sequence) take 64 keys a tile: 1.34-1.43x faster than 32
    at 1,024 and 8,192 tokens on the H200 (benchmarks/kernels/results/h200_ac2ed13_mla_prefill.md); verify and
    draft blocks keep 32 (not measured with 64).
    """
    if multi_query and query_rows >= PREFILL_QUERY_ROWS:
        cfg = KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    elif not multi_query and num_heads <= 16:
        cfg = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
    elif not multi_query and num_heads <= 32:
        cfg = KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2)
    else:
        cfg = KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if 16 <= page_size < cfg.block_n and page_size & (page_size - 1) == 0:
        cfg = KernelConfig(cfg.block_m, page_size, cfg.num_warps, cfg.num_stages)
    return cfg


def num_splits_for(batch: int, num_heads: int, max_context: int, *, query_rows: int = 1, num_sms: int = 132,
                   min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS, max_splits: int = 128) -> int:
    """Splits per sequence for a step of `batch` sequences whose contexts reach `max_context`, each with
    `query_rows` query tokens (1: decode; k+1: a verify block, whose few programs would otherwise each walk
    the whole context alone).

    Pieces never shorter than `min_split_tokens` of `max_context`; all of them when they fit in one wave;
    otherwise the fewest that reach nearly the best wave efficiency (a partial last wave idles SMs).
    Shorter contexts at run time use fewer of the splits (a piece never drops below `min_split_tokens`).
    """
    if batch <= 0 or num_heads <= 0 or max_context <= 0 or query_rows <= 0:
        raise ValueError(f"batch={batch}, num_heads={num_heads}, max_context={max_context} and "
                         f"query_rows={query_rows} must be positive")
    block_m = default_config(num_heads, 64, multi_query=query_rows > 1).block_m
    programs = batch * -(-(query_rows * num_heads) // block_m)
    # A 16-row program holds ~92 KB of shared memory and <= 255 registers x 128 threads: two share an SM
    # (ptxas for sm_90); the 32- and 64-row programs take 112-144 KB, one per SM.
    slots = num_sms * (2 if block_m <= 16 else 1)
    limit = max(1, min(max_splits, -(-max_context // min_split_tokens)))
    if programs >= 0.8 * slots or limit == 1:
        return 1
    if programs * limit <= slots:  # every piece of minimum length runs at once: the shortest critical path
        return limit

    def efficiency(splits: int) -> float:
        work = programs * splits
        return work / (-(-work // slots) * slots)

    best = max(efficiency(s) for s in range(1, limit + 1))
    enough = 0.8 * min(slots, programs * limit)  # most of one wave, or all the work there is
    for s in range(1, limit + 1):
        if efficiency(s) >= 0.85 * best and programs * s >= enough:
            return s
    return limit


def split_workspace(num_splits: int, num_tokens: int, num_heads: int, latent: int,
                    device: torch.device | str) -> tuple[Tensor, Tensor]:
    """The split-KV partials: (out [S, N, H, latent] fp32, lse [S, N, H] fp32). Keep one per capture bucket."""
    return (torch.empty(num_splits, num_tokens, num_heads, latent, dtype=torch.float32, device=device),
            torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=device))


def supported(device: torch.device | str) -> bool:
    """True where the Triton kernels are built and tested: a CUDA device of compute capability 9.x (Hopper)."""
    device = torch.device(device)
    if triton is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def arange_width(width: int) -> bool:
    """Whether a head width can be the kernels' tl.arange extent: a power of two >= 16 (this module's and
    mla_expanded.py's)."""
    return width >= 16 and width & (width - 1) == 0


# --- torch references ---------------------------------------------------------------------------------


def gather_rows(cache: Tensor, pages: Tensor, length: int) -> Tensor:
    """The first `length` rows of one sequence from cache [num_pages, page_size, W] via its page ids."""
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    if n_pages > pages.numel():
        raise ValueError(f"a context of {length} rows needs {n_pages} pages; the page table row has {pages.numel()}")
    return cache[pages[:n_pages].long()].reshape(-1, cache.shape[-1])[:length]


def paged_mla_decode_reference(q_abs: Tensor, cache: Tensor, page_table: Tensor, context_lens: Tensor,
                               scale: float, *, rope_dim: int = 64) -> Tensor:
    """q_abs [B, H, W] (one query per sequence, at position context_lens[b] - 1) -> o_lat [B, H, latent].

    latent = W - rope_dim (K3: 64, the k_pe width). Computed in q_abs's dtype; a context of 0 gives zeros.
    """
    return paged_mla_prefill_reference(
        q_abs, cache, page_table, torch.arange(q_abs.shape[0] + 1), context_lens, scale, rope_dim=rope_dim)


def paged_mla_prefill_reference(q_abs: Tensor, cache: Tensor, page_table: Tensor, cu_seqlens: Tensor,
                                context_lens: Tensor, scale: float, *, rope_dim: int = 64,
                                causal: bool = True) -> Tensor:
    """q_abs [N, H, W]; sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1], its last positions of
    context_lens[b] -> o_lat [N, H, W - rope_dim], causal (or, `causal=False`, every query of b over all of
    b's rows). Rows past cu_seqlens[-1] are zeros."""
    latent = q_abs.shape[-1] - rope_dim
    out = q_abs.new_zeros(*q_abs.shape[:-1], latent)
    cu = cu_seqlens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        q = q_abs[cu[b]: cu[b + 1]]
        if q.shape[0] == 0 or ctx == 0:
            continue
        rows = gather_rows(cache, page_table[b], ctx).to(q.dtype)
        out[cu[b]: cu[b + 1]] = _attend(q, rows, latent, scale, causal)
    return out


def _attend(q: Tensor, rows: Tensor, latent: int, scale: float, causal: bool) -> Tensor:
    """q [T, H, W] at the last T positions of rows [S, W] -> softmax(q.rows^T * scale).rows[:, :latent]
    [T, H, latent], query t seeing rows 0 .. S - T + t (causal) or all S; softmax in at least fp32."""
    logits = torch.einsum("thc,sc->ths", q, rows)
    logits = (logits.float() if logits.element_size() < 4 else logits) * scale
    if causal:
        t, s = q.shape[0], rows.shape[0]
        hidden = torch.arange(s, device=q.device)[None, :] > (s - t + torch.arange(t, device=q.device))[:, None]
        logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("ths,sc->thc", torch.softmax(logits, dim=-1).to(q.dtype), rows[:, :latent])


# --- Triton kernels -------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _split_len(ctx, num_splits, MIN_SPLIT: tl.constexpr, ALIGN: tl.constexpr):
        """Keys per split of a context: an equal share, at least MIN_SPLIT, rounded up to ALIGN."""
        share = tl.maximum(tl.cdiv(ctx, num_splits), MIN_SPLIT)
        return tl.cdiv(share, ALIGN) * ALIGN

    @triton.jit
    def _mla_attn_kernel(
        q_lat_ptr, q_pe_ptr, cache_ptr, page_table_ptr, cu_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        scale_log2, num_heads, num_splits,
        stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_pt,
        stride_ot, stride_oh, stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
        PAGE_SIZE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_KV: tl.constexpr, MIN_SPLIT: tl.constexpr, MULTI_QUERY: tl.constexpr, CAUSAL: tl.constexpr,
        WRITE_LSE: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.wait_for_inputs(PDL)
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + seq)
        if MULTI_QUERY:
            first_token = tl.load(cu_ptr + seq)
            q_len = tl.load(cu_ptr + seq + 1) - first_token
        else:
            first_token = seq
            q_len = 1
        n_rows = q_len * num_heads
        split_len = _split_len(ctx, num_splits, MIN_SPLIT, BLOCK_N)
        kv_start = split * split_len
        # Nothing to do for tiles past this sequence's rows, or (when splitting) splits past its context;
        # the merge reads only the splits that start inside the context.
        if tile * BLOCK_M < n_rows and (not SPLIT_KV or kv_start < ctx):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            t_local = rows // num_heads
            head = rows % num_heads
            token = (first_token + t_local).to(tl.int64)
            last_t = (tl.minimum(tile * BLOCK_M + BLOCK_M, n_rows) - 1) // num_heads
            if CAUSAL:  # each query sees keys 0..query_pos
                query_pos = ctx - q_len + t_local
                kv_end = tl.minimum(kv_start + split_len, ctx - q_len + last_t + 1)
            else:  # every query sees all ctx keys
                query_pos = t_local * 0 + ctx - 1
                kv_end = tl.minimum(kv_start + split_len, ctx)

            d_lat = tl.arange(0, LATENT)
            d_pe = tl.arange(0, ROPE)
            # the query's two parts from where they were computed (no cat): loaded once a program
            q_lat_row = q_lat_ptr + token * stride_qlt + head * stride_qlh
            q_pe_row = q_pe_ptr + token * stride_qpt + head * stride_qph
            q_lat = tl.load(q_lat_row[:, None] + d_lat[None, :], mask=row_ok[:, None], other=0.0)
            q_pe = tl.load(q_pe_row[:, None] + d_pe[None, :], mask=row_ok[:, None], other=0.0)

            # A finite floor for the running max keeps exp2(m_old - m_new) free of inf - inf.
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, LATENT], dtype=tl.float32)
            pt_row = page_table_ptr + seq.to(tl.int64) * stride_pt
            for n0 in range(kv_start, kv_end, BLOCK_N):
                keys = n0 + tl.arange(0, BLOCK_N)
                key_ok = keys < kv_end
                if PAGE_SIZE % BLOCK_N == 0:  # the whole tile lies in one page
                    page = tl.load(pt_row + n0 // PAGE_SIZE).to(tl.int64)
                else:
                    page = tl.load(pt_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
                # The cache is one layer's contiguous [num_pages, PAGE_SIZE, LATENT + ROPE] (checked by the
                # launcher): constant strides let the compiler prove 16-byte alignment of every row.
                row_ptr = cache_ptr + (page * PAGE_SIZE + keys % PAGE_SIZE) * (LATENT + ROPE)
                kv_lat = tl.load(row_ptr[:, None] + d_lat[None, :], mask=key_ok[:, None], other=0.0)
                kv_pe = tl.load(row_ptr[:, None] + LATENT + d_pe[None, :], mask=key_ok[:, None], other=0.0)

                s = tl.dot(q_lat, tl.trans(kv_lat)) + tl.dot(q_pe, tl.trans(kv_pe))
                visible = key_ok[None, :] & (keys[None, :] <= query_pos[:, None])
                s = tl.where(visible, s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(kv_lat.dtype), kv_lat)
                m_i = m_new

            has_keys = l_i > 0.0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            if not SPLIT_KV:
                o_ptr = out_ptr + token * stride_ot + head * stride_oh
                tl.store(o_ptr[:, None] + d_lat[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                if WRITE_LSE:  # the caller's lse [N, H] in place of the partials (after o: no register held past it)
                    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                    tl.store(part_lse_ptr + token * stride_ln + head, lse, mask=row_ok)
            else:
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                split64 = split.to(tl.int64)
                p_ptr = part_o_ptr + split64 * stride_ps + token * stride_pn + head * stride_ph
                tl.store(p_ptr[:, None] + d_lat[None, :], o, mask=row_ok[:, None])
                tl.store(part_lse_ptr + split64 * stride_ls + token * stride_ln + head, lse, mask=row_ok)

    @triton.jit
    def _mla_merge_kernel(
        part_o_ptr, part_lse_ptr, cu_ptr, ctx_ptr, out_ptr, lse_ptr, num_heads, num_splits,
        stride_ps, stride_pn, stride_ph, stride_ls, stride_ln, stride_ot, stride_oh, stride_lt,
        LATENT: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
        MIN_SPLIT: tl.constexpr, ALIGN: tl.constexpr, MULTI_QUERY: tl.constexpr, WRITE_LSE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One (token, head) row and BLOCK_DV output columns: the log-sum-exp merge of its splits (and, with
        WRITE_LSE, the row's whole log-sum-exp, stored by the programs of the first columns)."""
        pdl.wait_for_inputs(PDL)
        row = tl.program_id(0)
        seq = tl.program_id(1)
        dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ctx = tl.load(ctx_ptr + seq)
        if MULTI_QUERY:
            first_token = tl.load(cu_ptr + seq)
            q_len = tl.load(cu_ptr + seq + 1) - first_token
        else:
            first_token = seq
            q_len = 1
        if row < q_len * num_heads:
            token = (first_token + row // num_heads).to(tl.int64)
            head = row % num_heads
            n_active = tl.cdiv(ctx, _split_len(ctx, num_splits, MIN_SPLIT, ALIGN))
            m = tl.full([1], -1.0e30, dtype=tl.float32)
            denom = tl.zeros([1], dtype=tl.float32)
            acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
            for s0 in range(0, n_active, BLOCK_S):
                splits = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
                lse = tl.load(part_lse_ptr + splits * stride_ls + token * stride_ln + head,
                              mask=splits < n_active, other=float("-inf"))
                m_new = tl.maximum(m, tl.max(lse, 0))
                w = tl.exp2(lse - m_new)
                alpha = tl.exp2(m - m_new)
                o = tl.load(part_o_ptr + splits[:, None] * stride_ps + token * stride_pn + head * stride_ph
                            + dv[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
                acc = acc * alpha + tl.sum(w[:, None] * o, 0)
                denom = denom * alpha + tl.sum(w, 0)
                m = m_new
            o = acc / tl.where(denom > 0.0, denom, 1.0)
            tl.store(out_ptr + token * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty))
            if WRITE_LSE and tl.program_id(2) == 0:
                lse = tl.where(denom > 0.0, m + tl.log2(tl.where(denom > 0.0, denom, 1.0)), float("-inf"))
                tl.store(lse_ptr + token * stride_lt + head + tl.arange(0, 1), lse)


# --- launchers -------------------------------------------------------------------------------------------


def _check_inputs(q_lat: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor, context_lens: Tensor, out: Tensor,
                  num_splits: int) -> tuple[int, int]:
    """Validate shapes and dtypes; returns (latent, rope) widths."""
    if triton is None:
        raise RuntimeError("mla_attention kernels need triton; install it or use the *_reference functions")
    if (q_lat.dim() != 3 or q_pe.dim() != 3 or out.dim() != 3 or not q_lat.shape[:2] == q_pe.shape[:2] == out.shape[:2]
            or out.shape[-1] != q_lat.shape[-1]):
        raise ValueError(f"q_lat must be [N, H, latent], q_pe [N, H, rope] and out [N, H, latent] with the same N, H "
                         f"and latent; got q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)} and out "
                         f"{tuple(out.shape)}")
    latent, rope = q_lat.shape[-1], q_pe.shape[-1]
    if cache.dim() != 3 or cache.shape[-1] != latent + rope:
        raise ValueError(f"cache must be one layer's [num_pages, page_size, {latent + rope}] (latent + rope); "
                         f"got {tuple(cache.shape)}")
    for name, width in (("latent (q_lat width)", latent), ("rope (q_pe width)", rope)):
        if not arange_width(width):
            raise ValueError(f"{name} is {width}; the kernel needs a power of two >= 16 (K3: 512 and 64)")
    if (not q_lat.dtype == q_pe.dtype == cache.dtype
            or cache.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"q_lat ({q_lat.dtype}), q_pe ({q_pe.dtype}) and cache ({cache.dtype}) must share one of "
                         f"bf16/fp16/fp32")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension; got strides {t.stride()}")
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous (one layer of the paged cache, cache[layer]); got strides "
                         f"{cache.stride()} for shape {tuple(cache.shape)}")
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table must be [B, max_pages] int32/int64; got {tuple(page_table.shape)} "
                         f"{page_table.dtype}")
    if page_table.stride(-1) != 1:
        raise ValueError(f"page_table must be contiguous in its last dimension; got strides {page_table.stride()}")
    if context_lens.dim() != 1 or context_lens.shape[0] != page_table.shape[0]:
        raise ValueError(f"context_lens must be [B] with B = page_table rows ({page_table.shape[0]}); got "
                         f"{tuple(context_lens.shape)}")
    if context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be int32/int64; got {context_lens.dtype}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int (fixed per capture bucket); got {num_splits!r}")
    devices = {t.device for t in (q_lat, q_pe, cache, page_table, context_lens, out)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    return latent, rope


def _launch(q_lat: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor, cu_seqlens: Tensor | None,
            context_lens: Tensor, scale: float, out: Tensor, *, num_seqs: int, max_rows: int, num_splits: int,
            min_split_tokens: int, workspace: tuple[Tensor, Tensor] | None, config: KernelConfig,
            causal: bool = True, lse: Tensor | None = None) -> Tensor:
    latent, rope = _check_inputs(q_lat, q_pe, cache, page_table, context_lens, out, num_splits)
    num_tokens, num_heads = q_lat.shape[:2]
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32
                            or lse.stride(-1) != 1 or lse.device != q_lat.device):
        raise ValueError(f"lse must be fp32 [N, H] = [{num_tokens}, {num_heads}] with unit head stride on "
                         f"{q_lat.device}; got {tuple(lse.shape)} {lse.dtype} strides {lse.stride()} on {lse.device}")
    if num_seqs == 0 or num_tokens == 0:
        return out
    if config.block_n < 16 or config.block_n & (config.block_n - 1) or min_split_tokens < 1:
        raise ValueError(f"block_n must be a power of two >= 16 and min_split_tokens >= 1; got {config}, "
                         f"min_split_tokens={min_split_tokens}")
    multi_query = cu_seqlens is not None
    cu = cu_seqlens if multi_query else context_lens  # unread when not multi-query
    if num_splits > 1:
        if workspace is None:
            workspace = split_workspace(num_splits, num_tokens, num_heads, latent, q_lat.device)
        part_o, part_lse = workspace
        if (part_o.shape[0] < num_splits or part_o.shape[1:] != (num_tokens, num_heads, latent)
                or part_lse.shape[1:] != (num_tokens, num_heads) or part_lse.stride(-1) != 1
                or part_o.stride(-1) != 1 or part_o.dtype != torch.float32 or part_lse.dtype != torch.float32):
            raise ValueError(f"workspace must be split_workspace({num_splits}, {num_tokens}, {num_heads}, {latent}); "
                             f"got {tuple(part_o.shape)} {part_o.dtype} and {tuple(part_lse.shape)} {part_lse.dtype}")
        lse_strides = part_lse.stride(0), part_lse.stride(1)
    else:  # unread placeholders; the lse output (if any) takes the partials' place: [N, H], no split stride
        part_o, part_lse = out, (lse if lse is not None else out)
        lse_strides = 0, part_lse.stride(0)
    grid = (triton.cdiv(max_rows, config.block_m), num_seqs, num_splits)
    _mla_attn_kernel[grid](
        q_lat, q_pe, cache, page_table, cu, context_lens, out, part_o, part_lse,
        float(scale) * LOG2E, num_heads, num_splits,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), *lse_strides,
        PAGE_SIZE=cache.shape[1], LATENT=latent, ROPE=rope, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        SPLIT_KV=num_splits > 1, MIN_SPLIT=min_split_tokens, MULTI_QUERY=multi_query, CAUSAL=causal,
        WRITE_LSE=lse is not None and num_splits == 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.options(_mla_attn_kernel, q_lat.device),
    )
    if num_splits > 1:
        block_dv = min(128, latent)
        lse_out = lse if lse is not None else part_lse[0]  # unread without an lse output
        _mla_merge_kernel[(max_rows, num_seqs, latent // block_dv)](
            part_o, part_lse, cu, context_lens, out, lse_out, num_heads, num_splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), lse_out.stride(0),
            LATENT=latent, BLOCK_DV=block_dv, BLOCK_S=16,
            MIN_SPLIT=min_split_tokens, ALIGN=config.block_n, MULTI_QUERY=multi_query, WRITE_LSE=lse is not None,
            num_warps=4, **pdl.options(_mla_merge_kernel, q_lat.device),
        )
    return out


def paged_mla_decode(q_lat: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor, context_lens: Tensor,
                     scale: float, out: Tensor, *, num_splits: int, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
                     workspace: tuple[Tensor, Tensor] | None = None, config: KernelConfig | None = None) -> Tensor:
    """Absorbed MLA decode, one query token per sequence; writes and returns `out`.

    q_lat, q_pe  [B, H, latent], [B, H, rope]  the absorbed query [W_UK^T q_nope | q_pe] per head (K3: 512 + 64),
                 bf16, as its two parts were computed (any token and head strides, unit column stride): the
                 `q_abs` of the references without its cat
    cache        [num_pages, page_size, latent + rope]  one layer's slice of the paged latent cache
    page_table   [B, max_pages] int32/int64  page ids of each sequence, in position order
    context_lens [B] int32/int64  rows each sequence attends to, including the one just written; 0 gives zeros
    scale        the softmax scale, (qk_nope + qk_rope)^-0.5 = 192^-0.5 for K3 (not 576^-0.5)
    out          [B, H, latent]
    num_splits   pieces of each context (fixed per capture bucket; `num_splits_for` picks one); > 1 adds
                 a merge kernel and uses `workspace` (`split_workspace(num_splits, B, H, latent)`, allocated
                 here when None: inside a graph capture that comes from the graph's pool)
    No host sync: lengths are read on the device. Lengths past max_pages * page_size are not checked.
    """
    if context_lens.shape[0] != q_lat.shape[0]:
        raise ValueError(f"decode takes one query per sequence: q_lat has {q_lat.shape[0]} rows, context_lens "
                         f"{tuple(context_lens.shape)}")
    cfg = config or default_config(q_lat.shape[1], cache.shape[1], multi_query=False)
    return _launch(q_lat, q_pe, cache, page_table, None, context_lens, scale, out, num_seqs=q_lat.shape[0],
                   max_rows=q_lat.shape[1], num_splits=num_splits, min_split_tokens=min_split_tokens,
                   workspace=workspace, config=cfg)


def paged_mla_prefill(q_lat: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor, cu_seqlens: Tensor,
                      context_lens: Tensor, scale: float, out: Tensor, *, max_query_len: int | None = None,
                      num_splits: int = 1, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
                      workspace: tuple[Tensor, Tensor] | None = None, config: KernelConfig | None = None,
                      causal: bool = True, lse: Tensor | None = None) -> Tensor:
    """Absorbed MLA over several query tokens per sequence (chunked prefill, speculative verify); causal, or
    with `causal=False` every query of sequence b sees all its context_lens[b] rows (a DSpark draft block,
    bidirectional over its own rows and its context; its rows need not be the last ones: q_len_b may exceed
    context_lens[b] for padding rows, which then attend to the same rows).

    q_lat, q_pe  [N, H, latent], [N, H, rope] (as in decode); sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1],
                 which are its last q_len_b positions: query i sits at position context_lens[b] - q_len_b + i
    cu_seqlens   [B+1] int32/int64 row offsets (the step's seq_starts)
    context_lens [B] rows cached after this step (q_len_b <= context_lens[b])
    max_query_len  a static upper bound of every q_len_b (defaults to N; a tighter bound shrinks the grid;
                 rows of a longer sequence past the bound would be skipped)
    lse          optional [N, H] fp32 (unit head stride): each row's log-sum-exp in base 2 of its scaled logits,
                 log2(sum_s 2^(q.k_s * scale * log2(e))), -inf where it saw no row (from the merge when split);
                 with `out` it is the state an online softmax over more keys resumes from (mla_expanded.py)
    Rows of out (and lse) past cu_seqlens[-1] (bucket padding) are left untouched. Other arguments as in decode.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens must be [B+1] = [{context_lens.shape[0] + 1}]; got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.device != q_lat.device:
        raise ValueError(f"cu_seqlens must be int32/int64 on {q_lat.device}; got {cu_seqlens.dtype} "
                         f"on {cu_seqlens.device}")
    num_tokens, num_heads = q_lat.shape[:2]
    max_q = num_tokens if max_query_len is None else min(int(max_query_len), num_tokens)
    cfg = config or default_config(num_heads, cache.shape[1], multi_query=True, query_rows=max_q)
    return _launch(q_lat, q_pe, cache, page_table, cu_seqlens, context_lens, scale, out,
                   num_seqs=context_lens.shape[0], max_rows=max_q * num_heads, num_splits=num_splits,
                   min_split_tokens=min_split_tokens, workspace=workspace, config=cfg, causal=causal, lse=lse)


def decode_bytes(batch: int, context: int, num_heads: int, width: int = 576, latent: int = 512,
                 elem: int = 2) -> int:
    """The fewest bytes one decode call must move: every cached row once, q read once, out written once."""
    return batch * context * width * elem + batch * num_heads * (width + latent) * elem


__all__ = [
    "KernelConfig", "default_config", "num_splits_for", "split_workspace", "supported", "gather_rows",
    "paged_mla_decode", "paged_mla_prefill", "paged_mla_decode_reference", "paged_mla_prefill_reference",
    "decode_bytes",
]
