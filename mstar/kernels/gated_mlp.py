"""The dense gated MLPs (layer 0's MLP, the shared experts) on the GPU: gate and up projections as one
GEMM over their stacked weights, then SiTU(gate) * up in one Triton launch.

Torch runs two GEMMs and ~8 elementwise launches (casts, tanh, sigmoid, products) per MLP; at decode
each costs a launch, not bandwidth. The gate and up weights are stacked (`StackedLinear`; the glue that
runs a module through this is models/kimi_k3/gpu_ops.py).

`situ_and_mul` equals `models/kimi_k3/mlp.situ` (fp32 arithmetic, one rounding at the end).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl
from mstar.kernels.moe_mxfp4 import _tanh  # the experts' SiTU uses the same tanh


def situ_and_mul(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first, unit column stride) -> SiTU(gate, up) [T, I] in its dtype."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _situ_kernel[(T, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), inter, beta, linear_beta,
                                                 BLOCK=block, num_warps=4,
                                                 **pdl.options(_situ_kernel, gate_up.device))
    return out


@triton.jit
def _situ_kernel(gu_ptr, out_ptr, stride, inter, beta, linear_beta, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    situ_block(gu_ptr, out_ptr, stride, inter, inter, beta, linear_beta, tl.program_id(0), tl.program_id(1), BLOCK)


@triton.jit
def situ_block(gu_ptr, out_ptr, stride, stride_out, inter, beta, linear_beta, row, block, BLOCK: tl.constexpr):
    """Columns block * BLOCK .. of row `row`: out = SiTU(gate, up) of gate_up's halves (for kernels that fuse it),
    out's rows `stride_out` apart."""
    t = row.to(tl.int64)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    a = tl.load(gu_ptr + t * stride + cols, mask=ok, other=0).to(tl.float32)
    b = tl.load(gu_ptr + t * stride + inter + cols, mask=ok, other=0).to(tl.float32)
    y = beta * _tanh(a / beta) * tl.sigmoid(a) * (linear_beta * _tanh(b / linear_beta))
    tl.store(out_ptr + t * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
