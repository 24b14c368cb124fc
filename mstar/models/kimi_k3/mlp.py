"""Gated activations (SiTU for K3, SiLU for Kimi-Linear) and the gated MLP they drive.

SiTU(a, b) = [b1 * tanh(a / b1) * sigmoid(a)] * [b2 * tanh(b / b2)] with b1 = 4, b2 = 25: SiLU's
a * sigmoid(a) with `a` soft-clipped to +-b1, times the up branch soft-clipped to +-b2. `a` is the
gate branch (gate_proj / w1), `b` the up branch (up_proj / w3). Computed in at least fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import KimiK3Config
from .norm import at_least_fp32


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    a, b = at_least_fp32(gate), at_least_fp32(up)
    out = beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))
    return out.to(gate.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gated_activation(config: KimiK3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ(gate, up, config.activation_situ_beta, config.activation_situ_linear_beta)
    return silu_and_mul(gate, up)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layer-0 MLP and the fused shared experts."""

    def __init__(self, config: KimiK3Config, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x), up(x)): what the down projection reads."""
        return gated_activation(self.config, self.gate_proj(x), self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class Expert(nn.Module):
    """One routed expert, named as the checkpoint: w1 (gate), w3 (up), w2 (down). Built with nn.Linear
    projections; the loader swaps in an `MXFP4Linear` (same forward) for each one the checkpoint
    holds as MXFP4, so that it stays packed."""

    def __init__(self, config: KimiK3Config, input_size: int, intermediate_size: int):
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(input_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(input_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, input_size, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(gated_activation(self.config, self.w1(z), self.w3(z)))
