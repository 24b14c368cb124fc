"""AttnRes (score + softmax over depth + mix) fused with the RMSNorm that follows it, in two or three launches.

Every K3 sublayer input is `out_norm(attn_res_mix(sources))` (models/kimi_k3/attn_res.py, norm.py):
eager torch spends ~23 small launches on it (stack, casts, pow, mean, rsqrt, softmax, sums, the norm),
twice per layer, which at decode costs more than reading the layer's weights. Over the n stored sources
V_i [D] of a token row (n <= 16; K3: at most 8 blocks + the partial sum):

    add:    V_n += residual (optional: the last sublayer's output into the live partial sum, in place,
            rounded to the stream dtype as the torch add is; saves the add's own launch)
    stats:  s_i = <V_i, w> * rsqrt(mean(V_i^2) + eps_res)      w = res_norm.weight * proj.weight (fp32)
    mix:    alpha = softmax(s);  m = sum_i alpha_i V_i, rounded to the stream dtype (as `attn_res_mix`
            returns it), stored, with sum(m^2) accumulated
    norm:   y = out_norm.weight * (m * rsqrt(mean(m^2) + eps_out)).to(dtype)   (as `rms_norm`)

All statistics in fp32, as the torch path (`attn_res.attn_res_norm` and `norm.rms_norm`, the references
the tests hold it to). Each stage is a reduction over the whole row that the next one needs, so each is
a launch over a grid of (rows, column chunks): a decode step has 1-64 rows, and one program per row
walking D = 7168 columns serially ran at 25 us a call on the H200 (latency-bound: ~80 dependent loads
per program; 327 calls made a third of a batch-1 decode step). Splitting the columns over S programs
per row puts many programs on every SM (one 256-column tile each at decode sizes); each stage then
reads the (tiny) partial statistics of its row's chunks. At many rows (prefill) every program takes one
wide tile (WIDE_TILE columns, every source of a column in one thread), S = D / WIDE_TILE; with S = 1 (a
`splits` of 1) the mix normalises its own row (two launches).

Bytes: the sources twice, the mix row twice, the output once; at decode these are a few hundred KB, so
launch latency, not HBM, is the cost. `rms_norm_rows` (a plain RMSNorm) is one launch of the norm stage; it can
round a wider input as it loads it and write some of a row's columns into a slice of a wider buffer (the latent
MoE's norm: an fp32 routed sum in, this rank's columns out, beside the shared experts' activations).

One launch (decode and verify sizes below WIDE_TILE_ROWS rows, on the GPU): when the rows' programs fit the GPU at
once (at most ONE_LAUNCH_CTAS_PER_SM programs of 4 warps a SM: two always fit, whatever their registers), the three
stages run in one kernel whose programs meet at two per-row barriers instead of kernel boundaries: a
program loads its tile of the sources once (kept in registers for the mix), stores its stats, waits for the
row's other tiles (an atomic counter per row), mixes, stores its square sum, waits again, normalises its
tile. Past ~18 rows of K3 a program takes several wide tiles of its row in a loop instead (the sources
read twice, the mix kept in the output until the norm): 64 rows are 4 programs a row, 264 rows one. The
barriers need every program of the row resident, which the grid bound guarantees: the kernel before it has
all its programs running before this one's start (PDL launches a dependent only then), and the kernel after
it starts only when this one's programs exit. Triton's interpreter runs programs one after another, so
there a row is one program (barriers that wait for no one), which runs the several-tile code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl

MAX_SOURCES = 16
# Programs a call aims for: at decode sizes (up to 64 rows of 28 tiles) every program takes one tile.
# Each tile costs a dependent load and a cross-warp reduction (~2 us in the mix on the H200): with
# ~2 programs per SM, 64 rows took 6 tiles a program and the mix 17 us; many small programs overlap them.
TARGET_PROGRAMS = 2048
ONE_LAUNCH_CTAS_PER_SM = 2  # programs of 4 warps a SM the one-launch path may need resident at once
ONE_LAUNCH_ELEMENTS = 8192  # [sources, columns] of one tile of the one-launch path (64 fp32 a thread)
# From this many rows (verify at B=16, prefill) the default is the three launches with tiles of WIDE_TILE columns
# over WIDE_WARPS warps, one a program: 8 columns a thread, so that each thread holds every source of its columns
# (the mix sums them in registers, not across warps) and a program issues all its loads at once. The narrow tiles
# of 8 warps split the sources across warps and walked a row's chunk in a loop of dependent loads: at 1,024 rows and
# 5-9 sources 0.3-0.5 TB/s (benchmarks/emulate_rank, prefill profile of 7758326). They also beat the one launch from
# 128 rows (16.7 against 18.5 us at 128 rows of 9 sources; equal at 64: kernels/results/h200_6a25f35_attn_res_*).
WIDE_TILE_ROWS = 128
WIDE_TILE, WIDE_WARPS = 1024, 4


def attn_res_norm(sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor, res_eps: float,
                  out_norm_weight: torch.Tensor, out_eps: float, out: torch.Tensor | None = None,
                  splits: int | None = None, residual: torch.Tensor | None = None,
                  one_launch: bool | None = None, tile: tuple[int, int] | None = None,
                  closed: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The fused kernels: `sources` [n, T, D] (n <= MAX_SOURCES, unit column stride) -> [T, D] (into `out`).
    `residual` [T, D]: added into sources[-1] in place first (the stats pass does it). `splits`: column
    chunks per row of the three-launch path; `tile`: its (columns a tile, warps a program), a power of two and
    at most 32 (defaults: `three_launch_tiling`). `one_launch`: the one-launch path (module doc); default:
    below WIDE_TILE_ROWS rows where it fits, when neither `splits` nor `tile` is given.
    `closed` = (stats [>= n - 1, T, 1 + Q] fp32, q): the first n - 1 sources' statistics as
    attn_res_blocks.closed_block_stats left them (source i's at stats[i], this mix's pseudo-query the q-th):
    the stats pass then reads only the last source (three launches)."""
    n, T, D = sources.shape
    if not 1 <= n <= MAX_SOURCES:
        raise ValueError(f"attn_res_norm mixes 1..{MAX_SOURCES} sources, got {n}")
    if residual is not None and (residual.shape != (T, D) or residual.stride(-1) != 1
                                 or residual.dtype != sources.dtype):
        raise ValueError(f"residual must be [{T}, {D}] {sources.dtype} with unit column stride, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    table, query = _check_closed(closed, n, T, sources)
    out = torch.empty(T, D, dtype=sources.dtype, device=sources.device) if out is None else out
    n_pad = triton.next_power_of_2(n)
    if one_launch is None:
        one_launch = splits is None and tile is None and closed is None and prefers_one_launch(T, D, sources.device)
    elif one_launch and closed is not None:
        raise ValueError("attn_res_norm: closed blocks' stats are read by the three launches, not the one launch")
    if one_launch:
        return _attn_res_norm_one_launch(sources, proj_weight, res_norm_weight, res_eps, out_norm_weight, out_eps,
                                         out, residual, n_pad)
    (block, warps), default_splits = three_launch_tiling(T, D, n_pad, tile)
    chunk, S = _chunks(T, D, block, default_splits if splits is None else splits)
    stats = torch.empty(T, S, 2, n_pad, dtype=torch.float32, device=sources.device)
    mixed = torch.empty_like(out)
    _source_stats_kernel[(T, S)](
        sources, sources.stride(0), sources.stride(1), n, proj_weight.reshape(-1), res_norm_weight, stats,
        sources if residual is None else residual, 0 if residual is None else residual.stride(0),
        table, table.stride(0), table.stride(1), query,
        D=D, CHUNK=chunk, S=S, BLOCK_D=block, N_PAD=n_pad, ADD=residual is not None, CLOSED=closed is not None,
        num_warps=warps, **pdl.options(_source_stats_kernel, sources.device),
    )
    square_sums = torch.empty(T, S, dtype=torch.float32, device=sources.device)
    _mix_kernel[(T, S)](
        sources, sources.stride(0), sources.stride(1), n, stats, res_eps, mixed, square_sums, out_norm_weight,
        out_eps, out, D=D, CHUNK=chunk, S=S, S_PAD=triton.next_power_of_2(S), BLOCK_D=block, N_PAD=n_pad,
        NORM=S == 1, num_warps=warps, **pdl.options(_mix_kernel, sources.device),
    )
    if S > 1:
        _norm_kernel[(T, S)](
            mixed, D, square_sums, out_norm_weight, out_eps, out, D, 0, D,
            D=D, CHUNK=chunk, S=S, S_PAD=triton.next_power_of_2(S), BLOCK_D=block, OWN_STATS=False,
            num_warps=warps, **pdl.options(_norm_kernel, sources.device),
        )
    return out


def _check_closed(closed: tuple[torch.Tensor, int] | None, n: int, T: int, sources: torch.Tensor
                  ) -> tuple[torch.Tensor, int]:
    """(stats table, query) of `closed`; without it `sources`, a placeholder the kernel never reads."""
    if closed is None:
        return sources, 0
    table, query = closed
    if (table.dtype != torch.float32 or table.dim() != 3 or table.shape[0] < n - 1 or table.shape[1] != T
            or not 0 <= query < table.shape[2] - 1 or table.stride(2) != 1):
        raise ValueError(f"closed stats must be [>= {n - 1}, {T}, 1 + Q] fp32 with unit column stride and a query "
                         f"in 0..Q-1, got {tuple(table.shape)} {table.dtype} and query {query}")
    return table, query


def three_launch_tiling(T: int, D: int, n_pad: int, tile: tuple[int, int] | None = None
                        ) -> tuple[tuple[int, int], int | None]:
    """((columns a tile, warps a program), chunks a row or None for `_chunks`' default) of the three launches:
    from WIDE_TILE_ROWS rows wide tiles, one a program (the WIDE_TILE note); below, tiles of ~4K elements over
    8 warps and enough chunks to fill the GPU. A given `tile` is checked and kept, with `_chunks`' default."""
    if tile is not None:
        block, warps = tile
        if block < 1 or block & (block - 1) or warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"tile={tile}: need (columns a power of two, warps a power of two <= 32)")
        return (block, warps), None
    if T >= WIDE_TILE_ROWS:
        block = min(WIDE_TILE, triton.next_power_of_2(D))
        return (block, WIDE_WARPS), triton.cdiv(D, block)
    return (_block(D, n_pad), 8), None


