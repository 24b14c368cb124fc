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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = at_least_fp32(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
