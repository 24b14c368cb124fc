"""Several bias-free projections of the same input as one GEMM over their stacked weights.

At decode a K3 layer's small projections of one input (KDA's q, k, v, f_a, b and g_a; a gated MLP's
gate and up) cost a launch each and read too few bytes to reach full bandwidth alone. Stacked, one
GEMM reads them all. The stack is one tensor whose row blocks become the modules' weights (views),
so nothing is held twice and the torch path still reads the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StackedLinear:
    """The stacked weight of `linears` (same input width) and the width of each output block."""

    def __init__(self, linears: list[nn.Linear]):
        if any(lin.bias is not None for lin in linears) or len({lin.in_features for lin in linears}) != 1:
            raise ValueError("StackedLinear stacks bias-free nn.Linear layers of one input width")
        self.widths = [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        start = 0
        for lin, width in zip(linears, self.widths, strict=True):
            lin.weight = nn.Parameter(self.weight[start : start + width], requires_grad=False)
            start += width

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection of x, as column blocks (views) of one GEMM's output."""
        return list(F.linear(x, self.weight).split(self.widths, dim=-1))
