"""K3's routed experts for large steps: bf16 grouped GEMMs on the layer's experts dequantized once.

`moe_mxfp4` decodes every weight tile in registers, once per row block that reads it. At decode that is
free (the step is bound by reading each weight once), but at thousands of tokens per step the MoE is
compute-bound and the decoding (~3 instructions per weight, again for each block of 128 rows) takes
issue slots from the tensor cores. Above a token count that the caller gives (`Bf16Path.above_tokens`;
serving passes MSTAR_MOE_BF16_TOKENS, default 6144, see mstar/config.py) a step instead runs `moe_bf16`,
which computes what `moe_mxfp4` does (combine="reduce"):

1. `dequantize_experts`: the layer's `StackedExperts` into `DequantizedExperts`, a bf16 scratch the layers
   take turns in (serving: two, the next layer's dequantized on a side stream while this one runs,
   models/kimi_k3/dequant_ahead.py): each packed byte and scale read once, each bf16 weight written once,
   decoded by moe_mxfp4's `_dequant_words` in the natural column order (exact: MXFP4 values are bf16 numbers).
   It reads no activation, so it can run ahead of the step; `grouped_experts` is the rest.
2. `moe_mxfp4.sort_by_expert`: the (token, slot) pairs sorted by expert, unpadded, with each expert's end
   row (the grouped GEMMs' offsets) and each pair's row; DROPPED pairs (other ranks' experts) placed nowhere.
3. `_gather_kernel`: z's rows in that order (grouped GEMMs take their rows contiguous).
4. gate/up: torch._grouped_mm over the experts' [2I, H] weights -> bf16 [T*k, 2I], as the bf16 model's
   Linear rounds it; 5. `gated_mlp.situ_and_mul` -> bf16 [T*k, I]; 6. down: torch._grouped_mm -> bf16 [T*k, H].
7. `moe_mxfp4.combine_expert_rows`: each token's k rows weighted and added in fp32, in a fixed order.

No host sync and no host value from the device: CUDA-graph capturable where `supported` (torch's CUTLASS
grouped GEMM reads the offsets on the device).

Count at one TP8 rank of pruned75 (E = 224 local experts, H = 3584, I = 384, top-16), T tokens:
- dequantization, whatever T: 925 M weights, 491 MB read and 1.85 GB written (0.55 ms at 4.26 TB/s);
- GEMMs: 2 x 3 x H x I FLOP per pair, 132 MFLOP per token: 1.08e12 FLOP at T = 8192, 1.44 ms at
  750 TFLOP/s (the bf16 floor of `flop_floor_s`);
- activations per token: the gathered z and the down output, 16 x H x 2 B each, written once and read once
  (1.9 GB each way at T = 8192), gate/up and SiTU 37 kB: the memory passes outside the GEMMs (dequantize,
  gather, SiTU, combine) take ~1 ms of HBM time at T = 8192 on top of the GEMMs.
benchmarks/kernels/bench_moe_bf16.py times it against moe_mxfp4 and the floors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mstar.kernels import moe_mxfp4
from mstar.kernels.gated_mlp import situ_and_mul
from mstar.kernels.moe_mxfp4 import SITU_BETA, SITU_LINEAR_BETA, _dequant_words, _to_bf16, _weight_ptrs

BF16_FLOPS = 750e12  # dense bf16 tensor-core rate of the H200 (DESIGN.md: 684-790 TFLOP/s measured); for floors


def supported(device: torch.device | str) -> bool:
    """Whether `moe_bf16` may serve on `device`: CUDA at compute capability 9.0 (Hopper).

    There torch._grouped_mm runs its CUTLASS kernel, which reads the group offsets on the device. On other
    GPUs it takes a fallback that copies the offsets to the host (a sync per GEMM, which CUDA-graph
    capture refuses), and its sm_10x kernels were reported broken in torch 2.10. (It also runs on the CPU,
    which the tests use, but serving never selects this path there.)
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def flop_floor_s(num_tokens: int, top_k: int, hidden: int, inter: int) -> float:
    """Seconds of the step's GEMMs at BF16_FLOPS: 2 x 3 x H x I FLOP per (token, expert) pair."""
    return 6 * hidden * inter * num_tokens * top_k / BF16_FLOPS


# ----------------------------------------------------------------------------------------------
# Dequantized experts
# ----------------------------------------------------------------------------------------------


