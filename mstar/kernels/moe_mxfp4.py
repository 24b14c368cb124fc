"""K3's routed experts on the GPU: a W4A16 (MXFP4 weights, bf16 activations) grouped-GEMM pipeline.

Given the latent activations z [T, H] (bf16; H = the latent width), the router's expert ids [T, k]
and combine weights [T, k] (fp32), `moe_mxfp4` computes, in fp32,

    r[t] = sum_j w[t, j] * W2_e SiTU(W1_e z[t], W3_e z[t]),   e = ids[t, j],

the routed part of `LatentMoE` (models/kimi_k3/moe.py); the norm and the up-projection stay outside.
An id of -1 (`DROPPED`) marks a pair to skip: under expert parallelism, a token's expert that another
rank holds (the stacked weights hold only this rank's experts, ids mapped to local ones); it adds nothing.
`moe_mxfp4_reference` is the same function in torch on `dequantize_mxfp4`: the kernel must equal it.

Weights (`stack_experts`) are the checkpoint's compressed-tensors MXFP4 tensors stacked over experts, the
codes of each 32-bit word re-placed once for cheap decoding (quant/mxfp4_words.py, "word layout"):

    w13_packed u8 [E, 2I, H/2] + w13_scale u8 [E, 2I, H/32]   rows 0..I-1 = w1 (gate), I..2I-1 = w3 (up)
    w2_packed  u8 [E, H, I/2]  + w2_scale  u8 [E, H, I/32]

w1 then w3, not interleaved, keeps each checkpoint tensor's rows as they are; the gate/up kernel
interleaves them as it loads a tile (gate row n at tile row 2n, up row n at 2n + 1), so that one dot
yields both and SiTU is applied in registers. H and I must be multiples of 128 (the scales are read
as int32 words of 4 groups; K3 at TP8: H = 3584, I = 384).

Pipeline: 4 launches (5 with combine="reduce"; 2 or 3 without alignment, below), no host sync, so the step is CUDA-graph
capturable; every buffer's size depends only on T, k, E and the config (`MoEWorkspace`):

1. The alignment (`_count_kernel`, `_place_kernel`): sorts the T*k (token, slot) pairs by expert, stably,
   each expert's run padded to whole blocks of BLOCK_M rows: `sorted_pair` (pair index per row) and, per row
   block, its expert (`block_expert`, -1 past the end) and number of real rows (`block_rows`). The pairs are
   cut into chunks: the first launch counts each chunk's pairs per expert, the second sorts each chunk in
   registers and places it (no atomics). Where the gate/up GEMM is in K order ("Dequantization" below),
   programs of their own in the first launch put z in that order and zero the output (`_order_block`);
   without alignment (below) that work is a launch alone (`_order_kernel`), and with neither the pipeline is
   2 launches.
2. `_gate_up_kernel`: one program per (row block, BLOCK_N columns of I). It dequantizes E2M1 + E8M0
   in registers (each weight is read from HBM once and never written back as bf16), accumulates in
   fp32 on the tensor cores, applies SiTU and writes bf16 h [T*k, I] (indexed by pair).
3. `_down_kernel`: one program per (row block, BLOCK_N columns of H), same dequantization; then
   - combine="atomic": scales by the combine weight and atomically adds into the fp32 output (zeroed
     by the gate/up launch). No extra launch and no [T*k, H] round trip: what decode wants. The order
     of the k additions per output is not fixed, so the last bits can differ from run to run.
   - combine="reduce": stores each expert's output in bf16 (as the bf16 model's expert MLP returns
     it) and `_combine_kernel` adds the k rows of a token in a fixed order in fp32: deterministic,
     and cheaper than T*k*H atomics at large T.

moe_bf16 (large steps, bf16 grouped GEMMs) shares the first and last launch: `sort_by_expert` is the
alignment without padding or blocks, writing each expert's end row and each pair's row instead, and
`combine_expert_rows` is the combine reading each pair's row through that map.

Configs come from a table by T and expected rows per expert (`default_config`), picked on the host
by T (no autotuning inside a CUDA graph); benchmarks/kernels/bench_moe_mxfp4.py --tune searches
around it.

Small batches (decode) matter most: at one token the floor is reading 16 experts (35 MB per TP8 rank
of pruned75) once, and the alignment alone took 11 us of 55 on the H200. Up to
DIRECT_MAX_PAIRS pairs `default_config` skips it (MoEConfig.align=False): both GEMM launches run one
program per (pair p, N tile, K part); p's program takes p's expert unless p is dropped or an earlier
pair chose the same expert (then it exits at once), and its rows are all T tokens (BLOCK_M >= T, the
token's row real if it chose the expert; its h row is its first such pair; the down kernel sums the
combine weights of all such pairs). Each program finds this in the T*k ids itself (one [BLOCK_M, k]
load from L2). So each touched expert is read and decoded once however many tokens share it: at T=8,
128 pairs over ~95 distinct experts, 208 MB rather than the 281 MB of a program per pair. The rows
stay a tensor-core dot although at T=1 one of the 16 is real: its multiply-adds cost ~0.03
instructions per weight (a 64x16x16 wgmma per 1024 weights and warp), where a CUDA-core GEMV would add
a bf16->fp32 unpack and an FFMA per weight to the ~2.5 of decoding (the whole main loop of the dot is
~3.4 per weight compiled for sm_90, benchmarks/kernels/sass_moe_mxfp4.py; instruction issue and latency,
not HBM, are what bound these loops).

Split K (GemmTile.split_k): at T=1 the gate/up GEMM has 16 experts x 2I = 12,288 rows, 192 tiles of
64 rows for 132 SMs: too few programs to hide the load and wgmma latencies of a 14-step K loop.
Splitting K gives each tile split_k programs (tiles of 32 rows, 384 programs, do as well unsplit and
are the default; split K stays among the tuned candidates). The down GEMM's parts add into the fp32 output like its
k experts do (combine="atomic"); the gate/up parts add into `split_sum` (fp32, atomically) and the
part that completes a tile (a counter per tile, `split_count`) reads the sum, applies SiTU as usual,
and leaves sum and counter zero, so that a workspace needs zeroing only when allocated.

Short K (GemmTile.tiles, the down GEMM): K = I is 384 at a TP8 rank, three steps of 128, so a program
that computes one output tile issues all its loads at once and then waits out their latency with
nothing to overlap; at decode sizes the launch is thousands of such programs, wave after wave. With
tiles > 1 a program computes that many output tiles of its row block one after another in one loop of
tiles x (K steps), which Triton software-pipelines across the tile boundaries: the next tile's weights
are in flight while this one's are decoded, and each tile's epilogue (the atomic adds) runs inside the
loop when its last K step is done.

Dequantization: an E2M1 code s|e1 e0|m put at bf16 bits 15 and 8..6 is the bf16 number
value * 2^-126 exactly (0 and 0.5, the codes with e = 0, become bf16 subnormals, which PTX's bf16
arithmetic keeps), so one bf16 multiply by 2^(scale - 1) gives value * 2^(scale - 127), exactly;
2^(scale - 1) is a finite bf16 only for scale bytes <= 128 (|w| <= 12), which `stack_experts` checks.
decode="select" builds only normal bf16 numbers and takes every scale byte, for a few more integer
operations per weight. `_dequant_words` decodes a 32-bit word (8 codes, in the word layout) into 4 pairs of
columns (2i, 2i + 1), each built as the two halves of one int32 (one mask, and for three of them one shift
more) and scaled by one packed bf16x2 FMA (inline PTX; Triton's own bf16 multiplies are scalar) whose factor
pair one byte permute makes of the scale byte. Where the weights are the A operand of a wgmma from registers
(swap_ab, 64 rows or more: every decode-size tile), the K columns of both operands are reordered (`_k_order`)
so that each thread's share of the A fragment is a contiguous run of packed words and each of its bf16 pairs
one decoded pair: 16-byte shared-memory reads and no layout conversion of the decoded tile. Elsewhere (the
large-T tiles, whose weights are the B operand in shared memory, and narrower tiles) the words are decoded in
the natural column order. Against the checkpoint's nibbles decoded in place, the word layout and the byte
permute cut the main loops' instructions per weight by 11-28% in the sm_90 SASS of the default tiles
(benchmarks/kernels/sass_moe_mxfp4.py; results/cpu_sass_moe_word_layout.md), where ncu found gate/up bound by
instruction issue. Under Triton's CPU interpreter (numpy has no bf16 arithmetic) the same bits are scaled and
dotted in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from mstar.kernels import pdl
from mstar.quant.mxfp4 import GROUP_SIZE, dequantize_mxfp4
from mstar.quant.mxfp4_words import from_word_layout, to_word_layout

SITU_BETA = 4.0  # K3's activation_situ_beta (the gate's soft clip)
SITU_LINEAR_BETA = 25.0  # K3's activation_situ_linear_beta (the up branch's soft clip)
MAX_SUBNORMAL_DECODE_SCALE = 128  # largest E8M0 byte b for which 2^(b - 1) is a finite bf16
SCALE_WORD = 4 * GROUP_SIZE  # weight columns covered by one int32 word of scales
HBM_BYTES_PER_S = 4.26e12  # measured copy bandwidth of the H200 (DESIGN.md); for floors
DROPPED = -1  # expert id of a pair the call skips (an expert this rank does not hold)
DIRECT_MAX_PAIRS = 128  # default_config skips the alignment up to this many pairs (T <= 8 at top-16)
DIRECT_ONE_TILE_MAX_PAIRS = 16  # ... and gives each down program one output tile up to this many (T = 1)


# ----------------------------------------------------------------------------------------------
# Stacked weights
# ----------------------------------------------------------------------------------------------


class StackedExperts(NamedTuple):
    """One layer's routed experts, stacked; pass as `*stacked` to `moe_mxfp4` and the reference. The packed
    codes are in the word layout (quant/mxfp4_words.py), the scales as the checkpoint has them."""

    w13_packed: torch.Tensor  # u8 [E, 2I, H/2]: w1 (gate) rows, then w3 (up) rows
    w13_scale: torch.Tensor  # u8 [E, 2I, H/32]
    w2_packed: torch.Tensor  # u8 [E, H, I/2]
    w2_scale: torch.Tensor  # u8 [E, H, I/32]


def stack_experts(
    w1: Sequence[tuple[torch.Tensor, torch.Tensor]],
    w3: Sequence[tuple[torch.Tensor, torch.Tensor]],
    w2: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    check_scales: bool = True,
) -> StackedExperts:
    """Stack per-expert (weight_packed, weight_scale) pairs of w1, w3 and w2 (as the checkpoint packs them) into
    `StackedExperts`, the codes re-placed into the word layout.

    With check_scales, raises if a scale byte exceeds MAX_SUBNORMAL_DECODE_SCALE, which the default
    decode cannot represent (run with MoEConfig(decode="select") instead). The check syncs with the
    device: it belongs at load time.
    """
    if not (len(w1) == len(w3) == len(w2)) or not w1:
        raise ValueError(f"stack_experts: need the same non-zero number of experts, got w1 {len(w1)}, "
                         f"w3 {len(w3)}, w2 {len(w2)}")
    for name, pairs in (("w1", w1), ("w3", w3), ("w2", w2)):
        kinds = {(tuple(p.shape), tuple(s.shape), p.dtype, s.dtype, p.device) for p, s in pairs}
        if len(kinds) != 1:
            raise ValueError(f"stack_experts: the {name} tensors differ across experts: {sorted(map(str, kinds))}")
    stacked = StackedExperts(
        w13_packed=to_word_layout(torch.stack([torch.cat((a[0], b[0])) for a, b in zip(w1, w3, strict=True)])),
        w13_scale=torch.stack([torch.cat((a[1], b[1])) for a, b in zip(w1, w3, strict=True)]),
        w2_packed=to_word_layout(torch.stack([p for p, _ in w2])),
        w2_scale=torch.stack([s for _, s in w2]),
    )
    check_weights(*stacked)
    if check_scales:
        for name in ("w13_scale", "w2_scale"):
            top = int(getattr(stacked, name).max())
            if top > MAX_SUBNORMAL_DECODE_SCALE:
                raise ValueError(f"stack_experts: {name} holds scale byte {top} > {MAX_SUBNORMAL_DECODE_SCALE}; "
                                 "use MoEConfig(decode='select') and stack with check_scales=False")
    return stacked


def stack_experts_from_state(tensors: Mapping[str, torch.Tensor], prefix: str, num_experts: int,
                             **kwargs) -> StackedExperts:
    """`stack_experts` from checkpoint names `{prefix}.{e}.w1.weight_packed` etc. (prefix ends in `experts`)."""

    def pairs(w: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for e in range(num_experts):
            names = (f"{prefix}.{e}.{w}.weight_packed", f"{prefix}.{e}.{w}.weight_scale")
            missing = [n for n in names if n not in tensors]
            if missing:
                raise KeyError(f"stack_experts_from_state: missing {missing}")
            out.append((tensors[names[0]], tensors[names[1]]))
        return out

    return stack_experts(pairs("w1"), pairs("w3"), pairs("w2"), **kwargs)


def check_weights(w13_packed, w13_scale, w2_packed, w2_scale) -> tuple[int, int, int]:
    """(E, H, I) of consistent stacked weights, or a ValueError naming the tensor at fault."""
    named = {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale}
    for name, t in named.items():
        if t.dtype != torch.uint8 or t.ndim != 3 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 3-D uint8 tensor (see stack_experts), got "
                             f"{t.dtype} {tuple(t.shape)}")
    e, two_i, half_h = w13_packed.shape
    h, i = 2 * half_h, two_i // 2
    if two_i % 2 or h % SCALE_WORD or i % SCALE_WORD:
        raise ValueError(f"w13_packed {tuple(w13_packed.shape)}: need 2I rows and H, I multiples of {SCALE_WORD} "
                         f"(got H={h}, 2I={two_i})")
    expected = {"w13_scale": (e, two_i, h // GROUP_SIZE), "w2_packed": (e, h, i // 2),
                "w2_scale": (e, h, i // GROUP_SIZE)}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(named[name].shape)}, expected {shape} for "
                             f"w13_packed {tuple(w13_packed.shape)} (E={e}, H={h}, I={i})")
    return e, h, i


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def situ_reference(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """K3's SiTU, [beta tanh(a / beta) sigmoid(a)] [linear_beta tanh(b / linear_beta)], in `gate`'s dtype.

    The kernels' own copy of models/kimi_k3/mlp.situ (kernels import no model code; a test holds the two
    equal): the arithmetic runs in fp32 at least (fp64 stays fp64), rounded once at the end.
    """
    a, b = (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x for x in (gate, up))
    out = beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))
    return out.to(gate.dtype)


def moe_mxfp4_reference(
    z: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float = SITU_LINEAR_BETA,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """sum_j w[t, j] * W2_e SiTU(W1_e z[t], W3_e z[t]), [T, H] in `dtype`, as `LatentMoE.routed` computes it (the
    weights as `stack_experts` leaves them: codes in the word layout)."""
    _, _, inter = check_weights(w13_packed, w13_scale, w2_packed, w2_scale)
    x_all = z.to(dtype)
    out = torch.zeros(z.shape, dtype=dtype, device=z.device)
    for e in expert_ids.unique().tolist():
        if e == DROPPED:
            continue
        rows, slot = (expert_ids == e).nonzero(as_tuple=True)
        w13 = dequantize_mxfp4(from_word_layout(w13_packed[e]), w13_scale[e], dtype)
        w2 = dequantize_mxfp4(from_word_layout(w2_packed[e]), w2_scale[e], dtype)
        x = x_all[rows]
        h = situ_reference(x @ w13[:inter].T, x @ w13[inter:].T, situ_beta, situ_linear_beta)
        out.index_add_(0, rows, (h @ w2.T) * expert_weights[rows, slot].to(dtype).unsqueeze(-1))
    return out


# ----------------------------------------------------------------------------------------------
# Configuration, buffers, floor
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # output columns per program
    block_k: int  # reduction columns per step, a multiple of SCALE_WORD
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs sharing one output tile, each over K / split_k (module doc, "Split K")
    tiles: int = 1  # output tiles one program computes one after another (down only; module doc, "Short K")


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # rows per program: pairs of one expert (align), or all T tokens (align=False: >= T)
    gate_up: GemmTile
    down: GemmTile
    combine: str = "atomic"  # "atomic" or "reduce" (deterministic; needs align)
    decode: str = "subnormal"  # "subnormal" (fewer operations; scale bytes <= 128) or "select"
    swap_ab: bool = True  # weights as the dot's A operand (see _mxfp4_matmul); for small BLOCK_M
    align: bool = True  # sort pairs by expert first; False: the decode path (module doc, "Small batches")


def default_config(num_tokens: int, top_k: int, num_experts: int, *, align: bool | None = None) -> MoEConfig:
    """Tiles by expected rows per expert, T*k/E (the table benchmarks/kernels/bench_moe_mxfp4.py tunes).

    align=None skips the alignment up to DIRECT_MAX_PAIRS pairs (module doc, "Small batches"); True or
    False forces the choice (benchmarks and tests compare the two). Without alignment every program's
    rows are the T tokens, so BLOCK_M = T rounded up to a tensor-core tile.

    Measured on the H200 at 209d3ea (benchmarks/kernels/results/h200_209d3ea_moe_mxfp4_decode.md), with the
    weights decoded a word at a time: gate/up tiles of 128 rows (BLOCK_N 64, BLOCK_K 128) beat 64-row tiles
    of BLOCK_K 256 at T = 1 (split in two: 38.3 -> 33.0 us), 8 (148.9 -> 141.4) and 64 (332 -> 311); down
    tiles of 128 rows beat 64-row ones by 1.3-1.5x at T = 1, 8 and 64; the aligned pipeline (BLOCK_M 16) beat
    the direct one with compacted rows (209d3ea) from T = 8 on (136 vs 155 us at 8, 267 vs 332 at 64). With
    its rows all T tokens again (1964b5d, h200_1964b5d_moe_mxfp4_decode.md) the direct path wins up to T = 8
    (123 vs 131 us at 8; 168 vs 166 at 16). So BLOCK_M 16 up to 12 expected rows per expert (T = 168 here), then taller
    blocks so that each expert's weights are dequantized once per BLOCK_M rows, and from BLOCK_M = 64 the
    activations are the A operand again (the weights then go through shared memory as the B operand).
    Above 48 rows per expert, from --tune on the H200 (h200_bef60d1_moe_mxfp4_tune.md), where the atomic
    combine also beat "reduce" (which stays available: deterministic).

    Down tiles since 8521d1b (several output tiles a program, module doc "Short K"), from the --tune sweep at
    0dfb529 (benchmarks/kernels/results/h200_0dfb529_moe_mxfp4_tiles.md): 4 tiles a program beat 1 at every T
    from 8 to 1024, and 2 at T = 1. Since the K-ordered activations (0937c2d) the --tune sweep at a05930c
    (h200_a05930c_moe_mxfp4_tune.md) moved these: gate/up tiles of 32 rows and BLOCK_K 256 won at every T
    up to 256 (T = 1: 28.1 us against 35.8 with the split 64-row tiles; 8: 101.2 against 105.0; 64: 200.4
    against 223.8), the direct down launch wants 1 tile a program at T = 1 and 2 at T = 8, and at up to 12
    rows per expert 1 and 4 tiles are within 1% of each other.
    """
    pairs = num_tokens * top_k
    if align is None:
        align = pairs > DIRECT_MAX_PAIRS
    narrow = GemmTile(32, 256)  # gate/up at decode sizes: 384 programs at one token
    if not align:
        down = GemmTile(128, 128, tiles=1 if pairs <= DIRECT_ONE_TILE_MAX_PAIRS else 2)
        return MoEConfig(max(16, triton.next_power_of_2(num_tokens)), narrow, down, align=False)
    rows = pairs / max(num_experts, 1)
    down = GemmTile(128, 128, tiles=4)
    if rows <= 12:
        return MoEConfig(16, narrow, down)
    if rows <= 24:
        return MoEConfig(32, narrow, down)
    if rows <= 48:
        return MoEConfig(64, GemmTile(64, 128), down, swap_ab=False)
    # Tuned on the H200 (--tune at 1024 and 4096 tokens, benchmarks/kernels/results/h200_bef60d1_moe_mxfp4_tune.md):
    # 64-row blocks and 4-warp tiles beat the earlier guess of 128 rows at 8 warps, and the atomic combine beat
    # "reduce" by 3-4%: 969 -> 871 us at 1024 tokens, 2875 -> 2391 at 4096 (and 5226 -> 4782 at 8192, untuned).
    return MoEConfig(64, GemmTile(64, 128), down, "atomic", swap_ab=False)


def _fit(block: int, dim: int, smallest: int, what: str) -> int:
    """The largest power of two <= block that divides dim, at least `smallest`."""
    b = 1 << (max(block, 1).bit_length() - 1)
    while b > smallest and dim % b:
        b //= 2
    if b < smallest or dim % b:
        raise ValueError(f"{what}: no power-of-two tile >= {smallest} divides {dim}")
    return b


def fit_config(config: MoEConfig, hidden: int, inter: int) -> MoEConfig:
    """`config` with its tiles shrunk to divide the GEMMs (gate/up: N = I, K = H; down: N = H, K = I)."""
    if config.combine not in ("atomic", "reduce"):
        raise ValueError(f"MoEConfig.combine must be 'atomic' or 'reduce', got {config.combine!r}")
    if config.decode not in ("subnormal", "select"):
        raise ValueError(f"MoEConfig.decode must be 'subnormal' or 'select', got {config.decode!r}")
    if config.block_m < 16 or config.block_m & (config.block_m - 1):
        raise ValueError(f"MoEConfig.block_m must be a power of two >= 16, got {config.block_m}")
    if config.gate_up.tiles != 1:
        raise ValueError(f"GemmTile.tiles is for the down GEMM; the gate/up tile has tiles={config.gate_up.tiles}")
    if not config.align and config.combine != "atomic":
        raise ValueError("MoEConfig(align=False) adds into the output atomically: combine must be 'atomic'")
    if config.down.split_k > 1 and config.combine != "atomic":
        raise ValueError("a split down GEMM adds its parts into the output atomically: combine must be 'atomic'")
    return replace(config, gate_up=_fit_tile(config.gate_up, inter, hidden, "gate/up"),
                   down=_fit_tile(config.down, hidden, inter, "down"))


def _fit_tile(tile: GemmTile, n: int, k: int, what: str) -> GemmTile:
    """`tile` shrunk to an N x K GEMM: split_k to the largest count that cuts K into whole scale words
    (K = 128 is not split), then the blocks, then tiles to the largest count that divides the N tiles."""
    if tile.split_k < 1:
        raise ValueError(f"{what} split_k must be >= 1, got {tile.split_k}")
    split = next(s for s in range(tile.split_k, 0, -1) if k % (s * SCALE_WORD) == 0)
    if tile.tiles < 1:
        raise ValueError(f"{what} tiles must be >= 1, got {tile.tiles}")
    block_n = _fit(tile.block_n, n, 16, f"{what} block_n")
    tiles = next(t for t in range(min(tile.tiles, n // block_n), 0, -1) if (n // block_n) % t == 0)
    return replace(tile, block_n=block_n, block_k=_fit(tile.block_k, k // split, SCALE_WORD, f"{what} block_k"),
                   split_k=split, tiles=tiles)


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most row blocks any routing of num_pairs pairs can fill.

    Expert e needs ceil(c_e / BM) blocks, so n used experts need at most (P + n (BM - 1)) / BM (the
    worst-case padded rows P + E (BM - 1) when n = E); and never more than P blocks, since every block
    holds at least one pair.
    """
    used = min(num_experts, num_pairs)
    return min(num_pairs, (num_pairs + used * (block_m - 1)) // block_m)


def _row_blocks(num_pairs: int, num_experts: int, config: MoEConfig) -> int:
    """Row blocks the alignment describes; none without alignment."""
    return max_row_blocks(num_pairs, num_experts, config.block_m) if config.align else 0


def _split_tiles(num_pairs: int, num_experts: int, inter: int, config: MoEConfig) -> int:
    """Output tiles of the gate/up launch (programs along its first axis x N tiles): one counter each."""
    programs = _row_blocks(num_pairs, num_experts, config) if config.align else num_pairs
    return programs * (inter // config.gate_up.block_n)


@dataclass
class MoEWorkspace:
    """Buffers of one call; allocate once per (T, config) and reuse them across CUDA-graph replays."""

    block_m: int
    # The alignment's output (empty with align=False):
    sorted_pair: torch.Tensor  # int32 [blocks * BM]: pair index (t * k + j) of each sorted row
    block_expert: torch.Tensor  # int32 [blocks]: expert of each row block, -1 past the end
    block_rows: torch.Tensor  # int32 [blocks]: real rows in each row block
    hidden_act: torch.Tensor  # bf16 [T * k, I]: SiTU(gate, up) per pair (in the down GEMM's K order if it decodes)
    z_ordered: torch.Tensor | None  # bf16 [T, H]: z in the gate/up GEMM's K order (when it decodes into it)
    expert_out: torch.Tensor | None  # bf16 [T * k, H]: per-pair expert output (combine="reduce" only)
    # Split gate/up only: zero at allocation, and each gate/up launch leaves them zero.
    split_sum: torch.Tensor | None  # fp32 [T * k, 2I]: the parts of gate/up added up, gate/up interleaved
    split_count: torch.Tensor | None  # int32 [programs * N tiles]: parts of each output tile done

    @classmethod
    def allocate(cls, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                 config: MoEConfig, device: torch.device | str) -> MoEWorkspace:
        pairs = num_tokens * top_k
        blocks = _row_blocks(pairs, num_experts, config)
        i32 = {"dtype": torch.int32, "device": device}
        bf16 = {"dtype": torch.bfloat16, "device": device}
        split_sum = split_count = None
        if config.gate_up.split_k > 1:
            # One zeroed allocation (one memset when allocated inside a CUDA graph); zero bits are 0.0.
            zeros = torch.zeros(pairs * 2 * inter + _split_tiles(pairs, num_experts, inter, config), **i32)
            split_sum = zeros[: pairs * 2 * inter].view(torch.float32).view(pairs, 2 * inter)
            split_count = zeros[pairs * 2 * inter:]
        return cls(
            block_m=config.block_m,
            sorted_pair=torch.empty(blocks * config.block_m, **i32),
            block_expert=torch.empty(blocks, **i32),
            block_rows=torch.empty(blocks, **i32),
            hidden_act=torch.empty(pairs, inter, **bf16),
            z_ordered=torch.empty(num_tokens, hidden, **bf16) if _k_ordered(config, "gate_up") else None,
            expert_out=torch.empty(pairs, hidden, **bf16) if config.combine == "reduce" else None,
            split_sum=split_sum,
            split_count=split_count,
        )

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def expert_bytes(hidden: int, inter: int) -> int:
    """HBM bytes of one expert: half a byte per weight plus a scale byte per 32 weights, for w1, w3, w2.

    One TP8 rank of pruned75 (H = 3584, I = 384): 3 * 3584 * 384 = 4,128,768 weights ->
    2,064,384 packed + 129,024 scale bytes = 2,193,408 bytes; 16 experts: 35.1 MB, 8.2 us at 4.26 TB/s.
    """
    weights = 3 * hidden * inter
    return weights // 2 + weights // GROUP_SIZE


def bytes_floor(num_tokens: int, top_k: int, distinct_experts: int, hidden: int, inter: int) -> int:
    """Fewest HBM bytes of one step: each touched expert once, z in (bf16), ids (int64) and weights
    (fp32) in, the fp32 output out."""
    activations = num_tokens * hidden * 2 + num_tokens * top_k * (8 + 4) + num_tokens * hidden * 4
    return distinct_experts * expert_bytes(hidden, inter) + activations


def supported(device: torch.device | str) -> bool:
    """Whether this Triton kernel runs on `device`: CUDA with compute capability 8.0+ (bf16 tensor cores)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def moe_mxfp4(
    z: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    config: MoEConfig | None = None,
    out: torch.Tensor | None = None,
    workspace: MoEWorkspace | None = None,
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """The routed experts' combined output, fp32 [T, H] (written into `out` if given); see the module doc.

    z: bf16 [T, H] with unit column stride; expert_ids: int32/int64 [T, k], values in [0, E) or DROPPED;
    expert_weights: fp32 [T, k]. CUDA-graph capturable once compiled: call it once before capturing.
    """
    num_experts, hidden, inter = check_weights(w13_packed, w13_scale, w2_packed, w2_scale)
    num_tokens, top_k = _check_activations(z, expert_ids, expert_weights, hidden, w13_packed.device)
    config = fit_config(config or default_config(num_tokens, top_k, num_experts), hidden, inter)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=z.device)
    elif out.shape != (num_tokens, hidden) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{num_tokens}, {hidden}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if num_tokens == 0:
        return out
    if not config.align and config.block_m < num_tokens:
        raise ValueError(f"MoEConfig(align=False) needs block_m >= T (one program's rows are all tokens), got "
                         f"block_m {config.block_m} for T={num_tokens}")
    if workspace is None:
        workspace = MoEWorkspace.allocate(num_tokens, top_k, num_experts, hidden, inter, config, z.device)
    _check_workspace(workspace, num_tokens * top_k, num_experts, hidden, inter, config)
    ids, weights = expert_ids.contiguous(), expert_weights.contiguous()

    _launch_prologue(z, ids, num_experts, out, config, workspace)
    _launch_gate_up(z, ids, w13_packed, w13_scale, out, config, workspace, situ_beta, situ_linear_beta)
    _launch_down(ids, w2_packed, w2_scale, weights, out, config, workspace)
    if config.combine == "reduce":
        combine_expert_rows(workspace.expert_out, ids, weights, out)
    return out


def _check_activations(z, expert_ids, expert_weights, hidden, device) -> tuple[int, int]:
    if z.dtype != torch.bfloat16 or z.ndim != 2 or z.shape[1] != hidden or z.stride(1) != 1:
        raise ValueError(f"z must be bf16 [T, {hidden}] with unit column stride, got {z.dtype} {tuple(z.shape)} "
                         f"strides {z.stride()}")
    if expert_ids.dtype not in (torch.int32, torch.int64) or expert_ids.ndim != 2 or expert_ids.shape[0] != z.shape[0]:
        raise ValueError(f"expert_ids must be int32/int64 [T={z.shape[0]}, k], got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if expert_weights.dtype != torch.float32 or expert_weights.shape != expert_ids.shape:
        raise ValueError(f"expert_weights must be fp32 with the shape of expert_ids {tuple(expert_ids.shape)}, "
                         f"got {expert_weights.dtype} {tuple(expert_weights.shape)}")
    for name, t in (("z", z), ("expert_ids", expert_ids), ("expert_weights", expert_weights)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the weights are on {device}")
    return z.shape[0], expert_ids.shape[1]


def _check_workspace(ws: MoEWorkspace, pairs: int, num_experts: int, hidden: int, inter: int,
                     config: MoEConfig) -> None:
    problems = []
    if ws.block_m != config.block_m:
        problems.append(f"block_m {ws.block_m} != config.block_m {config.block_m}")
    blocks = _row_blocks(pairs, num_experts, config)
    if ws.num_blocks != blocks or ws.block_rows.numel() != blocks or ws.sorted_pair.numel() != blocks * ws.block_m:
        problems.append(f"{ws.num_blocks} row blocks, need {blocks}")
    if tuple(ws.hidden_act.shape) != (pairs, inter):
        problems.append(f"hidden_act {tuple(ws.hidden_act.shape)} != {(pairs, inter)}")
    if _k_ordered(config, "gate_up") and (ws.z_ordered is None or ws.z_ordered.shape[1] != hidden):
        problems.append(f"a gate/up GEMM in K order needs z_ordered of {hidden} columns")
    if config.combine == "reduce" and (ws.expert_out is None or tuple(ws.expert_out.shape) != (pairs, hidden)):
        problems.append(f"combine='reduce' needs expert_out of shape {(pairs, hidden)}")
    if config.gate_up.split_k > 1:
        tiles = _split_tiles(pairs, num_experts, inter, config)
        if ws.split_sum is None or tuple(ws.split_sum.shape) != (pairs, 2 * inter):
            problems.append(f"a split gate/up needs split_sum of shape {(pairs, 2 * inter)}")
        if ws.split_count is None or ws.split_count.numel() != tiles:
            problems.append(f"a split gate/up needs split_count of {tiles} counters")
    if problems:
        raise ValueError("workspace does not fit this call (MoEWorkspace.allocate one for it): " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_ALIGN_CHUNK = 1024  # pairs an alignment program counts and places
_ALIGN_TABLE = 256  # block-table entries a program of the alignment's second launch writes
_ALIGN_COUNT_TILE = 4096  # counts a program of the second launch reads per step
_ZERO_BLOCK = 1024  # fp32 output elements a gate/up program zeroes per step
_COMBINE_BLOCK = 512  # output columns per combine program


def _interpreted() -> bool:
    """True when Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 when this module loaded)."""
    return type(_count_kernel).__name__ == "InterpretedFunction"


def _compute_dtype():
    # numpy has no bf16 arithmetic, so under the interpreter the (exact) bf16 weights and activations
    # are multiplied and dotted in fp32; on the GPU both run in bf16 with fp32 accumulation.
    return tl.float32 if _interpreted() else tl.bfloat16


def sort_by_expert(ids: torch.Tensor, num_experts: int, sorted_pair: torch.Tensor, expert_end: torch.Tensor,
                   pair_row: torch.Tensor) -> None:
    """The alignment without padding or block table, for grouped GEMMs that take each expert's end row
    (moe_bf16's torch._grouped_mm): one launch, no host sync.

    ids [T, k] -> sorted_pair int32 [T*k] (rows expert_end[e-1]..expert_end[e]-1 hold expert e's pairs in
    pair order; rows from expert_end[E-1] on, left by DROPPED pairs, are not written), expert_end int32 [E],
    pair_row int32 [T*k] (each pair's row; not written for DROPPED pairs).
    """
    _align(ids, num_experts, sorted_pair, 1, groups=(expert_end, pair_row))


def _align(ids: torch.Tensor, num_experts: int, sorted_pair: torch.Tensor, block_m: int,
           blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
           groups: tuple[torch.Tensor, torch.Tensor] | None = None, order: tuple | None = None) -> None:
    """The alignment in two launches (`_count_kernel`, `_place_kernel`), writing the block table (blocks:
    block_expert, block_rows) and/or the group ends (groups: expert_end, pair_row). An output not asked for is
    not written: any tensor stands in for it. `order` (`_order_work`): the first launch also does the K-order
    work, in programs past the chunks'.

    Both launches spread the pairs over programs a chunk each: the work of a program does not grow with T.
    (The design before, one program per expert counting and placing all pairs itself, took 33.6 / 323 us at
    1,024 / 8,192 tokens on the H200: O(T k) serial steps per program.)"""
    pairs = ids.numel()
    block_expert, block_rows = blocks or (sorted_pair, sorted_pair)
    expert_end, pair_row = groups or (sorted_pair, sorted_pair)
    num_blocks = block_expert.numel() if blocks else 0
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = min(_ALIGN_CHUNK, max(64, triton.next_power_of_2(pairs)))
    chunks = triton.cdiv(pairs, chunk)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=ids.device)
    # without the order: unread stand-ins, no programs
    args, constexprs, programs = order or ((ids, ids, ids, 0, 0, 1),
                                           {"ORDER_K": 0, "ZERO_OUT": False, "ZERO_BLOCK": _ZERO_BLOCK}, 0)
    _count_kernel[(chunks + programs,)](ids, counts, pairs, *args, E_PAD=e_pad, CHUNK=chunk, **constexprs,
                                        num_warps=4, **pdl.options(_count_kernel, ids.device))
    tables = max(1, triton.cdiv(num_blocks, _ALIGN_TABLE))
    _place_kernel[(chunks + tables,)](
        ids, counts, sorted_pair, block_expert, block_rows, expert_end, pair_row, pairs, num_blocks, num_experts,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, COUNT_ROWS=max(1, _ALIGN_COUNT_TILE // e_pad),
        TABLE=_ALIGN_TABLE, GROUPS=groups is not None, num_warps=4, **pdl.options(_place_kernel, ids.device),
    )


def _k_ordered(config: MoEConfig, gemm: str) -> bool:
    """Whether the GEMM ("gate_up" or "down") decodes its weights in `_k_order`'s column order: the weights are
    the wgmma's A operand (swap_ab) and its tile has at least one wgmma's 64 rows. Its activations are then
    stored in that order too (module doc, "Dequantization")."""
    rows = 2 * config.gate_up.block_n if gemm == "gate_up" else config.down.block_n
    return config.swap_ab and rows >= _WGMMA_M.value


def _gemm_constexprs(config: MoEConfig, gemm: str, hidden: int, inter: int, top_k: int) -> dict:
    """The constexpr arguments of the "gate_up" or "down" kernel's launch."""
    tile = config.gate_up if gemm == "gate_up" else config.down
    constexprs = {"HIDDEN": hidden, "INTER": inter, "TOP_K": top_k, "K_PAD": triton.next_power_of_2(top_k),
                  "BLOCK_M": config.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
                  "SPLIT_K": tile.split_k, "ALIGNED": config.align, "SWAP_AB": config.swap_ab,
                  "K_ORDER": _k_ordered(config, gemm), "SUBNORMAL_DECODE": config.decode == "subnormal",
                  "COMPUTE": _compute_dtype()}
    atomic = config.combine == "atomic"
    if gemm == "gate_up":
        # Where z is put in order first, that launch zeroes the output.
        constexprs.update(ZERO_OUT=atomic and not constexprs["K_ORDER"], ZERO_BLOCK=_ZERO_BLOCK,
                          H_ORDER=config.down.block_k if _k_ordered(config, "down") else 0)
    else:
        constexprs.update(ATOMIC=atomic, TILES=tile.tiles)
    return constexprs


def _route_args(ids: torch.Tensor, config: MoEConfig, ws: MoEWorkspace) -> tuple[int, tuple]:
    """(programs along the grid's first axis, the routing arguments) of a GEMM launch: one program per
    row block after alignment, else one per pair (those whose expert an earlier pair has exit at once)."""
    programs = ws.num_blocks if config.align else ids.numel()
    return programs, (ids, ws.sorted_pair, ws.block_expert, ws.block_rows, ids.shape[0])


def _launch_prologue(z, ids, num_experts: int, out, config: MoEConfig, ws: MoEWorkspace) -> None:
    """What comes before the gate/up GEMM, in one launch: the alignment, and where the GEMM is in K order
    (ws.z_ordered), z put in that order in programs of their own beside the experts' (the two are independent;
    as two launches the second waited for the first); without alignment the order alone. Nothing in neither."""
    order = _order_work(z, out, config, ws) if ws.z_ordered is not None else None
    if config.align:
        _align(ids, num_experts, ws.sorted_pair, ws.block_m, blocks=(ws.block_expert, ws.block_rows), order=order)
    elif order is not None:
        args, constexprs, programs = order
        _order_kernel[(programs,)](*args, **constexprs, num_warps=4, **pdl.options(_order_kernel, z.device))


def _order_work(z, out, config: MoEConfig, ws: MoEWorkspace) -> tuple[tuple, dict, int]:
    """(arguments, constexprs, programs) of the K-order work (`_order_block`): z into the gate/up GEMM's K order
    (ws.z_ordered), and the output zeroed for an atomic combine; a program a BLOCK_K chunk of a token's row."""
    block_k = config.gate_up.block_k
    chunks = z.shape[1] // block_k
    args = (z, ws.z_ordered, out, z.stride(0), out.numel(), chunks)
    constexprs = {"ORDER_K": block_k, "ZERO_OUT": config.combine == "atomic", "ZERO_BLOCK": _ZERO_BLOCK}
    return args, constexprs, z.shape[0] * chunks


def _launch_gate_up(z, ids, w13_packed, w13_scale, out, config: MoEConfig, ws: MoEWorkspace,
                    beta: float, linear_beta: float) -> None:
    tile = config.gate_up
    if ws.z_ordered is not None:
        z = ws.z_ordered
    hidden, inter = z.shape[1], ws.hidden_act.shape[1]
    scale = w13_scale.view(torch.int32)  # 4 scale bytes per word (see _scale_factors)
    programs, route = _route_args(ids, config, ws)
    # Unsplit, the kernel reads neither split buffer: any tensors stand in.
    split = (ws.split_sum, ws.split_count) if tile.split_k > 1 else (ws.hidden_act, ws.block_rows)
    args = (z, w13_packed, scale, ws.hidden_act, out, *split, *route, out.numel(), beta, linear_beta, z.stride(0),
            w13_packed.stride(0), w13_packed.stride(1), scale.stride(0), scale.stride(1))
    constexprs = _gemm_constexprs(config, "gate_up", hidden, inter, ids.shape[1])
    _launch(_gate_up_kernel, (programs, inter // tile.block_n, tile.split_k), args, constexprs, tile)


def _launch_down(ids, w2_packed, w2_scale, weights, out, config: MoEConfig, ws: MoEWorkspace) -> None:
    tile = config.down
    hidden, inter = out.shape[1], ws.hidden_act.shape[1]
    scale = w2_scale.view(torch.int32)
    atomic = config.combine == "atomic"
    programs, route = _route_args(ids, config, ws)
    args = (ws.hidden_act, w2_packed, scale, out, ws.hidden_act if atomic else ws.expert_out, weights, *route,
            w2_packed.stride(0), w2_packed.stride(1), scale.stride(0), scale.stride(1))
    constexprs = _gemm_constexprs(config, "down", hidden, inter, ids.shape[1])
    _launch(_down_kernel, (programs, hidden // (tile.block_n * tile.tiles), tile.split_k), args, constexprs, tile)


def combine_expert_rows(expert_out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                        pair_row: torch.Tensor | None = None) -> None:
    """out[t] = sum_j weights[t, j] expert_out[row of pair t k + j] over the pairs not DROPPED, in fp32 and in a
    fixed order (deterministic). The row of pair p is p, or pair_row[p] (`sort_by_expert`'s order)."""
    num_tokens, hidden = out.shape
    top_k = ids.shape[1]
    _combine_kernel[(num_tokens, triton.cdiv(hidden, _COMBINE_BLOCK))](
        expert_out, ids, weights, out, ids if pair_row is None else pair_row, HIDDEN=hidden, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_H=_COMBINE_BLOCK, ROW_MAP=pair_row is not None, num_warps=4,
        **pdl.options(_combine_kernel, out.device),
    )


# A tile whose software pipeline does not fit in shared memory is retried with fewer stages, and
# the stage count that fits is remembered: the retry happens once, at warm-up, before any capture.
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch(kernel, grid, args, constexprs: dict, tile: GemmTile) -> None:
    key = (kernel.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())), tile)
    stages = _STAGES_THAT_FIT.get(key, tile.num_stages)
    while True:
        try:
            kernel[grid](*args, **constexprs, num_warps=tile.num_warps, num_stages=stages,
                         **pdl.options(kernel, args[0].device))
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        return


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
# Loops over run-time bounds are `while` loops: Triton 3.6's interpreter cannot `range` over a
# run-time integer. The GEMM loops run over constexpr bounds, so that they are software-pipelined.

# Kernels may read only constexpr globals.
_DROPPED_ID = tl.constexpr(DROPPED)
_SCALE_WORD = tl.constexpr(SCALE_WORD)
_WGMMA_M = tl.constexpr(64)  # rows of a Hopper wgmma's A operand


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, z_ptr, zk_ptr, out_ptr, stride_zt, out_numel, chunks,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, ORDER_K: tl.constexpr, ZERO_OUT: tl.constexpr,
                  ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The alignment's first launch: program c counts the pairs of chunk c (CHUNK pairs) per expert into
    counts[c] (int32 [E_PAD]); dropped pairs (id < 0) are not counted. With ORDER_K > 0 the programs past the
    chunks' do the K-order work (`_order_block`)."""
    pdl.wait_for_inputs(PDL)
    num_chunks = tl.cdiv(num_pairs, CHUNK)
    if ORDER_K > 0:  # noqa: SIM102 (constexpr first: no test at all in launches without the order)
        if tl.program_id(0) >= num_chunks:
            _order_block(z_ptr, zk_ptr, out_ptr, stride_zt, out_numel, chunks, tl.program_id(0) - num_chunks,
                         tl.num_programs(0) - num_chunks, ORDER_K, ZERO_OUT, ZERO_BLOCK)
            return
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.histogram(e, E_PAD, mask=valid & (e >= 0)))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr, expert_end_ptr,
                  pair_row_ptr, num_pairs, num_blocks, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  CHUNK: tl.constexpr, COUNT_ROWS: tl.constexpr, TABLE: tl.constexpr, GROUPS: tl.constexpr,
                  PDL: tl.constexpr):
    """The alignment's second launch, from `_count_kernel`'s counts. Experts follow one another, each run padded
    to whole blocks of BLOCK_M rows, and within an expert the pairs keep their order. Program c < #chunks
    places chunk c's pairs: it sorts them by (expert, pair), so the j-th of the sorted chunk goes to row
    base[e] + j, where base[e] = (e's first row) + (e's pairs in earlier chunks) - (the chunk's pairs of
    experts before e). Each later program writes TABLE entries of the block table (expert and real rows per
    block, -1 and 0 past the last used block); with GROUPS the first of them writes each expert's end row.
    Every program reads the whole [#chunks, E_PAD] counts (from L2) rather than wait for another launch."""
    pdl.wait_for_inputs(PDL)
    num_chunks = tl.cdiv(num_pairs, CHUNK)
    program = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    own = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, COUNT_ROWS):
        c = c0 + tl.arange(0, COUNT_ROWS)[:, None]
        counts = tl.load(counts_ptr + c * E_PAD + experts[None, :], mask=c < num_chunks, other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(c < program, counts, 0), axis=0)
        own += tl.sum(tl.where(c == program, counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first_row = tl.cumsum(padded, 0) - padded

    if program < num_chunks:
        lanes = tl.arange(0, CHUNK)
        offs = program * CHUNK + lanes
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        e = tl.where(e >= 0, e, E_PAD)  # dropped pairs and those past the end sort last and are not placed
        key = tl.sort(e * CHUNK + lanes)
        expert = key // CHUNK
        placed = expert < E_PAD
        base = first_row + before - (tl.cumsum(own, 0) - own)
        row = tl.gather(base, tl.minimum(expert, E_PAD - 1), 0) + lanes
        pair = program * CHUNK + key % CHUNK
        tl.store(sorted_pair_ptr + row, pair, mask=placed)
        if GROUPS:
            tl.store(pair_row_ptr + pair, row, mask=placed)
    else:
        table = program - num_chunks
        if GROUPS and table == 0:
            tl.store(expert_end_ptr + experts, first_row + padded, mask=experts < num_experts)
        # Block b belongs to the first expert whose blocks end after b, i.e. to the number of experts whose
        # blocks end at or before it: a binary search of the nondecreasing ends (experts without pairs end where
        # they start and are passed over). Past the last used block there is none.
        b = table * TABLE + tl.arange(0, TABLE)
        ends = (first_row + padded) // BLOCK_M
        owner = tl.zeros([TABLE], dtype=tl.int32)
        half = E_PAD // 2
        while half > 0:
            ahead = owner + half
            owner = tl.where(tl.gather(ends, ahead - 1, 0) <= b, ahead, owner)
            half //= 2
        used = b < tl.max(ends, 0)
        rows = tl.gather(total, owner, 0) - (b - tl.gather(first_row, owner, 0) // BLOCK_M) * BLOCK_M
        ok = b < num_blocks
        tl.store(block_expert_ptr + b, tl.where(used, owner, -1), mask=ok)
        tl.store(block_rows_ptr + b, tl.where(used, tl.minimum(rows, BLOCK_M), 0), mask=ok)


@triton.jit
def _dequant_words(words, scale_words, N: tl.constexpr, KW: tl.constexpr, SUBNORMAL_DECODE: tl.constexpr,
                   COMPUTE: tl.constexpr, K_ORDER: tl.constexpr):
    """words int32 [N, KW] (8 codes each, in the word layout) + scale words int32 [N, KW / 16] -> weights
    [N, 8 KW] in COMPUTE dtype, exactly: in the natural column order, or (K_ORDER) in `_k_order`'s.

    Pair i of word w, columns 8w + 2i and 8w + 2i + 1, is built as the two halves of one int32 (`_pair012`,
    `_pair3`; quant/mxfp4_words.py). The two orders want the pairs gathered differently to compile without
    layout conversions (sm_90 SASS): for `_k_order`, one [N, KW, 4] tensor whose last dimension each thread
    holds whole, the pair picked by a select the compiler resolves per register; in the natural order, the
    four [N, KW] pair tensors joined. The scales arrive as int32 words (4 E8M0 bytes, little-endian) because
    Triton's pipeliner only prefetches loads of at least 32 bits per thread: a tile of scale bytes this small
    would be a synchronous global load in every iteration.
    """
    if K_ORDER:
        i = tl.arange(0, 4)[None, None, :]
        w = words[:, :, None] + tl.zeros([1, 1, 4], dtype=tl.int32)
        pair = tl.where(i == 3, _pair3(w), _pair012(w, i))
    else:
        p02 = tl.join(_pair012(words, 0), _pair012(words, 2))
        p13 = tl.join(_pair012(words, 1), _pair3(words))
        pair = tl.reshape(tl.join(p02, p13), (N, KW, 4))  # [.., a, b] is pair 2a + b
    if not SUBNORMAL_DECODE:
        pair = _normal_pair(pair)
    # One scale byte per 4 words (32 columns), four per scale word.
    factor = _scale_factors(scale_words, SUBNORMAL_DECODE, COMPUTE)
    low, high = _scaled_halves(pair.reshape(N, KW // 16, 4, 16), factor[:, :, :, None], COMPUTE)
    pairs = tl.join(tl.reshape(low, (N, KW, 4)), tl.reshape(high, (N, KW, 4)))  # [N, KW, 4 (i), 2 (h)]
    if K_ORDER:  # word w = j KW/4 + v to position (v, i, j, h)
        pairs = tl.permute(tl.reshape(pairs, (N, 4, KW // 4, 4, 2)), (0, 2, 3, 1, 4))
    return tl.reshape(pairs, (N, 8 * KW))


@triton.jit
def _pair012(w, i):
    """Pair i < 3 of word-layout words w: sign bits at 15 and 31, magnitudes at 8..6 and 24..22 (each half the
    code's value times 2^-126; 0x81C081C0 as an int32)."""
    return (w << (3 * i)) & -0x7E3F7E40


@triton.jit
def _pair3(w):
    """Pair 3 of word-layout words w, gathered from bits 10, 11, 13, 14 (and 16 above) by three shifts."""
    return ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & -0x7FFF8000)  # 0x80008000


@triton.jit
def _normal_pair(pair):
    """A decoded pair (value * 2^-126 per half) as normal bf16 numbers of the codes' values (decode="select":
    magnitudes 1..6 by the exponent trick, 0 and 0.5 picked apart), to be scaled by 2^(s - 127)."""
    low = _e2m1_bits_normal((pair >> 6) & 0x7) | (pair & 0x8000)
    high = _e2m1_bits_normal((pair >> 22) & 0x7) | ((pair >> 16) & 0x8000)
    return low | (high << 16)


@triton.jit
def _scale_factors(scale_words, SUBNORMAL_DECODE: tl.constexpr, COMPUTE: tl.constexpr):
    """int32 scale words [N, G] -> [N, G, 4]: for each of a word's 4 E8M0 bytes s, the bf16 bits of the factor
    its decoded pairs are multiplied by, in both halves: 2^(s - 1) (subnormal decode), else 2^(s - 127).

    On the GPU one byte permute puts s at bits 8 and 24, and a shift and an add make them the exponent fields
    of 2^(s - 1) (s + 126 <= 254: scale bytes <= 128, what the subnormal decode needs anyway)."""
    if SUBNORMAL_DECODE and not COMPUTE.is_fp32():
        factor = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; prmt.b32 t, $1, 0, $2; shr.b32 t, t, 1; add.u32 $0, t, 0x3F003F00; }",
            constraints="=r,r,r", args=[scale_words[:, :, None] + tl.zeros([1, 1, 4], dtype=tl.int32),
                                        (0x0404 + 0x1010 * tl.arange(0, 4))[None, None, :]],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = (scale_words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF
        factor = (((s + 126) << 7) if SUBNORMAL_DECODE else (s << 7)) * 0x10001  # select: byte 0 reads as 0
    return factor


@triton.jit
def _scaled_halves(pair, factor, COMPUTE: tl.constexpr):
    """The low and high bf16 halves of int32 `pair`, each times the bf16 whose bits are each half of `factor`."""
    if COMPUTE.is_fp32():
        f = _bits_to(factor & 0xFFFF, COMPUTE)
        low = _bits_to(pair & 0xFFFF, COMPUTE) * f
        high = _bits_to((pair >> 16) & 0xFFFF, COMPUTE) * f
    else:
        # One packed multiply per pair (x * f + -0.0 is exactly x * f, and fma.bf16x2 runs on sm_80+).
        # Triton's own bf16 multiplies are scalar, and ptxas pairs them with extra byte permutes.
        low, high = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, z; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, $3, z; mov.b32 {$0, $1}, t; }",
            constraints="=h,=h,r,r", args=[pair, factor], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=1)
    return low, high


@triton.jit
def _e2m1_bits_normal(magnitude):
    # Codes 2..7 are 2^(e - 1) (1 + m/2): exponent field e + 126 and mantissa bit m, i.e. the code at
    # bits 8..6 plus 126 << 7 (0x3F00). Code 1 (0.5) is 0x3F00, code 0 is 0.
    return tl.where(magnitude >= 2, (magnitude << 6) + 0x3F00, magnitude * 0x3F00)


@triton.jit
def _bits_to(bits, COMPUTE: tl.constexpr):
    """bf16 bit patterns held in int32 -> those bf16 numbers, in COMPUTE dtype (bf16 or fp32)."""
    if COMPUTE.is_fp32():
        # A bf16 is the top half of the fp32 of the same value. (The interpreter's bf16 -> fp32 cast
        # flushes subnormals; the shift keeps them.)
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return value


@triton.jit
def _to_bf16(x, COMPUTE: tl.constexpr):
    """fp32 -> bf16, rounded to nearest even (by hand under the interpreter, whose cast truncates)."""
    if COMPUTE.is_fp32():
        bits = x.to(tl.int32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        rounded = x.to(tl.bfloat16)
    return rounded


@triton.jit
def _tanh(u):
    # 1 - 2 / (1 + e^{2u}): -1 as e^{2u} -> 0; the clamp (tanh(15) = 1 in fp32) keeps e^{2u} finite.
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * tl.minimum(u, 15.0)))


@triton.jit
def _program_rows(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr, num_tokens, program,
                  ALIGNED: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, pair index of each row, whether the row is real) of a GEMM program; expert < 0: no work.

    ALIGNED: the program's row block from the alignment. Otherwise the program of pair p takes the
    expert of p, unless an earlier pair has it (that pair's program does it) or p is dropped, and its
    rows are the T tokens: row t is real if t chose the expert, as its pair t k + j (the first such j).
    """
    offs_m = tl.arange(0, BLOCK_M)
    if ALIGNED:
        expert = tl.load(block_expert_ptr + program).to(tl.int64)
        row_ok = offs_m < tl.load(block_rows_ptr + program)
        pair = tl.load(sorted_pair_ptr + program * BLOCK_M + offs_m, mask=row_ok, other=0).to(tl.int64)
    else:
        slots = tl.arange(0, K_PAD)
        pairs = offs_m[:, None] * TOP_K + slots[None, :]
        ids = tl.load(ids_ptr + pairs, mask=(offs_m[:, None] < num_tokens) & (slots[None, :] < TOP_K),
                      other=_DROPPED_ID).to(tl.int64)
        expert = tl.load(ids_ptr + program).to(tl.int64)
        chose = ids == expert
        first = tl.min(tl.min(tl.where(chose, pairs, TOP_K * BLOCK_M), axis=1), axis=0)
        expert = tl.where(first == program, expert, _DROPPED_ID)  # a dropped pair stays dropped
        row_ok = tl.max(chose.to(tl.int32), axis=1) > 0
        slot = tl.min(tl.where(chose, slots[None, :], K_PAD), axis=1)
        pair = offs_m.to(tl.int64) * TOP_K + tl.where(row_ok, slot, 0)
    return expert, pair, row_ok


@triton.jit
def _row_coef(coef_ptr, ids_ptr, expert, pair, row_ok, ALIGNED: tl.constexpr, TOP_K: tl.constexpr,
              K_PAD: tl.constexpr):
    """Combine weight of each row: its pair's, or without alignment, the sum over the token's slots that
    chose the expert (one row stands for all of them: the router never repeats an expert in a token,
    but the reference allows it)."""
    if ALIGNED:
        coef = tl.load(coef_ptr + pair, mask=row_ok, other=0.0)
    else:
        slots = tl.arange(0, K_PAD)
        pairs = (pair // TOP_K)[:, None] * TOP_K + slots[None, :]
        ok = row_ok[:, None] & (slots[None, :] < TOP_K)
        chose = ok & (tl.load(ids_ptr + pairs, mask=ok, other=_DROPPED_ID).to(tl.int64) == expert)
        coef = tl.sum(tl.load(coef_ptr + pairs, mask=chose, other=0.0), axis=1)
    return coef


@triton.jit
def _mxfp4_matmul(x_ptrs, row_ok, w_ptrs, s_ptrs, K: tl.constexpr, BLOCK_M: tl.constexpr, N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, K_ORDER: tl.constexpr, SUBNORMAL_DECODE: tl.constexpr,
                  COMPUTE: tl.constexpr):
    """x [BLOCK_M, K] (bf16 rows at x_ptrs) @ W^T with W [N, K] in MXFP4 at w_ptrs / s_ptrs: fp32 [BLOCK_M, N]."""
    acc = tl.zeros([N, BLOCK_M] if SWAP_AB else [BLOCK_M, N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = _mxfp4_step(acc, x_ptrs, row_ok, w_ptrs, s_ptrs, BLOCK_M, N, BLOCK_K, SWAP_AB, K_ORDER,
                          SUBNORMAL_DECODE, COMPUTE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8  # one int32 word per 8 columns
        s_ptrs += BLOCK_K // _SCALE_WORD  # one int32 word of scales per 128 columns
    return tl.trans(acc) if SWAP_AB else acc


@triton.jit
def _mxfp4_step(acc, x_ptrs, row_ok, w_ptrs, s_ptrs, BLOCK_M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                SWAP_AB: tl.constexpr, K_ORDER: tl.constexpr, SUBNORMAL_DECODE: tl.constexpr, COMPUTE: tl.constexpr):
    """acc + one K step of x W^T: x [BLOCK_M, BLOCK_K] at x_ptrs, W [N, BLOCK_K] at w_ptrs / s_ptrs; acc is
    [N, BLOCK_M] with SWAP_AB, else [BLOCK_M, N].

    One dot per K step: with two chained dots per step Triton stacks all warps along BLOCK_M, which
    at BLOCK_M = 16 decodes every weight once per warp. SWAP_AB computes (W x^T)^T instead: the
    decoded weights are then the A operand, which Hopper's wgmma takes straight from registers (no
    round trip through shared memory), and the few token rows are the N side of the instruction.
    """
    x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(COMPUTE)
    # K_ORDER: the activations are stored in the order the weights decode into (module doc, "Dequantization"), so
    # that this load feeds the dot straight from its pipelined buffer.
    w = _dequant_words(tl.load(w_ptrs), tl.load(s_ptrs), N, BLOCK_K // 8, SUBNORMAL_DECODE, COMPUTE, K_ORDER)
    return tl.dot(w, tl.trans(x), acc) if SWAP_AB else tl.dot(x, tl.trans(w), acc)


@triton.jit
def _k_order(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """t [ROWS, COLS] (natural column order) in the order of `_dequant_words`' columns.

    A thread's share of a wgmma A operand in registers (kWidth 2) is, per 8 columns, the 2 columns
    2j, 2j + 1 (j = lane % 4), and the next 8 columns' share belongs to the same 4 lanes. Column
    8a + 2j + h of the reordered tile (a = 4v + i) is source column 8(j COLS/32 + v) + 2i + h: thread j's
    columns are then the contiguous quarter j of the tile, so it reads its packed words 4 at a time,
    and each of its bf16 pairs is one decoded pair i of a word (`_dequant_words`). Naturally ordered,
    each thread would read a byte in every 4 (Triton then reads the staged weights from shared memory a
    byte at a time) and the decoded tile would go through shared memory again to reach the fragment
    layout. The same reordering of both operands' K columns leaves the dot unchanged.
    """
    return tl.reshape(tl.permute(tl.reshape(t, (ROWS, 4, COLS // 32, 4, 2)), (0, 2, 3, 1, 4)), (ROWS, COLS))


@triton.jit
def _k_position(c, COLS: tl.constexpr):
    """Where `_k_order` of COLS columns puts natural column c (0 <= c < COLS): source column
    8 (j COLS/32 + v) + 2 i + h goes to 8 (4 v + i) + 2 j + h."""
    j = c // (COLS // 4)
    v = (c % (COLS // 4)) // 8
    return 32 * v + 8 * ((c % 8) // 2) + 2 * j + c % 2


@triton.jit
def _order_kernel(z_ptr, zk_ptr, out_ptr, stride_zt, out_numel, chunks, ORDER_K: tl.constexpr,
                  ZERO_OUT: tl.constexpr, ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """`_order_block` alone (no alignment to share a launch with: the decode path)."""
    pdl.wait_for_inputs(PDL)
    _order_block(z_ptr, zk_ptr, out_ptr, stride_zt, out_numel, chunks, tl.program_id(0), tl.num_programs(0), ORDER_K,
                 ZERO_OUT, ZERO_BLOCK)


@triton.jit
def _order_block(z_ptr, zk_ptr, out_ptr, stride_zt, out_numel, chunks, index, programs, ORDER_K: tl.constexpr,
                 ZERO_OUT: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Program `index` of the `programs` of the K-order work: chunk index % chunks of token index // chunks,
    zk[t] = z[t] in `_k_order` of each ORDER_K columns; and (ZERO_OUT) its share of `out` zeroed for the atomic
    adds."""
    if ZERO_OUT:
        _zero_slice(out_ptr, out_numel, index, programs, ZERO_BLOCK)
    token = (index // chunks).to(tl.int64)
    chunk = index % chunks
    cols = tl.arange(0, ORDER_K)
    z = tl.load(z_ptr + token * stride_zt + chunk * ORDER_K + cols)
    tl.store(zk_ptr + token * chunks * ORDER_K + chunk * ORDER_K + _k_position(cols, ORDER_K), z)


@triton.jit
def _weight_ptrs(w_ptr, s_ptr, expert, rows, k_start, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_K: tl.constexpr):
    """Pointers to the first BLOCK_K columns from k_start of an expert's rows: packed int32 words (8 codes each),
    scale words (4 scale bytes each). The strides are the uint8 tensors' (bytes)."""
    w_ptrs = (w_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_we // 4) + rows[:, None] * (stride_wn // 4)
              + (k_start // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
    s_ptrs = (s_ptr + expert * stride_se + rows[:, None] * stride_sn
              + (k_start // _SCALE_WORD + tl.arange(0, BLOCK_K // _SCALE_WORD))[None, :])
    return w_ptrs, s_ptrs


@triton.jit
def _zero_slice(out_ptr, numel, pid, nprog, ZERO_BLOCK: tl.constexpr):
    start = pid * ZERO_BLOCK
    while start < numel:
        offs = start + tl.arange(0, ZERO_BLOCK)
        tl.store(out_ptr + offs, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=offs < numel)
        start += nprog * ZERO_BLOCK


@triton.jit
def _gate_up_kernel(z_ptr, w_ptr, s_ptr, h_ptr, out_ptr, split_sum_ptr, split_count_ptr, ids_ptr, sorted_pair_ptr,
                    block_expert_ptr, block_rows_ptr, num_tokens, out_numel, beta, linear_beta, stride_zt,
                    stride_we, stride_wn, stride_se, stride_sn,
                    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    ALIGNED: tl.constexpr, ZERO_OUT: tl.constexpr, ZERO_BLOCK: tl.constexpr, SWAP_AB: tl.constexpr,
                    K_ORDER: tl.constexpr, H_ORDER: tl.constexpr, SUBNORMAL_DECODE: tl.constexpr,
                    COMPUTE: tl.constexpr, PDL: tl.constexpr):
    """h[pair, n-tile] = SiTU(z W1^T, z W3^T) for one program's rows of one expert (its K part if split).

    K_ORDER: z is in `_k_order` of BLOCK_K columns (`_order_kernel`). H_ORDER > 0: h is stored in `_k_order` of
    H_ORDER columns, the down kernel's (module doc, "Dequantization")."""
    pdl.wait_for_inputs(PDL)
    program = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n_tiles = tl.num_programs(1)
    if ZERO_OUT:
        # The down kernel adds into `out` atomically; this launch runs before it and has many programs.
        _zero_slice(out_ptr, out_numel, (program * n_tiles + pid_n) * SPLIT_K + pid_k,
                    tl.num_programs(0) * n_tiles * SPLIT_K, ZERO_BLOCK)
    expert, pair, row_ok = _program_rows(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr, num_tokens,
                                         program, ALIGNED, TOP_K, K_PAD, BLOCK_M)
    if expert < 0:
        return

    # One B tile of 2 BLOCK_N rows: gate row n at tile row 2n, up row n at 2n + 1, so one dot gives
    # both and the epilogue separates them in registers.
    tile_rows = tl.arange(0, 2 * BLOCK_N)
    w_rows = pid_n * BLOCK_N + tile_rows // 2 + (tile_rows % 2) * INTER  # w3 rows follow the I rows of w1
    k_part: tl.constexpr = HIDDEN // SPLIT_K
    cols = pid_k * k_part + tl.arange(0, BLOCK_K)
    x_ptrs = z_ptr + (pair // TOP_K)[:, None] * stride_zt + cols[None, :]
    w_ptrs, s_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, w_rows, pid_k * k_part, stride_we, stride_wn, stride_se,
                                  stride_sn, BLOCK_K)
    acc = _mxfp4_matmul(x_ptrs, row_ok, w_ptrs, s_ptrs, k_part, BLOCK_M, 2 * BLOCK_N, BLOCK_K, SWAP_AB, K_ORDER,
                        SUBNORMAL_DECODE, COMPUTE)
    if SPLIT_K > 1:
        # The part that completes the tile adds up the others' (left in split_sum) and goes on; it leaves
        # the sums and the counter zero for the next launch. The barrier and the release order every
        # thread's additions before the count (the usual threadfence-reduction pattern). The sums are
        # read and zeroed by one exchange per element: a load and a store may be given to different
        # threads (seen at BLOCK_N = 64), and nothing orders one thread's load before another's store.
        # The exchange is of the bits (Triton's interpreter exchanges only integers).
        sum_ptrs = split_sum_ptr + pair[:, None] * (2 * INTER) + (pid_n * 2 * BLOCK_N + tile_rows)[None, :]
        tl.atomic_add(sum_ptrs, acc, mask=row_ok[:, None], sem="relaxed")
        tl.debug_barrier()
        if tl.atomic_add(split_count_ptr + program * n_tiles + pid_n, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        bits = tl.atomic_xchg(sum_ptrs.to(tl.pointer_type(tl.int32)), tl.zeros_like(acc).to(tl.int32),
                              mask=row_ok[:, None], sem="relaxed")
        acc = bits.to(tl.float32, bitcast=True)
        tl.store(split_count_ptr + program * n_tiles + pid_n, 0)

    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    # SiTU(a, b) = [beta tanh(a / beta) sigmoid(a)] [linear_beta tanh(b / linear_beta)], in fp32.
    act = (beta * _tanh(gate / beta) * tl.sigmoid(gate)) * (linear_beta * _tanh(up / linear_beta))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if H_ORDER > 0:
        offs_n = offs_n - offs_n % H_ORDER + _k_position(offs_n % H_ORDER, H_ORDER)
    tl.store(h_ptr + pair[:, None] * INTER + offs_n[None, :], _to_bf16(act, COMPUTE), mask=row_ok[:, None])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, out_ptr, y_ptr, coef_ptr, ids_ptr, sorted_pair_ptr, block_expert_ptr,
                 block_rows_ptr, num_tokens, stride_we, stride_wn, stride_se, stride_sn,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 TILES: tl.constexpr, ALIGNED: tl.constexpr, ATOMIC: tl.constexpr, SWAP_AB: tl.constexpr,
                 K_ORDER: tl.constexpr, SUBNORMAL_DECODE: tl.constexpr, COMPUTE: tl.constexpr, PDL: tl.constexpr):
    """y[pair, n-tile] = h W2^T for one program's rows and its TILES n-tiles (its K part if split: ATOMIC
    adds the parts up); added into out (atomic) or stored per pair (reduce).

    The tiles run as one loop of TILES x (K steps), so that the software pipeline loads the next tile's
    weights while this one's are decoded (module doc, "Short K")."""
    pdl.wait_for_inputs(PDL)
    program = tl.program_id(0)
    expert, pair, row_ok = _program_rows(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr, num_tokens,
                                         program, ALIGNED, TOP_K, K_PAD, BLOCK_M)
    if expert < 0:
        return

    STEPS: tl.constexpr = INTER // SPLIT_K // BLOCK_K
    k_start = tl.program_id(2) * (INTER // SPLIT_K)
    coef = _row_coef(coef_ptr, ids_ptr, expert, pair, row_ok, ALIGNED, TOP_K, K_PAD) if ATOMIC else None
    first_n = tl.program_id(1) * TILES * BLOCK_N
    x_ptrs = h_ptr + pair[:, None] * INTER + (k_start + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs, s_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, first_n + tl.arange(0, BLOCK_N), k_start, stride_we,
                                  stride_wn, stride_se, stride_sn, BLOCK_K)
    # Step `it` reads the first tile's pointers moved by a scalar (tile rows down, K steps across).
    w_tile = BLOCK_N * (stride_wn // 4)  # in int32 words
    w_step: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, TILES * STEPS):
        tile, step = it // STEPS, it % STEPS
        acc = _mxfp4_step(acc, x_ptrs + step * BLOCK_K, row_ok, w_ptrs + (tile * w_tile + step * w_step),
                          s_ptrs + (tile * BLOCK_N * stride_sn + step * (BLOCK_K // _SCALE_WORD)), BLOCK_M, BLOCK_N,
                          BLOCK_K, SWAP_AB, K_ORDER, SUBNORMAL_DECODE, COMPUTE)
        if TILES > 1 and step == STEPS - 1:
            _down_epilogue(acc, out_ptr, y_ptr, pair, row_ok, coef, first_n + tile * BLOCK_N, HIDDEN, TOP_K, BLOCK_N,
                           ATOMIC, SWAP_AB, COMPUTE)
            acc = tl.zeros_like(acc)
    if TILES == 1:
        # Outside the loop, so that nothing but the wgmmas writes the accumulator inside it: ptxas then keeps
        # them in flight (it serializes them when the zeroing above is in the loop, sm_90 having no
        # accumulate-or-not flag from Triton).
        _down_epilogue(acc, out_ptr, y_ptr, pair, row_ok, coef, first_n, HIDDEN, TOP_K, BLOCK_N, ATOMIC, SWAP_AB,
                       COMPUTE)


@triton.jit
def _down_epilogue(acc, out_ptr, y_ptr, pair, row_ok, coef, first_n, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, SWAP_AB: tl.constexpr, COMPUTE: tl.constexpr):
    """One output tile of the down GEMM added into out (atomic, times the combine weights) or stored per pair."""
    offs_n = first_n + tl.arange(0, BLOCK_N)
    y = tl.trans(acc) if SWAP_AB else acc
    if ATOMIC:
        out_ptrs = out_ptr + (pair // TOP_K)[:, None] * HIDDEN + offs_n[None, :]
        tl.atomic_add(out_ptrs, y * coef[:, None], mask=row_ok[:, None], sem="relaxed")
    else:
        tl.store(y_ptr + pair[:, None] * HIDDEN + offs_n[None, :], _to_bf16(y, COMPUTE), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, coef_ptr, out_ptr, row_ptr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
                    K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ROW_MAP: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_j coef[t, j] y[row of pair t k + j] over the pairs not dropped (no block wrote their y),
    in fp32 and always in the same order (deterministic). The row is the pair, or with ROW_MAP row_ptr's."""
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOP_K
    col_ok = cols < HIDDEN
    pairs = token * TOP_K + slots
    slot_ok = slot_ok & (tl.load(ids_ptr + pairs, mask=slot_ok, other=-1) >= 0)
    rows = tl.load(row_ptr + pairs, mask=slot_ok, other=0).to(tl.int64) if ROW_MAP else pairs
    y = tl.load(y_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=slot_ok[:, None] & col_ok[None, :], other=0.0)
    coef = tl.load(coef_ptr + pairs, mask=slot_ok, other=0.0)
    tl.store(out_ptr + token * HIDDEN + cols, tl.sum(y.to(tl.float32) * coef[:, None], axis=0), mask=col_ok)
