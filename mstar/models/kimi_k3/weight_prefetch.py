"""A decode step's next weights into L2 while it waits on a collective: `WeightPrefetch` (kernels/l2_prefetch.py).

In a MoE layer of a tensor-parallel decode step every collective is followed by a projection that streams its
weights from HBM, and during the collective HBM idles. Those weights do not depend on the collective, so
`GpuLayerOps` names them as the wait begins, and this launches their prefetch on a side stream forked there: it
runs beside the collective (or the emulation's modeled wait), and the projection then reads its bytes from L2.
Per MoE layer:

- the mixer's all-reduce: the stacked MoE input weights (router, latent down, shared gate/up) (`weights`);
- the all-gather of the latent z: the routed experts the router just picked (`experts`, by their ids on the device);
- the all-reduce of the routed sum: the latent output GEMM's weights (`weights`).

Only steps of at most MAX_ROWS rows (decode, verify), where those projections are bound by their weight stream;
only with a collective to hide behind (several ranks); only on GPUs `l2_prefetch` supports. At most L2_SHARE of
the L2 per prefetch, so that what the step's kernels share there stays. The side stream joins the step's stream
at its end (`join`), which a CUDA-graph capture needs.
"""

from __future__ import annotations

import functools

import torch

from mstar.kernels import l2_prefetch
from mstar.kernels.l2_prefetch import Segment
from mstar.kernels.moe_mxfp4 import StackedExperts

MAX_ROWS = 64  # the skinny-GEMM regime (kernels/skinny_gemm.MAX_ROWS): weights streamed, not reused
L2_SHARE = 0.75  # of the L2 one prefetch may fill


class WeightPrefetch:
    def __init__(self):
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._forked: set[torch.device] = set()

    def wanted(self, rows: int, world_size: int, device: torch.device) -> bool:
        """Whether a step of `rows` rows over `world_size` ranks on `device` prefetches."""
        return rows <= MAX_ROWS and world_size > 1 and l2_prefetch.supported(device)

    def weights(self, tensors: list[torch.Tensor]) -> None:
        """Prefetch the contiguous `tensors` (in order, up to the budget; others are skipped)."""
        device = tensors[0].device
        segments = weight_segments([t for t in tensors if t.is_contiguous()], _budget(device))
        if segments:
            self._launch(device, segments, None)

    def experts(self, stacked: StackedExperts, ids: torch.Tensor, local_ids: torch.Tensor | None) -> None:
        """Prefetch the slices of `stacked` (one layer's experts) that `ids` [T, k] (global ids; `local_ids` maps
        them to the stack's, -1 where another rank holds the expert) pick, as many pairs as the budget holds."""
        device = stacked.w13_packed.device
        segments = [Segment.of(t, per_expert=True) for t in stacked]
        fit = min(ids.numel(), _budget(device) // sum(s.nbytes for s in segments))
        if fit:
            self._launch(device, segments, ids.reshape(-1)[:fit], local_ids, stacked.w13_packed.shape[0])

    def join(self) -> None:
        """Make each stream that forked a prefetch wait for it (the end of a step)."""
        for device in self._forked:
            torch.cuda.current_stream(device).wait_stream(self._side[device])
        self._forked.clear()

    def _launch(self, device: torch.device, segments: list[Segment], ids: torch.Tensor | None,
                local_ids: torch.Tensor | None = None, num_ids: int = 0) -> None:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        side = self._side[device]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if ids is not None and local_ids is not None:
                ids = local_ids[ids]
            l2_prefetch.prefetch(segments, ids, num_ids)
        self._forked.add(device)


def weight_segments(tensors: list[torch.Tensor], budget: int) -> list[Segment]:
    """The byte ranges of contiguous `tensors`, in order, cut where `budget` bytes are reached (at most
    l2_prefetch.MAX_SEGMENTS of them: one launch)."""
    segments = []
    for t in tensors[: l2_prefetch.MAX_SEGMENTS]:
        whole = Segment.of(t)
        take = min(whole.nbytes, budget)
        if take <= 0:
            break
        segments.append(Segment(whole.address, take))
        budget -= take
    return segments


@functools.cache
def _budget(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).L2_cache_size * L2_SHARE)
