"""K3's router on the GPU in two launches: the logits GEMM (bf16 in, fp32 out), then one Triton kernel
for sigmoid, the bias-for-selection top-k, the gather, the renormalisation and the scaling.

The torch router (models/kimi_k3/moe.py, `Router`) upcasts the weight to fp32 on every call and
spends about a dozen launches after the GEMM; at decode that is more time than its 3 MB of weights.
The products of bf16 operands are exact in fp32 and both GEMMs accumulate in fp32, so the logits
differ from the torch path only in summation order. Ungrouped selection only (K3: one expert
group); `Router.kernel` stays unset where grouping is on.

Per token row (one program): s = sigmoid(logit); pick k times the largest s + bias among the
experts not yet picked (ids in pick order; torch's topk(sorted=False) order is unspecified, and
the experts' sum does not depend on it); w_j = s[id_j], renormalised over the k picks when asked,
times the scaling factor.

`select_with_situ` also computes the shared experts' SiTU (gated_mlp) of the same GEMM's gate/up columns in
the same launch, in programs of their own beside the selection's: the two are independent, and as two
launches the second waited for the first (each ~1-4 us at decode, in each of K3's 92 MoE layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl, skinny_gemm
from mstar.kernels.gated_mlp import situ_block


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int64 [T, k], combine weights fp32 [T, k]) for x [T, D] (bf16/fp16, or fp32)."""
    return select(skinny_gemm.linear_fp32(x, weight), bias, top_k, renormalize, scale)


def select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The post-GEMM part alone: logits fp32 [T, E] -> (ids [T, k], weights [T, k]). `bias` [E] in any float
    dtype (the kernel reads it as fp32: no cast launched per call)."""
    ids, weights, _ = _launch(logits, bias, top_k, renormalize, scale, None, 0.0, 0.0, None)
    return ids, weights


def select_with_situ(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                     gate_up: torch.Tensor, beta: float, linear_beta: float, out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select` and `gated_mlp.situ_and_mul(gate_up, beta, linear_beta)` in one launch: (ids, weights, SiTU
    [T, I] in gate_up's dtype). gate_up [T, 2I] (gate columns first, unit column stride) has logits' rows. `out`:
    where the SiTU goes, [T, I] in gate_up's dtype with unit column stride (e.g. the last columns of a wider
    buffer that a GEMM reads next)."""
    if gate_up.dim() != 2 or gate_up.shape[0] != logits.shape[0] or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T={logits.shape[0]}, 2I] with unit column stride, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, inter) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {inter}] {gate_up.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return _launch(logits, bias, top_k, renormalize, scale, gate_up, beta, linear_beta, out)


SITU_BLOCK = 512  # SiTU columns a program of select_with_situ computes (one warp: 16 a thread)


def _launch(logits, bias, top_k, renormalize, scale, gate_up, beta, linear_beta, hidden):
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..{E}")
    if bias.shape != (E,):
        raise ValueError(f"bias must be [{E}] (one per expert), got {tuple(bias.shape)}")
    device = logits.device
    ids = torch.empty(T, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    inter = 0 if gate_up is None else gate_up.shape[1] // 2
    situ = ((gate_up, hidden, gate_up.stride(0), hidden.stride(0)) if gate_up is not None
            else (logits, logits, 0, 0))  # unread stand-ins
    _select_kernel[(T, 1 + triton.cdiv(inter, SITU_BLOCK))](
        logits.contiguous(), bias.contiguous(), ids, weights, E, scale, *situ, inter, beta, linear_beta,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E),
        RENORM=renormalize and top_k > 1, SITU_BLOCK=SITU_BLOCK, num_warps=1, **pdl.options(_select_kernel, device))
    return ids, weights, hidden


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, scale, gu_ptr, hidden_ptr, stride_gu, stride_hidden,
                   inter, beta, linear_beta, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   RENORM: tl.constexpr, SITU_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0): row t's selection; programs (t, c > 0): block c - 1 of row t's SiTU (select_with_situ)."""
    pdl.wait_for_inputs(PDL)
    if tl.program_id(1) > 0:
        situ_block(gu_ptr, hidden_ptr, stride_gu, stride_hidden, inter, beta, linear_beta, tl.program_id(0),
                   tl.program_id(1) - 1, SITU_BLOCK)
        return
    # One warp a row: each pick is one max over E_PAD keys held in registers (warp shuffles, no shared-memory
    # round trips, which four warps paid three times a pick). A key is the choice's bits made sortable as a
    # signed int (negative floats' magnitude bits flipped) above the complement of the id, so the max is the
    # largest choice and, among equal ones, the lowest id (offset to be >= 0, so -1 marks taken or padding).
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    live = experts < E
    logit = tl.load(logits_ptr + t * E + experts, mask=live, other=0.0)
    choice = tl.sigmoid(logit) + tl.load(bias_ptr + experts, mask=live, other=0.0).to(tl.float32)
    # A NaN row (a poisoned request, or rows no sequence owns) must still pick ids the expert kernels can
    # index: NaN choices rank below every number (as -inf does), so all picks are live ids. Its weights stay
    # NaN, so the row's output is non-finite and the engine fails only that request.
    choice = tl.where(choice == choice, choice, float("-inf"))
    bits = choice.to(tl.int32, bitcast=True)
    sortable = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2**31  # in [0, 2^32)
    key = tl.where(live, (sortable << 31) | (E_PAD - 1 - experts).to(tl.int64), -1)
    slots = tl.arange(0, K_PAD)
    picked = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = E_PAD - 1 - (best & (E_PAD - 1))
        picked = tl.where(slots == j, idx, picked)
        key = tl.where(experts == idx, -1, key)
    ok = slots < TOP_K
    picked = tl.where(ok, picked, 0)
    w = tl.where(ok, tl.sigmoid(tl.load(logits_ptr + t * E + picked)), 0.0)  # s at the picks: L1-resident
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOP_K + slots, picked, mask=ok)
    tl.store(weights_ptr + t * TOP_K + slots, w * scale, mask=ok)
