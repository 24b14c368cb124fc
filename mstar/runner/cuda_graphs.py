"""CUDA graphs of serving steps, captured per bucket: decode and verify steps here (`DecodeGraphs`: B
sequences x r rows, r = 1 decode, r = k + 1 a DSpark verify block), prefill steps by token count in
prefill_graphs.py; the runner (model_runner.py) replays them; both through the mechanism of `StepGraphs`.

Eagerly, a K3 step is thousands of small launches (93 layers of norms, AttnRes, projections,
kernels), so the host's launch pace, not the GPU, sets its time. A captured step replays them all with
one launch. Everything a step reads sits in fixed buffers (token ids, page table, slot mapping,
context lengths, KDA slots, the rows to sample, row offsets, KDA layouts or prefixes) that `run` fills before
each replay; the kernels take their shapes from the bucket and their lengths from those buffers, so
one capture serves any step that fits its bucket:

- KDA: decode reads and writes state and conv windows in place by slot (kda_decode.decode_step); verify
  blocks run [accepted prefix ; block] per sequence from a layout that the graph derives from the staged
  slots and pending-prefix lengths (kda_fla.BlockLayout.equal_blocks: a fixed capacity per sequence,
  kda_fla.block_recurrence); prefill
  steps from a layout of padded row offsets (kda_fla.PrefillLayout, kda_fla.prefill);
- MLA: the paged decode kernel with a split count fixed for `max_seq_len` (a shorter context uses
  fewer of the splits); verify blocks and prefill steps the multi-row kernel with fixed row offsets;
- MoE: the MXFP4 kernels, whose workspaces and branches depend only on the token count.

A step runs in the smallest bucket that holds it; the sequences and rows past it are padding that
point at the sinks (page 0, KDA slot 0) and whose outputs are never read. Graphs are captured largest
first into one memory pool (`capture_all` shares it between the decode, verify and prefill graphs), so
the smaller ones reuse its memory.

What cannot be captured is refused before anything is captured (`capture_blockers`): the torch
paths of the mixers and experts take lengths and expert ids from the host. A failed capture is an
error, never a silent eager fallback.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod

import torch

from mstar.models.kimi_k3.gpu_ops import GpuLayerOps, GpuMixerOps
from mstar.models.kimi_k3.mla import GatedMLA
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, StagedLayout, StepKind
from mstar.resources.latent_kv import LatentKVPlan
from mstar.resources.transfer import to_device
from mstar.speculative.schedule import DraftSchedule

log = logging.getLogger(__name__)

SINK = 0  # page 0 and KDA slot 0 are never handed to a request: padding rows write there


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes captured: every size up to 8 (small batches are the latency-bound ones, and
    padding them doubles the expert bytes a step reads), then steps of 8."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: need at least 1")
    return tuple(sorted({*range(1, min(8, max_batch) + 1), *range(8, max_batch + 1, 8), max_batch}))


def capture_blockers(serving: ServingModel) -> list[str]:
    """Why the steps of this model cannot be captured (empty: they can)."""
    model = serving.model
    param = next(model.parameters())
    if param.device.type != "cuda":
        return [f"the model is on {param.device}, CUDA graphs need a CUDA device"]
    problems = []
    if not isinstance(serving.ops, GpuMixerOps):
        problems.append("the token mixers run the torch path (kernels=torch, or fla-core is not installed)")
    if not model.comm.graph_capturable:
        problems.append(f"the {model.comm.name} communicator's collectives cannot be captured")
    experts = serving.layer_ops.experts if isinstance(serving.layer_ops, GpuLayerOps) else {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if isinstance(attn, GatedMLA) and attn not in getattr(serving.ops, "mla_layers", ()):
            problems.append(f"MLA layer {i} takes the torch path (the kernel needs bf16 and latent and rope parts "
                            f"that are powers of two >= 16; the model is {param.dtype} with latent "
                            f"{attn.kv_lora_rank} and rope {attn.rope})")
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and moe not in experts:
            problems.append(f"the routed experts of layer {i} run the torch loop (the MXFP4 kernel needs a bf16 "
                            "model with MXFP4 experts whose widths are multiples of 128)")
    return problems


class StepGraphs(ABC):
    """Captured steps of one `ServingModel`, one graph per bucket: the mechanism every step kind shares.

    A subclass says what a bucket holds (`bucket_shape`), what the buckets bound (`size_of`), which plans
    it takes (`can_run`), its bucket's plan (`bucket_plan`, built on `_views`) and what its steps stage
    besides the common buffers (`_stage_layout`). The buffers are sized for the largest bucket and a
    bucket's plan is views of their first entries, so its graph reads whatever `stage` put there."""

    kind = "step"
    unit = "sequences"  # what a bucket counts
    pad_context = 0  # cached rows a padding sequence attends to

    def __init__(self, serving: ServingModel, buckets: tuple[int, ...], *, max_seq_len: int,
                 tap_layers: tuple[int, ...] = ()):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"{type(self).__name__}: buckets must be positive sizes, got {buckets}")
        self.serving = serving
        self.buckets = tuple(sorted(set(buckets)))
        self.max_seq_len = max_seq_len
        self.tap_layers = tuple(tap_layers)
        seqs, rows, samples = self.bucket_shape(self.buckets[-1])  # every shape grows with the bucket
        long = {"dtype": torch.long, "device": serving.kv.cache.device}
        self.input_ids = torch.zeros(rows, **long)
        self.slot_mapping = torch.zeros(rows, **long)
        self.page_table = torch.zeros(seqs, math.ceil(max_seq_len / serving.kv.page_size), **long)
        self.context_lens = torch.zeros(seqs, **long)
        self.kda_slots = torch.zeros(seqs, **long)
        self.sample_rows = torch.zeros(samples, **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.replays = 0

    @abstractmethod
    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        """(sequences, rows, sampled rows) of the bucket's step."""

    @abstractmethod
    def size_of(self, plan: BatchPlan) -> int:
        """The size of `plan` that the buckets bound."""

    @abstractmethod
    def can_run(self, plan: BatchPlan) -> bool:
        """Whether a replay computes `plan` (its kind and shape, within the captured sizes)."""

    @abstractmethod
    def bucket_plan(self, bucket: int) -> BatchPlan:
        """The step a replay of the bucket's graph runs: the staged buffers as a plan."""

    @abstractmethod
    def _stage_layout(self, bucket: int, plan: BatchPlan | None) -> None:
        """Stage what this kind's steps read besides the common buffers (plan None: the bucket's padding)."""

    def bucket_for(self, size: int) -> int | None:
        return next((b for b in self.buckets if b >= size), None)

    def _views(self, bucket: int) -> dict:
        """The common buffers' first entries for the bucket, as BatchPlan fields."""
        seqs, rows, samples = self.bucket_shape(bucket)
        kv = LatentKVPlan(self.page_table[:seqs], self.slot_mapping[:rows], self.context_lens[:seqs])
        return {"input_ids": self.input_ids[:rows], "kv": kv, "kda_slots": self.kda_slots[:seqs],
                "sample_rows": self.sample_rows[:samples]}

    def capture(self, pool: object | None = None) -> None:
        """Capture every bucket, largest first, into `pool` (a new one when None). Raises, naming the
        bucket, if any capture fails."""
        blockers = capture_blockers(self.serving)
        if blockers:
            raise RuntimeError(f"CUDA graphs cannot capture this model's {self.kind} step: " + "; ".join(blockers)
                               + ". Set model_kwargs.cuda_graphs=false to serve it eagerly.")
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        start = time.perf_counter()
        for n, bucket in enumerate(reversed(self.buckets), 1):
            self._stage_padding(bucket)
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
                raise RuntimeError(f"capturing the {self.kind} step at {bucket} {self.unit} failed: {e}. Set "
                                   "model_kwargs.cuda_graphs=false to serve eagerly.") from e
            self.graphs[bucket] = (graph, outputs)
            log.info("captured the %s graph for %d %s (%d/%d, %.1f s)", self.kind, bucket, self.unit, n,
                     len(self.buckets), time.perf_counter() - start)
        torch.cuda.synchronize()

    def run(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ServingModel.forward(plan, tap_layers)` by replay. The outputs are views of the graph's
        buffers: valid until the next replay of any graph captured into the same memory pool."""
        if not self.can_run(plan):
            raise ValueError(f"{type(self).__name__}.run takes {self.kind} plans of at most {self.buckets[-1]} "
                             f"{self.unit} (check can_run first)")
        graph, (logits, taps) = self.graphs[self.stage(plan)]
        graph.replay()
        self.replays += 1
        return logits[: plan.sample_rows.shape[0]], (taps[: plan.input_ids.shape[0]] if taps is not None else None)

    def stage(self, plan: BatchPlan) -> int:
        """Copy `plan` into the step buffers, padding up to its bucket, which it returns: after this,
        `bucket_plan(bucket)` is the step a replay runs. Device-to-device copies and fills only: the host
        never waits for a step in flight."""
        bucket = self.bucket_for(self.size_of(plan))
        batch, n, k = len(plan.seq_starts) - 1, plan.input_ids.shape[0], plan.sample_rows.shape[0]
        width = plan.kv.page_table.shape[1]
        self.input_ids[:n].copy_(plan.input_ids)
        self.slot_mapping[:n].copy_(plan.kv.slot_mapping)
        # Columns past `width` keep an earlier step's page ids: the kernels read a sequence's table only below its
        # context length, which its first `width` pages hold (a fill would cost the host a launch every step).
        self.page_table[:batch, :width].copy_(plan.kv.page_table)
        self.context_lens[:batch].copy_(plan.kv.context_lens)
        self.kda_slots[:batch].copy_(plan.kda_slots)
        self.sample_rows[:k].copy_(plan.sample_rows)
        self._pad(bucket, batch, n, k)
        self._stage_layout(bucket, plan)
        return bucket

    def _stage_padding(self, bucket: int) -> None:
        """The bucket's step made of padding alone (what is captured)."""
        self._pad(bucket, 0, 0, 0)
        self._stage_layout(bucket, None)

    def _pad(self, bucket: int, seqs: int, rows: int, samples: int) -> None:
        """The bucket's sequences, rows and sampled rows from these on become padding: token 0 written to
        the sink page's first row, the sink slot, `pad_context` cached rows, row 0 sampled."""
        all_seqs, all_rows, all_samples = self.bucket_shape(bucket)
        # a full bucket has nothing to pad: each fill would still cost the host a dispatch
        if rows < all_rows:
            self.input_ids[rows:all_rows] = 0
            self.slot_mapping[rows:all_rows] = SINK
        if seqs < all_seqs:
            self.page_table[seqs:all_seqs] = SINK
            self.context_lens[seqs:all_seqs] = self.pad_context
            self.kda_slots[seqs:all_seqs] = SINK
        if samples < all_samples:
            self.sample_rows[samples:all_samples] = 0


class DecodeGraphs(StepGraphs):
    """Captured decode and verify steps: B sequences of `rows` rows each (1: decode; k + 1: verify
    blocks of k drafts), every row sampled, for the batch sizes in `buckets` (default `decode_buckets`)."""

    def __init__(self, serving: ServingModel, *, max_batch: int, max_seq_len: int, tap_layers: tuple[int, ...] = (),
                 rows: int = 1, buckets: tuple[int, ...] | None = None):
        self.rows_per_seq = r = rows
        if r > 1 and r > serving.pool.prefix_x.shape[2]:
            raise ValueError(f"verify blocks of {r} rows exceed the KDA pool's pending-prefix room "
                             f"({serving.pool.prefix_x.shape[2]} rows)")
        self.pad_context = r  # a padding sequence attends to its own rows
        super().__init__(serving, buckets if buckets is not None else decode_buckets(max_batch),
                         max_seq_len=max_seq_len, tap_layers=tap_layers)
        device = self.input_ids.device
        # verify steps: row offsets of each bucket, and each block's pending KDA prefix, staged per step (the
        # graph derives the blocks' KDA layout from these and the slots)
        self.cu_seqlens = {b: torch.arange(0, b * r + 1, r, device=device) for b in self.buckets} if r > 1 else {}
        self.pending = torch.zeros(self.buckets[-1], dtype=torch.long, device=device) if r > 1 else None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def kind(self) -> str:
        return "decode" if self.rows_per_seq == 1 else f"verify ({self.rows_per_seq - 1} drafts)"

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        return bucket, bucket * self.rows_per_seq, bucket * self.rows_per_seq

    def size_of(self, plan: BatchPlan) -> int:
        return len(plan.seq_starts) - 1

    def bucket_plan(self, bucket: int) -> BatchPlan:
        r, n = self.rows_per_seq, bucket * self.rows_per_seq
        # num_computed only sizes the MLA decode split count: the longest context any replay may see.
        return BatchPlan(**self._views(bucket), seq_starts=tuple(range(0, n + 1, r)),
                         num_computed=(self.max_seq_len - r,) * bucket, verify=(True,) * bucket if r > 1 else (),
                         kind=StepKind.DECODE if r == 1 else StepKind.STAGED_BLOCKS,
                         staged=StagedLayout(self.cu_seqlens[bucket], None, pending=self.pending[:bucket])
                         if r > 1 else None)

    def can_run(self, plan: BatchPlan) -> bool:
        """A plan of this step's shape within the captured sizes, sampling every row (what the graphs
        compute): decode rows, or verify blocks of exactly this many rows."""
        batch, r = len(plan.seq_starts) - 1, self.rows_per_seq
        if self.bucket_for(batch) is None or plan.sample_rows.shape[0] != batch * r:
            return False
        if plan.kv.page_table.shape[1] > self.page_table.shape[1]:
            return False
        if r == 1:
            return plan.kind is StepKind.DECODE
        return (len(plan.verify) == batch and all(plan.verify)
                and all(plan.seq_starts[b + 1] - plan.seq_starts[b] == r for b in range(batch)))

    def _stage_layout(self, bucket: int, plan: BatchPlan | None) -> None:
        """The pending prefixes of this step's blocks (host bookkeeping, or on the device while the verify step
        before runs); padding blocks on the sink's."""
        if self.rows_per_seq == 1:
            return
        batch = 0
        if plan is not None:
            known, exact = plan.pending_bounds(self.serving.pool)
            batch = len(known)
            device = self.pending.device
            self.pending[:batch].copy_(exact if exact is not None else to_device(known, torch.long, device))
        if batch < bucket:
            self.pending[batch:bucket] = self.serving.pool.prefix_len[SINK]


def verify_graphs(serving: ServingModel, schedule: DraftSchedule, *, max_batch: int, max_seq_len: int,
                  tap_layers: tuple[int, ...]) -> list[DecodeGraphs]:
    """One DecodeGraphs per draft count the schedule uses, over the decode buckets whose batch sizes it
    serves (a batch runs in the smallest of them that fits)."""
    buckets = decode_buckets(max_batch)
    by_drafts: dict[int, set[int]] = {}
    for n in range(1, max_batch + 1):
        k = schedule.drafts_for(n)
        if k:
            by_drafts.setdefault(k, set()).add(next(b for b in buckets if b >= n))
    return [DecodeGraphs(serving, max_batch=max_batch, max_seq_len=max_seq_len, tap_layers=tap_layers, rows=k + 1,
                         buckets=tuple(sorted(sizes))) for k, sizes in sorted(by_drafts.items())]


def capture_all(graph_sets: list[StepGraphs]) -> None:
    """Capture every set into one memory pool, the set with the largest step (in rows) first: the graphs
    captured after it reuse the memory its intermediates took."""
    pool = torch.cuda.graph_pool_handle()
    for graphs in sorted(graph_sets, key=lambda g: g.bucket_shape(g.buckets[-1])[1], reverse=True):
        graphs.capture(pool)
