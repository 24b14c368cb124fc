"""y = x W^T for a few rows of x (decode: 1-64 tokens), streaming W once at close to HBM bandwidth, in ONE launch.

At decode a K3 rank's dense projections are GEMVs: KDA's and MLA's stacked inputs, the o_projs, the shared
experts, the latent MoE's down/up projections, the lm_head (benchmarks/kernels/bench_skinny_gemm.py lists them
with their counts). Their bytes are the weights; cuBLAS runs them as split-K GEMM + reduce pairs (two launches)
or gemv at ~58% of the copy bandwidth at batch 1, the small ones at 3-4x their floor.

How this kernel reaches the bandwidth:
- Swap A and B: y^T = W x^T, so W's rows are the tensor-core M side. A program loads a [BLOCK_N, BLOCK_K] tile
  of W (wide, coalesced, each byte once) and x's [BLOCK_M, BLOCK_K] rows (x padded to 16 or 64 rows by masked
  loads, which move no bytes), and the multiply-adds cost nothing beside the loads.
- Stream-K over a persistent grid: the (N tile, K tile) units, N-tile major, are cut into `ctas` equal
  contiguous ranges, one per program, with `ctas` a multiple of the SM count. Every SM then streams the same
  number of bytes (a split-K grid of n_tiles x splits programs leaves its last wave partly empty; the first
  Triton GEMV of this project, such a grid, lost to cuBLAS: benchmarks/kernels/results/README.md). The loop
  runs flat over a program's units, so the software pipeline keeps loading across N-tile boundaries.
- One launch, no zeroed buffer per call: an N tile covered by one program is stored straight to y. A tile
  shared by programs gets each program's fp32 partial in a workspace slot; the program that finds itself last
  on the tile's semaphore (an atomic counter, acq_rel) adds the partials in program order (deterministic:
  the same bits whatever the arrival order), stores y, and sets the counter back to zero for the next launch.
  At most one shared tile starts in each program's range, so the counters are indexed by the tile's first
  program, and each program has two partial slots (its range's first and last tile).
- Programmatic dependent launch (Hopper, `launch_pdl=True`): before `gdc_wait` (which waits for the previous
  kernel's writes) a program only prefetches its first W tiles into L2 (weights, which no kernel of the step
  writes); every read of x and every write (y, partials, counters) comes after it. So the weight stream starts
  under the previous kernel's tail, and the next launch may start as soon as this one's inputs are read.

The workspace (partials and counters) is one per device, allocated on first use (which must not be inside a
CUDA-graph capture: the warm-up step before capture makes it) and shared by every call: launches must be
ordered on one stream (PDL keeps that order: all workspace accesses follow `gdc_wait`).

Which calls take the kernel and which cuBLAS is `use_kernel` (a measured table, see there); `linear` is the
entry point the backend calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.kernels import pdl

MAX_ROWS = 64  # x rows the kernel takes; more rows: cuBLAS (a GEMM, no longer bound by the weight stream)
DTYPES = (torch.bfloat16, torch.float16)  # the served dtypes; fp32 runs too (the interpreter's tests)
MAX_CTAS_PER_SM = 4
MAX_TILE = 8192  # fp32 elements of one partial, BLOCK_N x BLOCK_M
REDUCE_UNROLL = 8  # partials the last program loads at once (independent loads: one round trip per 8)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile shape, pipeline depth and persistent grid (programs = ctas_per_sm x SMs, at most the units)."""

    block_n: int = 64
    block_k: int = 256
    stages: int = 4
    warps: int = 4
    ctas_per_sm: int = 1

    def block_m(self, rows: int) -> int:
        return 16 if rows <= 16 else 64


def default_config(rows: int) -> SkinnyConfig:
    """The tiles of a shape the measured table does not hold: the config that won most K3 shapes in the sweep."""
    if rows > 16:  # 64 x 64 x 128 x 2 B of x per stage beside W's 64 x 128: 4 stages fit in shared memory
        return SkinnyConfig(block_n=64, block_k=128, stages=4)
    return SkinnyConfig(block_n=64, block_k=128, stages=6)


# --- which path runs a call: a table measured on the H200 ------------------------------------------------------

