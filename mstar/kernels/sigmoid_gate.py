"""The sigmoid output gate of K3's MLA layers, y = o * sigmoid(g), in one Triton launch.

`GatedMLA.output` (models/kimi_k3/mla.py) computes it in at least fp32 and rounds once to g's dtype; in
torch that is six launches at decode (o's heads made contiguous, two casts, the sigmoid, the product, the
rounding), each a launch's worth of time for a few KB. This kernel reads o in the head-strided layout the
attention's value projection leaves it in and g once, computes in fp32 and stores the rounded product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels import pdl


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o [T, H, V] (any row and head strides, unit column stride), gate [T, H V] (unit column stride; a strided
    view of a stacked projection is fine) -> (o * sigmoid(gate)) [T, H V] in gate's dtype, computed in fp32."""
    if o.ndim != 3 or gate.shape != (o.shape[0], o.shape[1] * o.shape[2]) or o.stride(-1) != 1 \
            or gate.stride(-1) != 1:
        raise ValueError(f"sigmoid_gate takes o [T, H, V] and gate [T, H V] with unit column strides, got "
                         f"{tuple(o.shape)} strides {o.stride()} and {tuple(gate.shape)} strides {gate.stride()}")
    T, H, V = o.shape
    out = torch.empty(T, H * V, dtype=gate.dtype, device=gate.device)
    _sigmoid_gate_kernel[(T, H)](o, gate, out, o.stride(0), o.stride(1), gate.stride(0), V,
                                 BLOCK=triton.next_power_of_2(V), num_warps=1,
                                 **pdl.options(_sigmoid_gate_kernel, o.device))
    return out


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, stride_ot, stride_oh, stride_g, V, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < V
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + cols, mask=ok, other=0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_g + h * V + cols, mask=ok, other=0).to(tl.float32)
    y = o * tl.sigmoid(g)
    tl.store(out_ptr + t * tl.num_programs(1) * V + h * V + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