def _one_launch_plan(T: int, D: int, n_pad: int, device: torch.device) -> tuple[int, int, int] | None:
    """(tile columns, tiles a program, programs a row) of the one-launch grid, or None where it cannot be
    resident at once on `device`. A program takes one tile (kept in registers) where the rows' tiles fit,
    else several smaller ones in a loop (the sources read twice). Triton's interpreter runs programs one
    after another: there a row is one program (its barriers wait for no one)."""
    if _interpreted():
        per_row = 1
    elif device.type == "cuda":
        per_row = ONE_LAUNCH_CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count // T
    else:
        return None
    if per_row < 1:
        return None
    block = min(triton.next_power_of_2(D), max(256, ONE_LAUNCH_ELEMENTS // n_pad))
    if per_row < triton.cdiv(D, block):
        block = min(triton.next_power_of_2(D), WIDE_TILE)  # tiles loaded in a loop: wide ones (WIDE_TILE note)
    n_tiles = triton.cdiv(D, block)
    tiles = triton.cdiv(n_tiles, min(per_row, n_tiles))
    return block, tiles, triton.cdiv(n_tiles, tiles)


def prefers_one_launch(rows: int, width: int, device: torch.device) -> bool:
    """Whether `attn_res_norm` takes the one launch by default at `rows` rows of `width` (module doc): below
    WIDE_TILE_ROWS rows, on a GPU where they fit at once; the three launches otherwise."""
    return rows < WIDE_TILE_ROWS and _one_launch_fits(rows, width, 1, device)


def _one_launch_fits(T: int, D: int, n_pad: int, device: torch.device) -> bool:
    """Whether the default path is the one launch: on a GPU (not the interpreter), with a grid resident at once."""
    return device.type == "cuda" and not _interpreted() and _one_launch_plan(T, D, n_pad, device) is not None


def _interpreted() -> bool:
    return type(_one_launch_kernel).__name__ == "InterpretedFunction"


_ROW_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: one barrier counter a row, zero between launches


def _row_counters(device: torch.device, rows: int) -> torch.Tensor:
    """At least `rows` counters; on a GPU as many as the one-launch path can have rows (one allocation)."""
    have = _ROW_COUNTERS.get(device)
    if have is None or have.numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attn_res_norm: the first one-launch call on a device must run before CUDA-graph "
                               "capture (it allocates the rows' barrier counters); run one eager step first")
        most = ONE_LAUNCH_CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 0
        _ROW_COUNTERS[device] = have = torch.zeros(max(rows, most), dtype=torch.int32, device=device)
    return have


def _attn_res_norm_one_launch(sources, proj_weight, res_norm_weight, res_eps, out_norm_weight, out_eps, out, residual,
                              n_pad):
    n, T, D = sources.shape
    plan = _one_launch_plan(T, D, n_pad, sources.device)
    if plan is None:
        raise ValueError(f"attn_res_norm: one launch of {T} rows does not fit the GPU at once (at most "
                         f"{ONE_LAUNCH_CTAS_PER_SM} programs a SM, a program a row at least)")
    block, tiles, S = plan
    stats = torch.empty(T, S, 2, n_pad, dtype=torch.float32, device=sources.device)
    square_sums = torch.empty(T, S, dtype=torch.float32, device=sources.device)
    _one_launch_kernel[(T, S)](
        sources, sources.stride(0), sources.stride(1), n, proj_weight.reshape(-1), res_norm_weight, res_eps,
        sources if residual is None else residual, 0 if residual is None else residual.stride(0), stats, square_sums,
        _row_counters(sources.device, T), out_norm_weight, out_eps, out,
        D=D, S=S, S_PAD=triton.next_power_of_2(S), BLOCK_D=block, TILES=tiles, N_PAD=n_pad,
        ADD=residual is not None, num_warps=4, **pdl.options(_one_launch_kernel, sources.device),
    )
    return out


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  columns: slice | None = None, square_sums: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm(x.to(dtype), weight, eps)[..., columns]` for x [..., D] in one launch, into `out` if given (rows
    of any stride, unit column stride), dtype being out's (else x's). x is rounded to that dtype as it is loaded:
    a wider sum (fp32) is normalised as its rounded copy would be, without the copy. The statistics take whole rows;
    only `columns` (consecutive, default all) are written, column `columns.start` at out's first.
    With `square_sums` [rows] fp32, x holds only `columns` of rows whose whole width is weight's, and these are the
    whole rows' sums of squares (a reduce-scatter's piece: models/kimi_k3/moe.py)."""
    rows = x.reshape(-1, x.shape[-1])
    T = rows.shape[0]
    D = rows.shape[1] if square_sums is None else weight.shape[0]
    first, stop, step = (slice(None) if columns is None else columns).indices(D)
    if step != 1 or stop <= first:
        raise ValueError(f"columns={columns}: need consecutive columns of the {D}")
    width = stop - first
    if square_sums is not None and (rows.shape[1] != width or square_sums.shape != (T,)
                                    or square_sums.dtype != torch.float32):
        raise ValueError(f"with square_sums, x holds the {width} columns {columns} of each row and square_sums is "
                         f"[{T}] fp32; got x {tuple(x.shape)} and square_sums {tuple(square_sums.shape)} "
                         f"{square_sums.dtype}")
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device) if out is None else out
    out_rows = out.view(T, width)
    if out_rows.stride(1) != 1 and width > 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")
    if square_sums is None:  # the statistics over x's whole row, its `columns` written
        stats, w, col0, col1 = rows, weight, first, stop
    else:  # the row's columns from x's first, the weight's from `first`, the mean over D
        stats, w, col0, col1 = square_sums, weight[first:], 0, width
    # a row of 7168 is two tiles: one program per row is already short, no split
    _norm_kernel[(T, 1)](rows, rows.stride(0), stats, w, eps, out_rows, out_rows.stride(0), col0, col1,
                         D=D, CHUNK=width, S=1, S_PAD=1, BLOCK_D=_block(rows.shape[1], 1),
                         OWN_STATS=square_sums is None, num_warps=8, **pdl.options(_norm_kernel, x.device))
    return out


def _block(D: int, n_pad: int) -> int:
    # Tiles of [sources, columns] of ~4K elements (16 fp32 registers a thread at 8 warps): a [16, 1024]
    # tile spilled and was latency-bound.
    return min(triton.next_power_of_2(D), max(256, 4096 // n_pad))


def _chunks(T: int, D: int, block: int, splits: int | None) -> tuple[int, int]:
    """(columns per chunk, a multiple of `block`; chunks per row)."""
    tiles = triton.cdiv(D, block)
    if splits is None:
        splits = triton.cdiv(TARGET_PROGRAMS, T)
    if splits < 1:
        raise ValueError(f"splits={splits}: need at least 1 chunk per row")
    per_chunk = triton.cdiv(tiles, min(splits, tiles))
    return per_chunk * block, triton.cdiv(tiles, per_chunk)


@triton.jit
def _source_stats_kernel(src_ptr, stride_n, stride_t, n_sources, proj_ptr, res_w_ptr, stats_ptr, residual_ptr,
                         stride_rt, closed_ptr, stride_cj, stride_ct, query, D: tl.constexpr, CHUNK: tl.constexpr,
                         S: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, ADD: tl.constexpr,
                         CLOSED: tl.constexpr, PDL: tl.constexpr):
    """stats[t, s] = (sum V_i^2, <V_i, w>) over chunk s of row t, for every source i; with ADD, first
    V_last += residual in place over the chunk (rounded to the stream dtype, as the torch add). With CLOSED only
    the last source is read: the others' whole-row stats come from the closed table, put in chunk 0's."""
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row_src = src_ptr + t * stride_t
    cols = tl.arange(0, BLOCK_D)
    srcs = tl.arange(0, N_PAD)
    if CLOSED:
        last = row_src + (n_sources - 1) * stride_n
        sq_last = tl.zeros([BLOCK_D], dtype=tl.float32)
        dot_last = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, D), BLOCK_D):
            c = d0 + cols
            ok = c < D
            v = _last_source(last, residual_ptr + t * stride_rt, c, ok, ADD)
            sq_last += v * v
            dot_last += v * _pseudo_query(proj_ptr, res_w_ptr, c, ok)
        earlier = srcs < tl.where(s == 0, n_sources - 1, 0)  # chunk 0 holds the closed blocks' whole-row stats
        table = closed_ptr + srcs * stride_cj + t * stride_ct
        is_last = srcs == n_sources - 1
        sq = tl.where(is_last, tl.sum(sq_last, axis=0), tl.load(table, mask=earlier, other=0))
        dot = tl.where(is_last, tl.sum(dot_last, axis=0), tl.load(table + 1 + query, mask=earlier, other=0))
    else:
        sq = tl.zeros([N_PAD], dtype=tl.float32)
        dot = tl.zeros([N_PAD], dtype=tl.float32)
        for d0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, D), BLOCK_D):
            v, w = _tile_sources(row_src, stride_n, n_sources, proj_ptr, res_w_ptr, residual_ptr + t * stride_rt,
                                 d0 + cols, D, N_PAD, ADD)
            sq += tl.sum(v * v, axis=1)
            dot += tl.sum(v * w[None, :], axis=1)
    _store_stats(stats_ptr, t, s, S, sq, dot, N_PAD)


@triton.jit
def _pseudo_query(proj_ptr, res_w_ptr, c, ok):
    """w = res_norm.weight * proj.weight at columns c, in fp32."""
    return tl.load(res_w_ptr + c, mask=ok, other=0).to(tl.float32) * tl.load(proj_ptr + c, mask=ok,
                                                                             other=0).to(tl.float32)


@triton.jit
def _last_source(last_row, residual_row, c, ok, ADD: tl.constexpr):
    """The last source at columns c in fp32; with ADD it becomes V_last + residual first, stored in place rounded
    to the stream dtype (as the torch add)."""
    if ADD:
        summed = (tl.load(last_row + c, mask=ok, other=0).to(tl.float32)
                  + tl.load(residual_row + c, mask=ok, other=0).to(tl.float32)).to(last_row.dtype.element_ty)
        tl.store(last_row + c, summed, mask=ok)
        return summed.to(tl.float32)
    return tl.load(last_row + c, mask=ok, other=0).to(tl.float32)


@triton.jit
def _tile_sources(row_src, stride_n, n_sources, proj_ptr, res_w_ptr, residual_row, c, D: tl.constexpr,
                  N_PAD: tl.constexpr, ADD: tl.constexpr):
    """(V [N_PAD, cols] fp32, w [cols] fp32) at columns c of a row; with ADD the last source becomes
    V_last + residual first (`_last_source`)."""
    srcs = tl.arange(0, N_PAD)
    ok = c < D
    w = _pseudo_query(proj_ptr, res_w_ptr, c, ok)
    if ADD:
        # The last source is read as a row of its own: taking it out of the tile would be a reduction over the
        # tile's source axis (across warps where the warps split the sources).
        summed = _last_source(row_src + (n_sources - 1) * stride_n, residual_row, c, ok, True)
        v = tl.load(row_src + srcs[:, None] * stride_n + c[None, :],
                    mask=(srcs < n_sources - 1)[:, None] & ok[None, :], other=0).to(tl.float32)
        v = tl.where((srcs == n_sources - 1)[:, None], summed[None, :], v)
    else:
        v = tl.load(row_src + srcs[:, None] * stride_n + c[None, :], mask=(srcs < n_sources)[:, None] & ok[None, :],
                    other=0).to(tl.float32)
    return v, w


@triton.jit
def _store_stats(stats_ptr, t, s, S: tl.constexpr, sq, dot, N_PAD: tl.constexpr):
    out = stats_ptr + (t * S + s) * 2 * N_PAD
    srcs = tl.arange(0, N_PAD)
    tl.store(out + srcs, sq)
    tl.store(out + N_PAD + srcs, dot)


@triton.jit
def _row_weights(stats_ptr, t, n_sources, res_eps, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                 N_PAD: tl.constexpr):
    """alpha = softmax over the sources of <V_i, w> * rsqrt(mean(V_i^2) + eps), from the row's chunk stats
    (read from L2: other programs of the row wrote them)."""
    srcs = tl.arange(0, N_PAD)
    chunks = tl.arange(0, S_PAD)
    row_stats = stats_ptr + t * S * 2 * N_PAD + chunks[:, None] * 2 * N_PAD + srcs[None, :]
    full = (chunks[:, None] < S) & (srcs[None, :] < N_PAD)
    sq = tl.sum(tl.load(row_stats, mask=full, other=0, cache_modifier=".cg"), axis=0)
    dot = tl.sum(tl.load(row_stats + N_PAD, mask=full, other=0, cache_modifier=".cg"), axis=0)
    score = tl.where(srcs < n_sources, dot / tl.sqrt(sq / D + res_eps), float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def _row_square_sum(ss_ptr, t, S: tl.constexpr, S_PAD: tl.constexpr):
    chunks = tl.arange(0, S_PAD)
    return tl.sum(tl.load(ss_ptr + t * S + chunks, mask=chunks < S, other=0, cache_modifier=".cg"), axis=0)


@triton.jit
def _mix_kernel(src_ptr, stride_n, stride_t, n_sources, stats_ptr, res_eps, mixed_ptr, ss_ptr, out_w_ptr, out_eps,
                out_ptr, D: tl.constexpr, CHUNK: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
                BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """The softmax over the row's source scores, the mix of chunk s (stored, rounded) and its square
    sum; with NORM (one chunk per row) also the output norm of the row."""
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    srcs = tl.arange(0, N_PAD)
    live = srcs < n_sources
    alpha = _row_weights(stats_ptr, t, n_sources, res_eps, D, S, S_PAD, N_PAD)
    dtype = out_ptr.dtype.element_ty
    row_src = src_ptr + t * stride_t
    row_mixed = mixed_ptr + t * D
    cols = tl.arange(0, BLOCK_D)
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, D), BLOCK_D):
        c = d0 + cols
        ok = c < D
        v = tl.load(row_src + srcs[:, None] * stride_n + c[None, :], mask=live[:, None] & ok[None, :],
                    other=0).to(tl.float32)
        m = tl.sum(alpha[:, None] * v, axis=0).to(dtype)
        tl.store(row_mixed + c, m, mask=ok)
        mf = m.to(tl.float32)
        ss += mf * mf
    if NORM:
        tl.debug_barrier()  # the row's mix, stored above by every thread, is read back across threads
        _normalize(row_mixed, out_ptr + t * D, out_w_ptr, tl.sum(ss, axis=0), out_eps, 0, D, D, BLOCK_D)
    else:
        tl.store(ss_ptr + t * S + s, tl.sum(ss, axis=0))


@triton.jit
def _norm_kernel(x_ptr, stride_t, ss_ptr, out_w_ptr, out_eps, out_ptr, stride_out, col0, col1, D: tl.constexpr,
                 CHUNK: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                 OWN_STATS: tl.constexpr, PDL: tl.constexpr):
    """The output RMSNorm of chunk s of row t's columns [col0, col1), column c stored at out column c - col0, from
    the row's partial square sums (OWN_STATS: one chunk per row, whose square sum this program takes itself over
    the whole row: a plain RMSNorm). x is read rounded to out's dtype (as `_normalize` reads it)."""
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row = x_ptr + t * stride_t
    if OWN_STATS:
        cols = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            x = tl.load(row + c, mask=c < D, other=0).to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += x * x
        ss = tl.sum(acc, axis=0)
    else:
        ss = _row_square_sum(ss_ptr, t, S, S_PAD)
    c0 = col0 + s * CHUNK
    _normalize(row, out_ptr + t * stride_out - col0, out_w_ptr, ss, out_eps, c0, tl.minimum(c0 + CHUNK, col1), D,
               BLOCK_D)


@triton.jit
def _one_launch_kernel(src_ptr, stride_n, stride_t, n_sources, proj_ptr, res_w_ptr, res_eps, residual_ptr, stride_rt,
                       stats_ptr, ss_ptr, counters_ptr, out_w_ptr, out_eps, out_ptr, D: tl.constexpr, S: tl.constexpr,
                       S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, N_PAD: tl.constexpr,
                       ADD: tl.constexpr, PDL: tl.constexpr):
    """Stats, mix and norm of tiles s * TILES .. of row t, the row's programs meeting at two barriers (module
    doc). One tile stays in registers from the stats to the norm; several are read again for the mix, whose
    rounded values wait in `out` (this program's own columns) for the norm."""
    if PDL:  # no early launch of the dependents: they start when this grid's programs exit
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row_src = src_ptr + t * stride_t
    out_row = out_ptr + t * D
    cols = s * TILES * BLOCK_D + tl.arange(0, BLOCK_D)
    if TILES == 1:
        v, w = _tile_sources(row_src, stride_n, n_sources, proj_ptr, res_w_ptr, residual_ptr + t * stride_rt, cols,
                             D, N_PAD, ADD)
        sq, dot = tl.sum(v * v, axis=1), tl.sum(v * w[None, :], axis=1)
    else:
        sq, dot = tl.zeros([N_PAD], dtype=tl.float32), tl.zeros([N_PAD], dtype=tl.float32)
        for i in range(TILES):
            v, w = _tile_sources(row_src, stride_n, n_sources, proj_ptr, res_w_ptr, residual_ptr + t * stride_rt,
                                 cols + i * BLOCK_D, D, N_PAD, ADD)
            sq += tl.sum(v * v, axis=1)
            dot += tl.sum(v * w[None, :], axis=1)
    _store_stats(stats_ptr, t, s, S, sq, dot, N_PAD)
    counter = counters_ptr + t
    _row_barrier(counter, S)
    alpha = _row_weights(stats_ptr, t, n_sources, res_eps, D, S, S_PAD, N_PAD)
    dtype = out_ptr.dtype.element_ty
    if TILES == 1:
        m = tl.sum(alpha[:, None] * v, axis=0).to(dtype).to(tl.float32)  # the mix, rounded as attn_res_mix returns it
        ss = tl.sum(m * m, axis=0)
    else:
        ss = 0.0
        for i in range(TILES):
            c = cols + i * BLOCK_D
            v, _ = _tile_sources(row_src, stride_n, n_sources, proj_ptr, res_w_ptr, residual_ptr, c, D, N_PAD, False)
            m = tl.sum(alpha[:, None] * v, axis=0).to(dtype)
            tl.store(out_row + c, m, mask=c < D)
            mf = m.to(tl.float32)
            ss += tl.sum(mf * mf, axis=0)
    tl.store(ss_ptr + t * S + s, ss)
    _row_barrier(counter, 2 * S)  # its leading thread barrier also orders this program's mix stores before the reads
    r = 1.0 / tl.sqrt(_row_square_sum(ss_ptr, t, S, S_PAD) / D + out_eps)
    if TILES == 1:
        ok = cols < D
        tl.store(out_row + cols, _scaled(m, r, out_w_ptr, cols, ok, dtype), mask=ok)
    else:
        for i in range(TILES):
            c = cols + i * BLOCK_D
            ok = c < D
            x = tl.load(out_row + c, mask=ok, other=0).to(tl.float32)
            tl.store(out_row + c, _scaled(x, r, out_w_ptr, c, ok, dtype), mask=ok)
    # Every program of the row has left both barriers once all have arrived a third time: the last one zeroes
    # the counter for the next launch.
    if tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == 3 * S - 1:
        tl.store(counter, 0)


@triton.jit
def _row_barrier(counter, target):
    """Arrive at `counter` and wait until it reaches `target`: what the row's programs stored before arriving
    is then visible (release/acquire at GPU scope; their stats are read past L1)."""
    tl.debug_barrier()  # every thread's stores come before the arrival
    seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # no thread reads before the wait is over


@triton.jit
def _normalize(row_ptr, out_row_ptr, w_ptr, square_sum, eps, c0, c1, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [c0, c1) of out = w * (x * rsqrt(square_sum / D + eps)).to(dtype), rounded as `rms_norm`; x read
    rounded to out's dtype (a no-op where it is stored in it)."""
    dtype = out_row_ptr.dtype.element_ty
    r = 1.0 / tl.sqrt(square_sum / D + eps)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(c0, c1, BLOCK_D):
        c = d0 + cols
        ok = c < c1
        x = tl.load(row_ptr + c, mask=ok, other=0).to(dtype).to(tl.float32)
        tl.store(out_row_ptr + c, _scaled(x, r, w_ptr, c, ok, dtype), mask=ok)


@triton.jit
def _scaled(x, r, w_ptr, c, ok, dtype: tl.constexpr):
    """w * (x * r).to(dtype), rounded to dtype (x fp32 at columns c)."""
    w = tl.load(w_ptr + c, mask=ok, other=0).to(tl.float32)
    return (w * (x * r).to(dtype).to(tl.float32)).to(dtype)