MEASURED_ROWS = (1, 8, 16, 64)  # a call of r rows takes the entry of the first of these >= r
_WIDE = SkinnyConfig(64, 128, 3, ctas_per_sm=3)
_DEEP = SkinnyConfig(64, 128, 6)
_LONG = SkinnyConfig(64, 256, 4)
# (N, K) of a TP8 rank of pruned75 -> per MEASURED_ROWS, the fastest swept config where it beat cuBLAS by more
# than 2% (the same config timed twice in that run differed by under 1%), None where cuBLAS ran: the H200 run at
# 0a78fac, benchmarks/kernels/results/h200_0a78fac_skinny_gemm.md (µs per call in a graph, L2 rotated, ours vs
# cuBLAS at 1 row in the comments). The shapes it does not name (o_proj 7168x1536, the shared experts' down
# 7168x768, the latent 448x7168 and 7168x448, MLA q_b 2304x1536, the dense MLP's down 7168x4224) ran faster
# through cuBLAS at every row count, as does any shape not measured.
H200_TABLE: dict[tuple[int, int], tuple[SkinnyConfig | None, ...]] = {
    # KDA inputs (6284 rows, stacked padded to 6288): 25.4 vs 31.8; 32.0 vs 43.4 at 64
    (6288, 7168): (_WIDE, _WIDE, _WIDE, SkinnyConfig(64, 128, 4)),
    (1536, 128): (_WIDE, _WIDE, _WIDE, SkinnyConfig(32, 128, 4, ctas_per_sm=2)),  # KDA f_b: 1.41 vs 2.58
    (8448, 7168): (_DEEP, _LONG, _DEEP, None),  # the dense MLP's gate/up: 30.2 vs 31.9
    (1536, 7168): (_DEEP, None, _DEEP, None),  # the shared experts' gate/up: 9.72 vs 9.97
    (3648, 7168): (None, _DEEP, _DEEP, None),  # MLA inputs: 17.1 vs 17.0 (17.2 vs 18.2 at 8 rows)
    (20480, 7168): (_LONG, _LONG, None, None),  # lm_head: 74.4 vs 79.9
    # a MoE layer's router + latent down + shared gate/up stacked (gpu_ops' moe_inputs), swept at a05930c
    # (h200_a05930c_skinny_gemm.md): 11.4 vs cuBLAS 12.4 at M = 1-16; cuBLAS from 64 rows (13.5 vs 14.9)
    (2208, 7168): (_DEEP, _DEEP, _DEEP, None),
}


def supported(device: torch.device | str) -> bool:
    """Whether the kernel runs on `device`: CUDA with compute capability 8.0+ (bf16 tensor cores)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def measured_choice(rows: int, n: int, k: int) -> SkinnyConfig | None:
    """The H200 table's entry for `rows` x (n, k): the kernel's config, or None (cuBLAS; also past MAX_ROWS and
    for shapes not measured)."""
    if not 1 <= rows <= MAX_ROWS or (n, k) not in H200_TABLE:
        return None
    return H200_TABLE[(n, k)][next(i for i, r in enumerate(MEASURED_ROWS) if rows <= r)]


def use_kernel(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a projection of weight [n, k] at `rows` rows runs this kernel (True) or cuBLAS (False): only on a
    Hopper GPU (where the table was measured; bf16 there, fp16 moves the same bytes), in a 16-bit dtype, and
    where `H200_TABLE` names a config. A CUDA-graph bucket of up to R rows asks with rows=R; `linear` asks with
    the call's rows. Deterministic and free: nothing is timed at startup."""
    if dtype not in DTYPES or not supported(device) or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return measured_choice(rows, n, k) is not None


