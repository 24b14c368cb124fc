"""Routed experts held as random MXFP4, as an MXFP4 checkpoint loads them: what the packed-expert
kernels (moe_mxfp4, moe_bf16) take. Shared by the tests that build such layers and models."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mstar.quant.mxfp4 import random_mxfp4
from mstar.quant.mxfp4_linear import MXFP4Linear


def hold_packed(experts: Iterable[nn.Module], gen: torch.Generator) -> None:
    """Replace each expert's w1, w3 and w2 by a random MXFP4Linear of the same shape (`random_mxfp4`, on
    the generator's device)."""
    for expert in experts:
        for name in ("w1", "w3", "w2"):
            dense = getattr(expert, name)
            setattr(expert, name, MXFP4Linear.from_packed(*random_mxfp4(dense.out_features, dense.in_features, gen)))
