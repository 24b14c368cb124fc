"""The DSpark draft's greedy Markov chain on the GPU: one launch a slot, for all blocks at once.

For blocks b = 1..B with base logits U [B, k, V] (the lm_head of the block's hidden states) and anchors x_0,
slot j picks (DSpark eq. 4-5, `K3DSparkModel.markov_sample` at temperature 0)

    x_j = argmax_v  U[b, j, v] + (W2 W1[x_{j-1}])[v]          (the first v among equal maxima)

with the bias rounded to the weights' dtype, as the reference's Linear returns it, and the sum in fp32.

In torch a slot is about fourteen launches (the W1 gather, the GEMV, a cast, the add, the argmax, clamps,
the one-hot): more time than the GEMV's read of W2 (84 MB in the real draft). Here a launch per slot reads
W2 once for all B rows: each program takes BLOCK_V vocabulary rows, computes the bias of all blocks with
one dot, adds U, and folds its best (value, id) per block into that block's slot key with an atomic max.
A key is the value's bits made sortable as an integer (negative floats' magnitude bits flipped) above the
complement of the id, so the largest key is the largest value and, among equal values, the lowest id, as
torch's argmax returns it (a NaN, whose bits sort above +inf, wins as it does there). The next slot's
programs decode x_{j-1} from those keys (they start after the launch that wrote them ends), so nothing
returns to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl

BLOCK_V = 128  # vocabulary rows a program reads
RANK_BLOCK = 64  # W2 columns per step of a program's loop


def greedy_markov_chain(base_logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor) -> torch.Tensor:
    """tokens [B, k] (int64) of the greedy chain (module doc): base_logits [B, k, V] (any float dtype, unit
    inner stride), anchors [B], w1 [V, r] (the embedding), w2 [V, r] (the Linear's weight), one dtype."""
    if base_logits.dim() != 3 or base_logits.stride(-1) != 1:
        raise ValueError(f"base_logits must be [B, k, V] with unit inner stride, got {tuple(base_logits.shape)}")
    B, k, V = base_logits.shape
    r = w1.shape[1]
    if w1.shape != (V, r) or w2.shape != (V, r) or anchors.shape != (B,) or w1.dtype != w2.dtype:
        raise ValueError(f"greedy_markov_chain: base_logits {tuple(base_logits.shape)} needs anchors [{B}] and "
                         f"w1, w2 [{V}, r] of one dtype; got {tuple(anchors.shape)}, {tuple(w1.shape)} {w1.dtype}, "
                         f"{tuple(w2.shape)} {w2.dtype}")
    if r % 16 or not w1.is_contiguous() or not w2.is_contiguous():
        raise ValueError(f"the Markov rank must be a multiple of 16 with contiguous weights, got {r}")
    v_pad = triton.next_power_of_2(V)
    keys = torch.zeros(B, k, dtype=torch.int64, device=base_logits.device)
    rank_block = min(RANK_BLOCK, triton.next_power_of_2(r))
    while r % rank_block:
        rank_block //= 2
    for j in range(k):
        _chain_step_kernel[(triton.cdiv(V, BLOCK_V),)](
            base_logits, anchors, w1, w2, keys, B, V, base_logits.stride(0), base_logits.stride(1), j,
            K=k, RANK=r, RANK_BLOCK=rank_block, B_PAD=max(16, triton.next_power_of_2(B)), BLOCK_V=BLOCK_V,
            V_PAD=v_pad, PRECISION="ieee" if w2.dtype == torch.float32 else "tf32",  # fp32 weights: no tf32 rounding
            num_warps=4, **pdl.options(_chain_step_kernel, w2.device))
    return ((v_pad - 1) - (keys & (v_pad - 1))).clamp_(max=V - 1)


@triton.jit
def _chain_step_kernel(base_ptr, anchors_ptr, w1_ptr, w2_ptr, keys_ptr, B, V, stride_b, stride_k, j,
                       K: tl.constexpr, RANK: tl.constexpr, RANK_BLOCK: tl.constexpr, B_PAD: tl.constexpr,
                       BLOCK_V: tl.constexpr, V_PAD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    blocks = tl.arange(0, B_PAD)
    live = blocks < B
    if j == 0:
        prev = tl.load(anchors_ptr + blocks, mask=live, other=0).to(tl.int64)
    else:
        prev = (V_PAD - 1) - (tl.load(keys_ptr + blocks * K + j - 1, mask=live, other=0) & (V_PAD - 1))
    prev = tl.minimum(tl.maximum(prev, 0), V - 1)  # an out-of-range id never reaches the W1 gather
    vocab = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = vocab < V
    cols = tl.arange(0, RANK_BLOCK)
    bias = tl.zeros([B_PAD, BLOCK_V], dtype=tl.float32)
    for c in range(0, RANK, RANK_BLOCK):
        e = tl.load(w1_ptr + prev[:, None] * RANK + (c + cols)[None, :], mask=live[:, None], other=0)
        w = tl.load(w2_ptr + vocab[:, None].to(tl.int64) * RANK + (c + cols)[None, :], mask=in_vocab[:, None],
                    other=0)
        bias = tl.dot(e, tl.trans(w), bias, input_precision=PRECISION)
    bias = bias.to(w2_ptr.dtype.element_ty).to(tl.float32)  # the reference's Linear output, in the weights' dtype
    ok = live[:, None] & in_vocab[None, :]
    u = tl.load(base_ptr + blocks[:, None].to(tl.int64) * stride_b + j * stride_k + vocab[None, :], mask=ok,
                other=0).to(tl.float32)
    bits = (u + bias).to(tl.int32, bitcast=True)
    sortable = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2**31  # in [0, 2^32)
    key = tl.where(ok, (sortable << 31) | (V_PAD - 1 - vocab).to(tl.int64), -1)
    tl.atomic_max(keys_ptr + blocks * K + j, tl.max(key, axis=1), mask=live, sem="relaxed")
