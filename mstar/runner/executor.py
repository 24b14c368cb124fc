"""The seam between deciding and running a step: `StepExecutor`.

EngineCore declares and plans a step, then hands it to its executor, which runs the model and returns
the device tensors the step produced (nothing is copied to the host here). The `ModelRunner` is the
executor of one rank; what adds behaviour around a step wraps an executor instead of patching the
runner: rank 0 of a tensor-parallel group sends each step to the followers first
(distributed/worker.py `LeaderExecutor`), tests inject failures (engine/faults.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from mstar.models.kimi_k3.serving import BatchPlan
from mstar.resources.step import StepDecl


@dataclass(frozen=True)
class ModelStep:
    """A planned step: the declaration it was planned from (which request each sequence is, what it
    samples), its device addressing, and the target layers whose taps the draft reads."""

    decl: StepDecl
    plan: BatchPlan
    tap_layers: tuple[int, ...] = ()
    # KDA slot copies (from, to) the pool made since the last step (prefix-cache snapshots and resumes), done
    # on this rank already; a tensor-parallel follower makes them before this step's forward
    slot_copies: tuple[tuple[int, int], ...] = ()


class StepOutput(NamedTuple):
    """What a step's forward leaves on the device: logits [S, vocab] of its sampled rows and, when asked,
    the taps of every row [N, len(tap_layers) * hidden]. With CUDA graphs these are views of a graph's
    buffers, valid until the next step runs."""

    logits: torch.Tensor
    taps: torch.Tensor | None


class StepExecutor(Protocol):
    def execute(self, step: ModelStep) -> StepOutput:
        """Queue the step's forward (caches and states advance by its rows); its outputs on the device."""
        ...
