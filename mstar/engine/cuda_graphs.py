"""CUDA graphs of decode and verify steps: the whole forward of B sequences x r rows (r = 1: decode; r =
k + 1: a DSpark verify block), captured per batch bucket.

Eagerly, a K3 decode step is thousands of small launches (93 layers of norms, AttnRes, projections,
kernels), so the host's launch pace, not HBM, sets its time. A captured step replays them all with
one launch. Everything a decode step reads sits in fixed buffers (token ids, page table, slot
mapping, context lengths, KDA slots) that `run` fills before each replay; the kernels take their
shapes from the bucket and their lengths from those buffers, so one capture serves any contexts:

- KDA: state and conv windows read and written in place by slot (kda_fla.kda_decode); verify blocks run
  [accepted prefix ; block] per sequence from a layout staged with each step's pending-prefix lengths
  (kda_fla.BlockLayout with a fixed capacity per sequence, kda_fla.kda_block_step);
- MLA: the paged decode kernel with a split count fixed for `max_seq_len` (a shorter context
  uses fewer of the splits); verify blocks the multi-row kernel with fixed row offsets;
- MoE: the MXFP4 kernels, whose workspaces depend only on the token count.

A batch of n sequences runs in the smallest bucket >= n; the rows past n are padding that point at
the sinks (page 0, KDA slot 0) and whose outputs are never read. Graphs are captured largest
bucket first into one memory pool, so the smaller ones reuse its memory.

What cannot be captured is refused before anything is captured (`capture_blockers`): the torch
paths of the mixers and experts take lengths and expert ids from the host. A failed capture is an
error, never a silent eager fallback.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from mstar.kernels import kda_fla
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
from mstar.models.kimi_k3.mla import GatedMLA
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel
from mstar.resources.latent_kv import LatentKVPlan
from mstar.spec.schedule import DraftSchedule

log = logging.getLogger(__name__)

SINK = 0  # page 0 and KDA slot 0 are never handed to a request: padding rows write there


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes captured: every size up to 8 (small batches are the latency-bound ones, and
    padding them doubles the expert bytes a step reads), then steps of 8."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: need at least 1")
    return tuple(sorted({*range(1, min(8, max_batch) + 1), *range(8, max_batch + 1, 8), max_batch}))


def capture_blockers(serving: ServingModel) -> list[str]:
    """Why the decode step of this model cannot be captured (empty: it can)."""
    model = serving.model
    param = next(model.parameters())
    if param.device.type != "cuda":
        return [f"the model is on {param.device}, CUDA graphs need a CUDA device"]
    problems = []
    if not isinstance(serving.ops, GpuMixerOps):
        problems.append("the token mixers run the torch path (kernels=torch, or fla-core is not installed)")
    if not model.comm.graph_capturable:
        problems.append(f"the {model.comm.name} communicator's collectives cannot be captured")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if isinstance(attn, GatedMLA) and not GpuMixerOps.mla_kernel_fits(attn, param.dtype, param.device):
            problems.append(f"MLA layer {i} takes the torch path (the kernel needs bf16 and a 64-wide rope "
                            f"part; the model is {param.dtype} with rope {attn.rope})")
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and moe.expert_kernel is None:
            problems.append(f"the routed experts of layer {i} run the torch loop (the MXFP4 kernel needs a bf16 "
                            "model with MXFP4 experts whose widths are multiples of 128)")
    return problems


class StepGraphs:
    """Captured steps of one `ServingModel`: B sequences of `rows` rows each (1: decode; k + 1: verify
    blocks of k drafts), for the batch sizes in `buckets` (see the module doc)."""

    def __init__(self, serving: ServingModel, *, max_batch: int, max_seq_len: int, tap_layers: tuple[int, ...] = (),
                 rows: int = 1, buckets: tuple[int, ...] | None = None):
        self.serving = serving
        self.max_seq_len = max_seq_len
        self.tap_layers = tuple(tap_layers)
        self.rows_per_seq = r = rows
        self.buckets = tuple(buckets) if buckets is not None else decode_buckets(max_batch)
        if r > 1 and r > serving.pool.prefix_x.shape[2]:
            raise ValueError(f"verify blocks of {r} rows exceed the KDA pool's pending-prefix room "
                             f"({serving.pool.prefix_x.shape[2]} rows)")
        device = serving.kv.cache.device
        long = {"dtype": torch.long, "device": device}
        pages = math.ceil(max_seq_len / serving.kv.page_size)
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top * r, **long)
        self.page_table = torch.zeros(top, pages, **long)
        self.slot_mapping = torch.zeros(top * r, **long)
        self.context_lens = torch.full((top,), r, **long)
        self.kda_slots = torch.zeros(top, **long)
        self.rows = torch.arange(top * r, **long)
        # verify steps: row offsets and the KDA block layout of each bucket, staged per step
        self.cu_seqlens = {b: torch.arange(0, b * r + 1, r, **long) for b in self.buckets} if r > 1 else {}
        self.layouts = {b: self._layout((0,) * b, [0] * b) for b in self.buckets} if r > 1 else {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def kind(self) -> str:
        return "decode" if self.rows_per_seq == 1 else f"verify ({self.rows_per_seq - 1} drafts)"

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _layout(self, slots: tuple[int, ...], pending: list[int]):
        """The KDA layout of a verify step of len(slots) blocks, at a fixed capacity per sequence."""
        r, max_block = self.rows_per_seq, self.serving.pool.prefix_x.shape[2]
        return kda_fla.BlockLayout.build(tuple(range(0, len(slots) * r + 1, r)), slots, pending, (True,) * len(slots),
                                         max_block, self.kda_slots.device, capacity=r + max_block)

    def bucket_plan(self, batch: int) -> BatchPlan:
        """The static buffers' first `batch` sequences as a step plan."""
        r, n = self.rows_per_seq, batch * self.rows_per_seq
        kv = LatentKVPlan(self.page_table[:batch], self.slot_mapping[:n], self.context_lens[:batch])
        # num_computed only sizes the MLA decode split count: the longest context any replay may see.
        return BatchPlan(input_ids=self.input_ids[:n], seq_starts=tuple(range(0, n + 1, r)),
                         num_computed=(self.max_seq_len - r,) * batch, kv=kv, kda_slots=self.kda_slots[:batch],
                         sample_rows=self.rows[:n], verify=(True,) * batch if r > 1 else (), decode=r == 1,
                         cu_seqlens=self.cu_seqlens.get(batch), kda_layout=self.layouts.get(batch))

    def capture(self) -> None:
        """Capture every bucket (largest first). Raises, naming the bucket, if any capture fails."""
        blockers = capture_blockers(self.serving)
        if blockers:
            raise RuntimeError(f"CUDA graphs cannot capture this model's {self.kind} step: " + "; ".join(blockers)
                               + ". Set model_kwargs.cuda_graphs=false to serve it eagerly.")
        self._pad(0, self.max_batch)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        start = time.perf_counter()
        for n, bucket in enumerate(reversed(self.buckets), 1):
            plan = self.bucket_plan(bucket)
            try:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # compile and autotune outside the capture
                    self.serving.forward(plan, self.tap_layers)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.serving.forward(plan, self.tap_layers)
            except Exception as e:
                raise RuntimeError(f"capturing the {self.kind} step at batch {bucket} failed: {e}. Set "
                                   "model_kwargs.cuda_graphs=false to serve eagerly.") from e
            self.graphs[bucket] = (graph, outputs)
            log.info("captured the %s graph for batch %d (%d/%d, %.1f s)", self.kind, bucket, n, len(self.buckets),
                     time.perf_counter() - start)
        torch.cuda.synchronize()

    def can_run(self, plan: BatchPlan) -> bool:
        """A plan of this step's shape within the captured sizes, sampling every row (what the graphs
        compute): decode rows, or verify blocks of exactly this many rows."""
        batch, r = len(plan.seq_starts) - 1, self.rows_per_seq
        if self.bucket_for(batch) is None or plan.sample_rows.numel() != batch * r:
            return False
        if plan.kv.page_table.shape[1] > self.page_table.shape[1]:
            return False
        if r == 1:
            return plan.decode
        return (len(plan.verify) == batch and all(plan.verify)
                and all(plan.seq_starts[b + 1] - plan.seq_starts[b] == r for b in range(batch)))

    def run(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ServingModel.forward(plan, tap_layers)` by replay. The outputs are views of the graph's
        buffers: valid until the next replay."""
        if not self.can_run(plan):
            raise ValueError(f"StepGraphs.run takes {self.kind} plans of at most {self.max_batch} sequences that "
                             "sample every row (check can_run first)")
        batch, bucket = self.stage(plan)
        graph, (logits, taps) = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        n = batch * self.rows_per_seq
        return logits[:n], (taps[:n] if taps is not None else None)

    def stage(self, plan: BatchPlan) -> tuple[int, int]:
        """Copy `plan` into the step buffers, padding up to its bucket; (batch, bucket). After this,
        `bucket_plan(bucket)` is the step a replay runs."""
        batch = len(plan.seq_starts) - 1
        bucket = self.bucket_for(batch)
        n, width = batch * self.rows_per_seq, plan.kv.page_table.shape[1]
        self.input_ids[:n].copy_(plan.input_ids)
        self.page_table[:batch, :width].copy_(plan.kv.page_table)
        self.page_table[:batch, width:].zero_()
        self.slot_mapping[:n].copy_(plan.kv.slot_mapping)
        self.context_lens[:batch].copy_(plan.kv.context_lens)
        self.kda_slots[:batch].copy_(plan.kda_slots)
        self._pad(batch, bucket)
        if self.rows_per_seq > 1:  # the pending prefixes of this step (host bookkeeping), padding on the sink
            slots = plan.host_slots() + (SINK,) * (bucket - batch)
            pool = self.serving.pool
            self.layouts[bucket].copy_(self._layout(slots, [pool.prefix_len[s] for s in slots]))
        return batch, bucket

    def _pad(self, start: int, end: int) -> None:
        """Sequences start..end-1 become padding: token 0 at the first positions of the sink page and slot."""
        if start == end:
            return
        r = self.rows_per_seq
        for buffer, scale in ((self.input_ids, r), (self.slot_mapping, r), (self.kda_slots, 1)):
            buffer[start * scale:end * scale] = SINK
        self.page_table[start:end] = SINK
        self.context_lens[start:end] = r


def verify_graphs(serving: ServingModel, schedule: DraftSchedule, *, max_batch: int, max_seq_len: int,
                  tap_layers: tuple[int, ...]) -> list[StepGraphs]:
    """One StepGraphs per draft count the schedule uses, over the decode buckets whose batch sizes it
    serves (a batch runs in the smallest of them that fits)."""
    buckets = decode_buckets(max_batch)
    by_drafts: dict[int, set[int]] = {}
    for n in range(1, max_batch + 1):
        k = schedule.drafts_for(n)
        if k:
            by_drafts.setdefault(k, set()).add(next(b for b in buckets if b >= n))
    return [StepGraphs(serving, max_batch=max_batch, max_seq_len=max_seq_len, tap_layers=tap_layers, rows=k + 1,
                       buckets=tuple(sorted(sizes))) for k, sizes in sorted(by_drafts.items())]


class GraphedServing:
    """A `ServingModel` whose decode and verify steps replay captured graphs; every other step runs eagerly.

    Tensor-parallel ranks wrap their own ServingModel the same way, and each takes the same branch
    for the same plan, so their collectives stay in step."""

    def __init__(self, serving: ServingModel, graphs: list[StepGraphs]):
        self.serving = serving
        self.graphs = graphs
        self.model, self.pool, self.kv = serving.model, serving.pool, serving.kv

    def forward(self, plan: BatchPlan, tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        for graphs in self.graphs:
            if tuple(tap_layers) == graphs.tap_layers and graphs.can_run(plan):
                return graphs.run(plan)
        return self.serving.forward(plan, tap_layers)