def linear_split(x: torch.Tensor, weight: torch.Tensor, fp32_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W[:fp32_cols]^T in fp32, x W[fp32_cols:]^T in x's dtype): `skinny_linear_split` in one launch where
    `use_kernel` picks the kernel for the whole of W; else cuBLAS, the fp32 part as its own GEMM with an fp32
    output (never rounded to x's dtype first)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    if x.dtype == weight.dtype and weight.stride(-1) == 1 and use_kernel(rows, n, k, x.dtype, x.device):
        return skinny_linear_split(x, weight, fp32_cols, config=measured_choice(rows, n, k))
    return linear_fp32(x, weight[:fp32_cols]), F.linear(x, weight[fp32_cols:])


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T with an fp32 output (a router's logits): 16-bit operands on CUDA through cuBLAS with fp32
    accumulation and output (the products are exact in fp32); otherwise in fp32 arithmetic."""
    if x.dtype in DTYPES and x.is_cuda:
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.T, out_dtype=torch.float32).view(*x.shape[:-1], -1)
    return x.float() @ weight.float().T


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias): this kernel, with the measured config, where `use_kernel` picks it for
    x's rows; else cuBLAS. The rows are a host int, so a CUDA graph captured at T rows replays the path taken."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    if x.dtype == weight.dtype and weight.stride(-1) == 1 and use_kernel(rows, n, k, x.dtype, x.device):
        return skinny_linear(x, weight, config=measured_choice(rows, n, k))
    return F.linear(x, weight)


# --- the launch ----------------------------------------------------------------------------------------------


class _Workspace:
    """Partials [MAX_CTAS_PER_SM x SMs, 2, MAX_TILE] fp32 and the tiles' counters (zero between launches)."""

    def __init__(self, device: torch.device, sms: int):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_gemm: the first call on a device must run before CUDA-graph capture "
                               "(it allocates the kernel's workspace); run one eager step first")
        self.sms = sms
        self.max_ctas = MAX_CTAS_PER_SM * sms
        self.partials = torch.empty(self.max_ctas * 2 * MAX_TILE, dtype=torch.float32, device=device)
        self.counters = torch.zeros(self.max_ctas, dtype=torch.int32, device=device)


_WORKSPACES: dict[torch.device, _Workspace] = {}
INTERPRETER_SMS = 4  # the interpreter's "device": few programs, so that small test shapes share tiles


def _workspace(device: torch.device) -> _Workspace:
    if device not in _WORKSPACES:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else INTERPRETER_SMS
        _WORKSPACES[device] = _Workspace(device, sms)
    return _WORKSPACES[device]


def _interpreted() -> bool:
    return type(_skinny_kernel).__name__ == "InterpretedFunction"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, config: SkinnyConfig | None = None,
                  ctas: int | None = None, pdl: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_ROWS rows, rows of stride 1) @ weight [N, K]^T -> [..., N] in x's dtype, fp32
    accumulation. `config`: tiles and grid (default: `default_config`; `linear` passes the measured one);
    `ctas`: the number of programs (default: the config's per-SM count times the SMs); `pdl`: programmatic
    dependent launch (default: on Hopper and newer, off in the interpreter); `out`: a contiguous [..., N]
    tensor to write."""
    rows = _rows(x, weight)
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) if out is None \
        else out.view(rows.shape[0], weight.shape[0])
    _launch(rows, weight, y, y, 0, config, ctas, pdl)
    return y.view(*x.shape[:-1], weight.shape[0])


def skinny_linear_split(x: torch.Tensor, weight: torch.Tensor, fp32_cols: int, *, config: SkinnyConfig | None = None,
                        ctas: int | None = None, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_linear` whose first `fp32_cols` output columns stay in fp32: (y[..., :fp32_cols] fp32,
    y[..., fp32_cols:] in x's dtype), from one launch. For projections of one input where one needs its fp32
    accumulation (a router's logits) and the others are rounded as usual."""
    rows = _rows(x, weight)
    M, N = rows.shape[0], weight.shape[0]
    if not 0 < fp32_cols < N:
        raise ValueError(f"skinny_linear_split: fp32_cols={fp32_cols} must be in 1..{N - 1} (of {N} columns)")
    y32 = torch.empty(M, fp32_cols, dtype=torch.float32, device=x.device)
    y = torch.empty(M, N - fp32_cols, dtype=x.dtype, device=x.device)
    _launch(rows, weight, y, y32, fp32_cols, config, ctas, pdl)
    return y32.view(*x.shape[:-1], fp32_cols), y.view(*x.shape[:-1], N - fp32_cols)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x's rows [M, K] with unit column stride, after checking x and weight fit the kernel."""
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: weight must be [N, {K}] with unit column stride (x has {K} columns), "
                         f"got shape {tuple(weight.shape)} strides {weight.stride()}")
    if x.dtype != weight.dtype:
        raise ValueError(f"skinny_linear: x is {x.dtype} and weight {weight.dtype}; cast one to the other")
    rows = x.reshape(-1, K)
    if not 1 <= rows.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows, got {rows.shape[0]}: use F.linear")
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, y32: torch.Tensor, n32: int,
            config: SkinnyConfig | None, ctas: int | None, pdl: bool | None) -> None:
    """The kernel over rows [M, K] x weight [N, K]^T: columns < n32 into y32 (fp32), the rest into y."""
    (M, K), N = rows.shape, weight.shape[0]
    cfg = config or default_config(M)
    block_m = cfg.block_m(M)
    if cfg.block_n * block_m > MAX_TILE or cfg.ctas_per_sm > MAX_CTAS_PER_SM:
        raise ValueError(f"skinny_linear: {cfg} at {M} rows exceeds the workspace (block_n x block_m <= {MAX_TILE}, "
                         f"ctas_per_sm <= {MAX_CTAS_PER_SM})")
    ws = _workspace(rows.device)
    units = triton.cdiv(N, cfg.block_n) * triton.cdiv(K, cfg.block_k)
    programs = min(units, ctas or cfg.ctas_per_sm * ws.sms)
    if not 1 <= programs <= ws.max_ctas:
        raise ValueError(f"skinny_linear: ctas={ctas} must be in 1..{ws.max_ctas}")
    interpreted = _interpreted()
    pdl = (not interpreted and torch.cuda.get_device_capability(rows.device)[0] >= 9) if pdl is None else pdl
    if pdl and interpreted:
        raise ValueError("skinny_linear: pdl=True needs a GPU (the interpreter has no grid dependency control)")
    launch = {"launch_pdl": True} if pdl else {}
    _skinny_kernel[(programs,)](
        rows, weight, y, y32, ws.partials, ws.counters, M, N, n32, K, rows.stride(0), weight.stride(0), y.stride(0),
        y32.stride(0), programs, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=block_m,
        MAX_TILE=MAX_TILE, UNROLL=REDUCE_UNROLL, PDL=pdl, PREFETCH=min(cfg.stages, 4),
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", num_warps=cfg.warps, num_stages=cfg.stages,
        **launch)


