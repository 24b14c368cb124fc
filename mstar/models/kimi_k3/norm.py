"""RMSNorm as Kimi computes it, and the precision rule shared by every layer.

Statistics run in at least fp32 (fp64 stays fp64 so the float64 reference is exact); the normalised
value is cast back to the input dtype before the weight multiplies it, as in HF's `KimiRMSNorm`.
"""

from __future__ import annotations

import torch
from torch import nn


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32 when it is a lower-precision float; fp32 and fp64 pass through unchanged."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mean_square: torch.Tensor | None = None
             ) -> torch.Tensor:
    """`mean_square` [..., 1]: the rows' mean of squares, given where x holds only part of each row (default: x's)."""
    xf = at_least_fp32(x)
    if mean_square is None:
        mean_square = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(mean_square + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
