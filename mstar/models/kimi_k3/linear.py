"""The model's dense projections: a bias-free nn.Linear whose GEMM a GPU kernel can take.

Checkpoint names and shapes are nn.Linear's. `kernel(x, weight)` is F.linear unless the GPU setup
(`gpu_ops.install_fused_kernels`) puts the skinny GEMM in (kernels/skinny_gemm.py: few rows, as at
decode, at close to HBM bandwidth; more rows still go to cuBLAS).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.kernel: LinearKernel = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)