# --- the kernel ----------------------------------------------------------------------------------------------


@triton.jit
def _first_unit(g, units, ctas):
    """The first unit of program g's range (ranges: floor(g * units / ctas) ... )."""
    return (g * units) // ctas


@triton.jit
def _owner(unit, units, ctas):
    """The program whose range holds `unit`: the largest g with floor(g * units / ctas) <= unit."""
    return ((unit + 1) * ctas + units - 1) // units - 1


@triton.jit
def _prefetch_l2(w_ptr, u, last, k_tiles, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Ask L2 for unit u's W tile (one request per 128-byte line); u is clamped to the range's last unit,
    rows and columns to the matrix, so that every address is valid (a prefetch has no mask)."""
    u = tl.minimum(u, last)
    tile = u // k_tiles
    kt = u - tile * k_tiles
    rn = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    LINE: tl.constexpr = 64  # 16-bit elements per 128-byte line
    rk = tl.minimum(kt * BLOCK_K + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
    ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, y32_ptr, partials_ptr, counters_ptr, M, N, N32, K, stride_xm, stride_wn,
                   stride_ym, stride_y32m, ctas,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   MAX_TILE: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Program g: units [first(g), first(g + 1)) of the N-tile-major (tile, k tile) order (module doc)."""
    g = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    units = tl.cdiv(N, BLOCK_N) * k_tiles
    start = _first_unit(g, units, ctas)
    end = _first_unit(g + 1, units, ctas)
    if PDL:
        for i in tl.static_range(PREFETCH):
            _prefetch_l2(w_ptr, start + i, end - 1, k_tiles, N, K, stride_wn, BLOCK_N, BLOCK_K)
        pdl.wait_for_inputs(PDL)  # x and every buffer this kernel writes are ready past here
    rm = tl.arange(0, BLOCK_M)
    bn = tl.arange(0, BLOCK_N)
    bk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    tile_offsets = bn[:, None] * BLOCK_M + rm[None, :]  # a partial [BLOCK_N, BLOCK_M] in its slot
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for u in range(start, end):
        tile = u // k_tiles
        kt = u - tile * k_tiles
        rn = tile * BLOCK_N + bn
        rk = kt * BLOCK_K + bk
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        k_ok = rk < K  # constant over 16 columns (Triton knows K % 16 == 0 where it is): 16-byte loads stay
        w = tl.load(w_ptrs, mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(xt), acc, input_precision=PRECISION)
        if (kt == k_tiles - 1) | (u == end - 1):  # the end of this program's part of the tile
            tile_first = tile * k_tiles
            if (start <= tile_first) & (kt == k_tiles - 1):  # the whole tile is this program's
                _store_y(acc, y_ptr, y32_ptr, rn, rm, M, N, N32, stride_ym, stride_y32m)
            else:  # slot 0: the tile this program's range starts in; slot 1: the one it ends in (if another)
                side = (start < tile_first).to(tl.int32)
                tl.store(partials_ptr + (g * 2 + side) * MAX_TILE + tile_offsets, acc)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The semaphores come after the loop, outside the software pipeline (atomics inside it stop the pipelining).
    # At most two of this program's tiles are shared: the first and the last of its range.
    first_tile = start // k_tiles
    last_tile = (end - 1) // k_tiles
    first_shared = (start > first_tile * k_tiles) | (end < (first_tile + 1) * k_tiles)
    last_shared = (last_tile != first_tile) & (end < (last_tile + 1) * k_tiles)
    if first_shared | last_shared:
        tl.debug_barrier()  # every thread's partials are written before a counter says so
        if first_shared:
            _finish_tile(first_tile, y_ptr, y32_ptr, partials_ptr, counters_ptr, M, N, N32, stride_ym, stride_y32m,
                         units, ctas, k_tiles, BLOCK_N, BLOCK_M, MAX_TILE, UNROLL)
        if last_shared:
            _finish_tile(last_tile, y_ptr, y32_ptr, partials_ptr, counters_ptr, M, N, N32, stride_ym, stride_y32m,
                         units, ctas, k_tiles, BLOCK_N, BLOCK_M, MAX_TILE, UNROLL)


@triton.jit
def _store_y(acc, y_ptr, y32_ptr, rn, rm, M, N, N32, stride_ym, stride_y32m):
    """A [BLOCK_N, BLOCK_M] tile of y^T: output columns below N32 in fp32 to y32, the others rounded to y's dtype
    (columns N32.. of the product are y's columns 0..)."""
    m_ok = (rm < M)[None, :]
    tl.store(y32_ptr + rm[None, :] * stride_y32m + rn[:, None], acc, mask=(rn < N32)[:, None] & m_ok)
    tl.store(y_ptr + rm[None, :] * stride_ym + (rn - N32)[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=((rn >= N32) & (rn < N))[:, None] & m_ok)


@triton.jit
def _finish_tile(tile, y_ptr, y32_ptr, partials_ptr, counters_ptr, M, N, N32, stride_ym, stride_y32m, units, ctas,
                 k_tiles,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MAX_TILE: tl.constexpr, UNROLL: tl.constexpr):
    """Count this program's partial of a shared tile in; the tile's last program adds the partials in program
    order, stores y and zeroes the counter (indexed by the tile's first program) for the next launch."""
    tile_first = tile * k_tiles
    g_lo = _owner(tile_first, units, ctas)
    g_hi = _owner(tile_first + k_tiles - 1, units, ctas)
    arrived = tl.atomic_add(counters_ptr + g_lo, 1, sem="acq_rel", scope="gpu")
    if arrived == g_hi - g_lo:
        rm = tl.arange(0, BLOCK_M)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tile_offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]
        lo_side = (_first_unit(g_lo, units, ctas) < tile_first).to(tl.int32)
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for base in range(g_lo, g_hi + 1, UNROLL):
            for j in tl.static_range(UNROLL):  # independent loads: one round trip per UNROLL partials
                p = base + j
                slot = p * 2 + tl.where(p == g_lo, lo_side, 0)
                live = tile_offsets < tl.where(p <= g_hi, MAX_TILE, 0)  # p is one of the tile's programs
                total += tl.load(partials_ptr + slot * MAX_TILE + tile_offsets, mask=live, other=0.0,
                                 cache_modifier=".cg")
        _store_y(total, y_ptr, y32_ptr, rn, rm, M, N, N32, stride_ym, stride_y32m)
        tl.store(counters_ptr + g_lo, 0)  # zero again for the next launch
