"""How a Triton kernel's `.to(dtype)` rounds, for tests that hold a kernel's in-register rounding to torch's."""

from __future__ import annotations

import torch


def as_kernel_rounds(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to dtype as a kernel's `.to(dtype)` rounds it: to nearest even on the GPU (as torch does), toward
    zero under Triton's interpreter (its fp32 -> bf16 conversion truncates the mantissa)."""
    if x.is_cuda or (x.dtype, dtype) != (torch.float32, torch.bfloat16):
        return x.to(dtype)
    return (x.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)