class DequantizedExperts(NamedTuple):
    """One layer's experts in bf16, rows as in `StackedExperts`; one scratch serves every layer in turn."""

    w13: torch.Tensor  # bf16 [E, 2I, H]: w1 (gate) rows, then w3 (up) rows
    w2: torch.Tensor  # bf16 [E, H, I]

    @classmethod
    def allocate(cls, num_experts: int, hidden: int, inter: int, device: torch.device | str) -> DequantizedExperts:
        """2 x 3 H I bytes per expert. One TP8 rank of pruned75 (224 experts, H = 3584, I = 384):
        224 x 3 x 3584 x 384 x 2 B = 1,849,688,064 B (1.72 GiB)."""
        bf16 = {"dtype": torch.bfloat16, "device": device}
        return cls(torch.empty(num_experts, 2 * inter, hidden, **bf16), torch.empty(num_experts, hidden, inter, **bf16))

    def fits(self, num_experts: int, hidden: int, inter: int) -> bool:
        return tuple(self.w13.shape) == (num_experts, 2 * inter, hidden) and tuple(self.w2.shape) == (
            num_experts, hidden, inter)


def dequantize_experts(stacked: moe_mxfp4.StackedExperts, out: DequantizedExperts, *,
                       decode: str = "subnormal") -> DequantizedExperts:
    """`out` = the stacked MXFP4 experts in bf16, exactly `dequantize_mxfp4` (two launches).

    decode as MoEConfig.decode: "subnormal" (scale bytes <= 128, what `stack_experts` checks by default) or
    "select" (any byte; byte 0 reads as 0, as in moe_mxfp4).
    """
    num_experts, hidden, inter = moe_mxfp4.check_weights(*stacked)
    if decode not in ("subnormal", "select"):
        raise ValueError(f"decode must be 'subnormal' or 'select', got {decode!r}")
    if not out.fits(num_experts, hidden, inter) or out.w13.device != stacked.w13_packed.device:
        raise ValueError(f"out holds w13 {tuple(out.w13.shape)}, w2 {tuple(out.w2.shape)} on {out.w13.device}; "
                         f"need [{num_experts}, {2 * inter}, {hidden}], [{num_experts}, {hidden}, {inter}] on "
                         f"{stacked.w13_packed.device} (DequantizedExperts.allocate)")
    _launch_dequant(stacked.w13_packed, stacked.w13_scale, out.w13, decode)
    _launch_dequant(stacked.w2_packed, stacked.w2_scale, out.w2, decode)
    return out


_DEQUANT_ELEMENTS = 16384  # weights per dequantization program


