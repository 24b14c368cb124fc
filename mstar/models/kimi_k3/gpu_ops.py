"""Token mixers on the GPU: the kernels that replace the torch path of `serving.TorchMixerOps`.

KDA runs through fla-core (`mstar/kernels/kda_fla.py`); layers whose kernel is not available on this
device fall back to the torch path, which is the reference for every kernel here.
"""

from __future__ import annotations

import torch

from mstar.kernels import kda_fla
from mstar.resources.recurrent_pool import RecurrentStatePool

from .kda import KimiDeltaAttention
from .serving import BatchPlan, TorchMixerOps


class GpuMixerOps(TorchMixerOps):
    def kda(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
            pool: RecurrentStatePool) -> torch.Tensor:
        return kda_fla.kda_step(attn, layer, x, plan.seq_starts, plan.kda_slots, plan.verify, pool)


def default_mixer_ops(device: torch.device) -> TorchMixerOps:
    """The fastest mixers this device supports (GPU kernels on CUDA when fla-core imports)."""
    if device.type == "cuda" and kda_fla.available():
        return GpuMixerOps()
    return TorchMixerOps()
