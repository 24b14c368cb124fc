"""The DSpark draft's greedy proposal step as CUDA graphs, one per (batch bucket, draft count).

Eagerly a draft step is about a thousand small launches from Python (5 layers of norms, projections and
attention, the lm_head, a Markov chain of k argmax steps), so the host's launch pace, not the GPU, sets
its time. The paged path (models/dspark/paged.py) has shapes that depend only on (B, k), so one capture
per bucket replays any step whose blocks all draft k tokens greedily: the step's anchors, positions,
page table and row slots are copied into fixed buffers (`stage`), padding blocks point at the sink
page, and the replay's proposals are views of the graph's outputs (valid until the next replay; the
verify step that reads them is queued before it). Sampled blocks and steps of mixed k run eagerly.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from mstar.models.dspark.model import DraftProposal, DraftSampling, Embed, K3DSparkModel, LMHead
from mstar.models.dspark.paged import SINK, PagedBlocks, kernel_chain, paged_blocks_hidden

log = logging.getLogger(__name__)


class DraftGraphs:
    """Captured greedy draft steps of B blocks of k drafts for B in `buckets`, over the draft KV `cache`."""

    def __init__(self, draft: K3DSparkModel, embed: Embed, lm_head: LMHead, cache: Tensor, *, drafts: int,
                 buckets: tuple[int, ...], max_seq_len: int):
        if drafts < 1 or not buckets or min(buckets) < 1:
            raise ValueError(f"DraftGraphs needs drafts >= 1 and positive buckets; got {drafts}, {buckets}")
        self.draft, self.embed, self.lm_head, self.cache = draft, embed, lm_head, cache
        self.drafts = drafts
        self.buckets = tuple(sorted(set(buckets)))
        page_size = cache.shape[2]
        self.page_size = page_size
        b, k, device = self.buckets[-1], drafts, cache.device
        long = {"dtype": torch.long, "device": device}
        self.anchors = torch.zeros(b, **long)
        self.starts = torch.zeros(b, **long)
        self.page_table = torch.zeros(b, math.ceil(max_seq_len / page_size), **long)
        self.slots = torch.zeros(b * k, **long)
        self.lens = torch.zeros(b, **long)
        self.cu = torch.arange(0, b * k + 1, k, **long)
        self.sink_slots = SINK * page_size + torch.arange(k, **long) % page_size
        # per bucket: the graph, its hidden states [bucket, k, D] (what the proposals came from) and its proposals
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, list[DraftProposal]]] = {}

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def can_run(self, num_drafts: tuple[int, ...], sampling: list[DraftSampling]) -> bool:
        return (self.bucket_for(len(num_drafts)) is not None and all(k == self.drafts for k in num_drafts)
                and all(s.temperature == 0 for s in sampling))

    def _blocks(self, bucket: int) -> PagedBlocks:
        k = self.drafts
        return PagedBlocks(self.anchors[:bucket], self.starts[:bucket], self.page_table[:bucket],
                           self.slots[: bucket * k], self.lens[:bucket], self.cu[: bucket + 1], k)

    def _step(self, bucket: int) -> tuple[Tensor, list[DraftProposal]]:
        hidden = paged_blocks_hidden(self.draft, self.cache, self._blocks(bucket), self.embed)
        return hidden, self.draft.propose_from_hidden(hidden, self.anchors[:bucket], (self.drafts,) * bucket,
                                                      self.lm_head, [DraftSampling()] * bucket,
                                                      kernel_chain(self.draft))

    def capture(self, pool: object | None = None) -> None:
        """Capture every bucket, largest first, into `pool` (a new one when None); a failure names the bucket."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            self._stage_padding(0, bucket)
            try:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compile outside the capture
                    self._step(bucket)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden, proposals = self._step(bucket)
            except Exception as e:
                raise RuntimeError(f"capturing the draft step of {bucket} blocks of {self.drafts} drafts failed: {e}. "
                                   "Set model_kwargs.cuda_graphs=false to serve eagerly.") from e
            self.graphs[bucket] = (graph, hidden, proposals)
            log.info("captured the draft step for %d blocks of %d drafts", bucket, self.drafts)
        torch.cuda.synchronize()

    def run(self, anchors: Tensor, starts: Tensor, page_table: Tensor, row_slots: Tensor) -> list[DraftProposal]:
        """The proposals of n blocks (anchors, starts [n]; page_table [n, P]; row_slots [n, k]) by replay.
        Device-to-device copies only: the host waits for nothing."""
        n = anchors.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None or row_slots.shape != (n, self.drafts) or page_table.shape[1] > self.page_table.shape[1]:
            raise ValueError(f"DraftGraphs.run takes at most {self.buckets[-1]} blocks of {self.drafts} drafts and "
                             f"{self.page_table.shape[1]} pages; got row slots {tuple(row_slots.shape)}, page table "
                             f"{tuple(page_table.shape)}")
        width = page_table.shape[1]
        self.anchors[:n].copy_(anchors)
        self.starts[:n].copy_(starts)
        self.page_table[:n, :width].copy_(page_table)  # past `width`: stale ids, never read (cuda_graphs.stage)
        self.slots[: n * self.drafts].view(n, self.drafts).copy_(row_slots)  # a strided view copies as it is
        torch.add(starts, self.drafts, out=self.lens[:n])
        self._stage_padding(n, bucket)
        graph, _, proposals = self.graphs[bucket]
        graph.replay()
        return proposals[:n]

    def _stage_padding(self, n: int, bucket: int) -> None:
        """Blocks n .. bucket - 1 become padding: anchor 0 at position 0 on the sink page, seeing their own rows."""
        if n == bucket:
            return  # a full bucket: each fill would still cost the host a dispatch
        k = self.drafts
        self.anchors[n:bucket] = 0
        self.starts[n:bucket] = 0
        self.page_table[n:bucket] = SINK
        self.slots[n * k : bucket * k] = self.sink_slots.repeat(bucket - n)
        self.lens[n:bucket] = k
