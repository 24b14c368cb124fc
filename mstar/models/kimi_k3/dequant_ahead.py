"""The large-step expert path's dequantization, run one layer ahead on a side stream: `DequantAhead`.

Steps of more than MSTAR_MOE_BF16_TOKENS tokens run each MoE layer's routed experts as bf16 grouped GEMMs
(kernels/moe_bf16.py) over the layer's experts dequantized into a scratch first: at one TP8 rank of pruned75,
491 MB read and 1.85 GB written a layer (a tenth of an 8,192-token prefill step in benchmarks/emulate_rank/), all
of it in the step's critical path although it reads no activation. Here two scratches take turns (layer i's experts
in scratch i % 2), and each layer's call queues the next layer's dequantization on a side stream, once the layer
before has finished with that scratch. It then runs beside this layer's GEMMs, the collectives after them (which
leave most SMs idle) and the next layer's attention; the current stream waits only for the dequantization of the
layer it is about to run.

The first call of a step (its first layer, or any layer not queued ahead) orders the side stream after everything
queued on the current stream so far and dequantizes that layer there: every event a step waits on was recorded
earlier in the same step, as CUDA-graph capture requires, and a captured step replays the same fork and join.
Off CUDA the same calls run in order on the host (the tests' path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mstar.kernels import moe_bf16, moe_mxfp4
from mstar.kernels.moe_bf16 import DequantizedExperts


class DequantAhead:
    """The bf16 experts of `layers` (one rank's MoE layers of one expert shape, in the order a step runs them),
    each layer's dequantized into one of two scratches (one for a single layer) on a side stream, a layer ahead."""

    def __init__(self, layers: list[moe_mxfp4.StackedExperts], device: torch.device | str):
        shapes = {moe_mxfp4.check_weights(*layer) for layer in layers}
        if len(shapes) != 1:
            raise ValueError(f"DequantAhead takes layers of one expert shape (E, H, I), got {sorted(shapes)}")
        shape = shapes.pop()
        self.layers = layers
        self.scratches = [DequantizedExperts.allocate(*shape, device) for _ in range(min(2, len(layers)))]
        cuda = torch.device(device).type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None
        turns = len(self.scratches)
        # per scratch: its layer dequantized (side stream), its layer's GEMMs queued (current stream)
        self._ready = [torch.cuda.Event() for _ in range(turns)] if cuda else []
        self._released = [torch.cuda.Event() for _ in range(turns)] if cuda else []
        self._start = torch.cuda.Event() if cuda else None
        self._ahead: int | None = None  # the layer whose dequantization is queued and not yet taken

    def experts(self, index: int) -> DequantizedExperts:
        """Layer `index`'s experts in bf16, for what the current stream queues next (it waits for them there);
        queues layer index + 1's dequantization. Call `release(index)` once the layer's GEMMs are queued."""
        fresh = self._ahead != index
        if fresh:  # nothing of this step queued ahead: start after everything the current stream holds
            if self._side is not None:
                self._start.record()
                self._side.wait_event(self._start)
            self._dequantize(index)
        following = index + 1
        if following < len(self.layers):
            if not fresh and self._side is not None:  # the layer before this one is done with that scratch
                self._side.wait_event(self._released[following % 2])
            self._dequantize(following)
            self._ahead = following
        else:
            self._ahead = None
        if self._side is not None:
            torch.cuda.current_stream().wait_event(self._ready[index % len(self.scratches)])
        return self.scratches[index % len(self.scratches)]

    def release(self, index: int) -> None:
        """Layer `index`'s work on its scratch is queued on the current stream: the scratch's next dequantization
        waits for it."""
        if self._side is not None:
            self._released[index % len(self.scratches)].record()

    def _dequantize(self, index: int) -> None:
        turn = index % len(self.scratches)
        if self._side is None:
            moe_bf16.dequantize_experts(self.layers[index], self.scratches[turn])
            return
        with torch.cuda.stream(self._side):
            moe_bf16.dequantize_experts(self.layers[index], self.scratches[turn])
            self._ready[turn].record()


class Bf16Path(NamedTuple):
    """A MoE layer's large steps: those of more than `above_tokens` tokens run bf16 grouped GEMMs over its experts,
    layer `index` of `ahead`."""

    above_tokens: int
    ahead: DequantAhead
    index: int

    def __call__(self, z: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        experts = self.ahead.experts(self.index)
        out = moe_bf16.grouped_experts(z, expert_ids, expert_weights, experts)
        self.ahead.release(self.index)
        return out
