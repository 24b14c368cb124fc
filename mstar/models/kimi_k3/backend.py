"""The kernel backend of a serving model: which kernel runs each part of the stack, chosen in one place.

A backend is two tables: the token mixers (`TorchMixerOps` or the GPU's `GpuMixerOps`: KDA and MLA over
the engine's pools) and the token-wise layer ops (`LayerOps`: norms, AttnRes, routing, routed experts,
dense MLPs). `select_backend` picks both when a serving model is built, by device capability, dtype and
shape; the reference model is only read (stacked weights are built from its weights, holding the bytes
once: kernels/stacked_linear.py). The torch path is the reference every kernel is tested against, and
what runs wherever a kernel does not support the device, dtype or shape.

Adding a kernel: write it in mstar/kernels/ beside the torch function it must equal (tensors and plain
configs in, tensors out), call it from the glue in gpu_ops.py, and name it here, under the condition
(capability, dtype, shape) where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layer_ops import REFERENCE_OPS, LayerOps
from .mla import GatedMLA
from .model import KimiK3ForCausalLM
from .moe import LatentMoE
from .serving import TorchMixerOps


@dataclass(frozen=True)
class Backend:
    mixers: TorchMixerOps
    layers: LayerOps = REFERENCE_OPS
    fused: bool = False  # one-launch kernels for the small operations, stacked input projections
    expert_layers: int = 0  # MoE layers whose routed experts run a kernel


REFERENCE = Backend(TorchMixerOps(), REFERENCE_OPS)

KERNEL_CHOICES = ("auto", "torch")


def select_backend(model: KimiK3ForCausalLM, kernels: str = "auto", max_step_tokens: int | None = None,
                   bf16_above_tokens: int | None = None) -> Backend:
    """The fastest kernels `model` (its device and dtype) supports; "torch": the reference path everywhere.
    `max_step_tokens`: the most tokens a step may hold (the scheduler's budget), which decides, with the
    threshold `bf16_above_tokens` (MSTAR_MOE_BF16_TOKENS), whether the MoE's bf16 path for large steps is
    set up (gpu_ops.expert_kernels)."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r}: choose one of {KERNEL_CHOICES}")
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    if kernels == "torch" or device.type != "cuda":
        return REFERENCE
    # The GPU kernels (Triton, fla-core) are imported only here: a CPU install has neither.
    from . import gpu_ops

    # One-launch kernels for the small operations and input projections stacked into one GEMM: bf16/fp16
    # models. fp32/fp64 models keep the torch path there, whose exact summation order the CPU reference shares.
    fused = dtype in (torch.bfloat16, torch.float16)
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    experts = {}
    if dtype == torch.bfloat16 and gpu_ops.moe_mxfp4.supported(device):  # MXFP4 W4A16: bf16 activations
        experts = gpu_ops.expert_kernels([m for m in moes if gpu_ops.expert_kernel_fits(m)], max_step_tokens,
                                         bf16_above_tokens)
    layers = gpu_ops.GpuLayerOps(experts) if fused else REFERENCE_OPS  # experts are bf16 only: fused
    mixers = TorchMixerOps()  # where fla-core is not installed
    if gpu_ops.kda_fla.available():
        mla = frozenset(m for m in model.modules()
                        if isinstance(m, GatedMLA) and gpu_ops.mla_kernel_fits(m, dtype, device))
        mixers = gpu_ops.GpuMixerOps(mla, fused=fused)
    return Backend(mixers, layers, fused=fused, expert_layers=len(experts))
