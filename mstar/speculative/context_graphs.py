"""The draft's context write (DSparkProposer.write_context) as CUDA graphs, by row count.

After every target step the draft stores one latent row per draft layer for each of the step's rows, from
the target's taps: a projection and norm shared by the layers, then per layer a projection, a norm, RoPE
and the KV write. Eagerly that is some thirty launches from Python a step, which on a small model costs
the host more than the whole verify step costs the GPU. Its shapes depend only on the row count, so one
capture per row bucket replays any step of at most that many rows: taps, positions and KV slots are
copied into fixed buffers, and the rows past the step's are padding written to the sink page.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from mstar.models.dspark.paged import SINK

log = logging.getLogger(__name__)

# (taps [N, width], positions [N], KV slots [N]): writes each row's latent rows into the draft KV
ContextWrite = Callable[[Tensor, Tensor, Tensor], None]


class ContextGraphs:
    """Captured context writes of N rows for N in `buckets` (a step of fewer rows pads to the next one)."""

    def __init__(self, write: ContextWrite, *, buckets: tuple[int, ...], tap_width: int, dtype: torch.dtype,
                 page_size: int, device: torch.device):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"ContextGraphs needs positive row buckets; got {buckets}")
        self.write = write
        self.buckets = tuple(sorted(set(buckets)))
        rows = self.buckets[-1]
        self.taps = torch.zeros(rows, tap_width, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.sink_slots = SINK * page_size + torch.arange(rows, device=device) % page_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def capture(self, pool: object | None = None) -> None:
        """Capture every bucket, largest first, into `pool` (a new one when None); a failure names the bucket."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            self._stage_padding(0, bucket)
            args = self.taps[:bucket], self.positions[:bucket], self.slots[:bucket]
            try:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compile outside the capture
                    self.write(*args)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.write(*args)
            except Exception as e:
                raise RuntimeError(f"capturing the draft's context write of {bucket} rows failed: {e}. Set "
                                   "model_kwargs.cuda_graphs=false to serve eagerly.") from e
            self.graphs[bucket] = graph
        log.info("captured the draft's context write for %s rows", self.buckets)
        torch.cuda.synchronize()

    def run(self, taps: Tensor, positions: Tensor, slots: Tensor) -> bool:
        """Write the rows by replay (device-to-device copies, then the graph); False, having done nothing,
        when the step has more rows than the largest bucket."""
        n = taps.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return False
        self.taps[:n].copy_(taps)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self._stage_padding(n, bucket)
        self.graphs[bucket].replay()
        return True

    def _stage_padding(self, n: int, bucket: int) -> None:
        """Rows n .. bucket - 1 become padding: position 0, written to the sink page."""
        if n == bucket:
            return  # a full bucket: each fill would still cost the host a dispatch
        self.positions[n:bucket] = 0
        self.slots[n:bucket] = self.sink_slots[n:bucket]