def _launch_dequant(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, decode: str) -> None:
    """packed u8 [E, N, K/2] (word layout) + scales [E, N, K/32] -> bf16 out [E, N, K], as one [E N, K] matrix."""
    rows, k = out.shape[0] * out.shape[1], out.shape[2]
    block_k = moe_mxfp4._fit(512, k, moe_mxfp4.SCALE_WORD, "dequantize block_k")
    block_n = moe_mxfp4._fit(_DEQUANT_ELEMENTS // block_k, rows, 16, "dequantize block_n")
    words = scale.view(torch.int32)  # 4 scale bytes per word, as _dequant_words takes them
    _dequant_kernel[(rows // block_n, k // block_k)](
        packed, words, out, K=k, BLOCK_N=block_n, BLOCK_K=block_k, SUBNORMAL_DECODE=decode == "subnormal",
        COMPUTE=moe_mxfp4._compute_dtype(), num_warps=4,
    )


@triton.jit
def _dequant_kernel(packed_ptr, words_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SUBNORMAL_DECODE: tl.constexpr, COMPUTE: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_start = tl.program_id(1) * BLOCK_K
    w_ptrs, s_ptrs = _weight_ptrs(packed_ptr, words_ptr, 0, rows, k_start, 0, K // 2, 0, K // 128, BLOCK_K)
    w = _dequant_words(tl.load(w_ptrs), tl.load(s_ptrs), BLOCK_N, BLOCK_K // 8, SUBNORMAL_DECODE, COMPUTE, False)
    cols = k_start + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], _to_bf16(w, COMPUTE))


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------


def moe_bf16(
    z: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    scratch: DequantizedExperts,
    out: torch.Tensor | None = None,
    decode: str = "subnormal",
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """What `moe_mxfp4` computes (same arguments; fp32 [T, H], into `out` if given), through `scratch`,
    which it overwrites with this layer's experts in bf16 (see the module doc): `dequantize_experts`, then
    `grouped_experts`."""
    stacked = moe_mxfp4.StackedExperts(w13_packed, w13_scale, w2_packed, w2_scale)
    hidden = moe_mxfp4.check_weights(*stacked)[1]
    num_tokens, _ = moe_mxfp4._check_activations(z, expert_ids, expert_weights, hidden, w13_packed.device)
    out = _output(out, num_tokens, hidden, z.device)
    if num_tokens == 0:
        return out
    return grouped_experts(z, expert_ids, expert_weights, dequantize_experts(stacked, scratch, decode=decode), out=out,
                           situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)


def grouped_experts(
    z: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: DequantizedExperts,
    *,
    out: torch.Tensor | None = None,
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """Steps 2-7 of the module doc over experts already in bf16 (`dequantize_experts`' output): fp32 [T, H], into
    `out` if given. The caller orders the dequantization before this on the stream (or on another one, with an
    event between: models/kimi_k3/dequant_ahead.py)."""
    num_experts, two_inter, hidden = experts.w13.shape
    if not experts.fits(num_experts, hidden, two_inter // 2) or experts.w13.dtype != torch.bfloat16:
        raise ValueError(f"experts hold w13 {experts.w13.dtype} {tuple(experts.w13.shape)} and w2 "
                         f"{tuple(experts.w2.shape)}: need bf16 [E, 2I, H] and [E, H, I] (DequantizedExperts)")
    num_tokens, top_k = moe_mxfp4._check_activations(z, expert_ids, expert_weights, hidden, experts.w13.device)
    out = _output(out, num_tokens, hidden, z.device)
    if num_tokens == 0:
        return out
    ids, weights = expert_ids.contiguous(), expert_weights.contiguous()

    pairs = num_tokens * top_k
    i32 = {"dtype": torch.int32, "device": z.device}
    sorted_pair, pair_row = torch.empty(pairs, **i32), torch.empty(pairs, **i32)
    expert_end = torch.empty(num_experts, **i32)
    moe_mxfp4.sort_by_expert(ids, num_experts, sorted_pair, expert_end, pair_row)
    # The gathered rows die with the first GEMM: the caching allocator (or a graph's pool) reuses their
    # memory for the down GEMM's output, of the same size.
    gate_up = torch._grouped_mm(_gather_rows(z, sorted_pair, expert_end, top_k), experts.w13.transpose(1, 2),
                                offs=expert_end)
    # Rows past the last expert's end (DROPPED pairs) are left unwritten by the grouped GEMMs: SiTU runs
    # over them too, and nothing reads what it makes of them.
    hidden_act = situ_and_mul(gate_up, situ_beta, situ_linear_beta)
    del gate_up
    expert_out = torch._grouped_mm(hidden_act, experts.w2.transpose(1, 2), offs=expert_end)
    moe_mxfp4.combine_expert_rows(expert_out, ids, weights, out, pair_row)
    return out


def _output(out: torch.Tensor | None, num_tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
    """`out` checked to be a contiguous fp32 [T, H], or a new one."""
    if out is None:
        return torch.empty(num_tokens, hidden, dtype=torch.float32, device=device)
    if out.shape != (num_tokens, hidden) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{num_tokens}, {hidden}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


_GATHER_ROWS = 16
_GATHER_COLS = 512


def _gather_rows(z: torch.Tensor, sorted_pair: torch.Tensor, expert_end: torch.Tensor, top_k: int) -> torch.Tensor:
    """bf16 [T*k, H]: row r is z's row of the pair sorted to r; rows past the last expert's end (left by
    DROPPED pairs) are zero."""
    pairs, hidden = sorted_pair.numel(), z.shape[1]
    rows = torch.empty(pairs, hidden, dtype=z.dtype, device=z.device)
    _gather_kernel[(triton.cdiv(pairs, _GATHER_ROWS), triton.cdiv(hidden, _GATHER_COLS))](
        z, sorted_pair, expert_end, rows, pairs, expert_end.numel() - 1, z.stride(0), HIDDEN=hidden, TOP_K=top_k,
        BLOCK_R=_GATHER_ROWS, BLOCK_H=_GATHER_COLS, num_warps=4,
    )
    return rows


@triton.jit
def _gather_kernel(z_ptr, sorted_pair_ptr, expert_end_ptr, rows_ptr, num_rows, last_expert, stride_zt,
                   HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_range = rows < num_rows
    placed = in_range & (rows < tl.load(expert_end_ptr + last_expert))
    col_ok = cols < HIDDEN
    pair = tl.load(sorted_pair_ptr + rows, mask=placed, other=0).to(tl.int64)
    x = tl.load(z_ptr + (pair // TOP_K)[:, None] * stride_zt + cols[None, :], mask=placed[:, None] & col_ok[None, :],
                other=0.0)
    tl.store(rows_ptr + rows.to(tl.int64)[:, None] * HIDDEN + cols[None, :], x,
             mask=in_range[:, None] & col_ok[None, :])
