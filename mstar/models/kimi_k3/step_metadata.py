"""What the GPU token mixers need of a step besides its plan, built once per step by the backend and read by
every layer (as vLLM v1's attention-metadata builders do): which KDA kernel path runs and over which layout,
which MLA kernel runs (decode, the absorbed multi-row kernel, or a prefill step's expanded form), over which
row offsets, with how many context splits.

`build_metadata` is the one builder. A planned step (StepKind.GENERAL, DECODE) gets its metadata from the plan's host
values; a staged kind (a graph's bucket) carries its device buffers in `BatchPlan.staged`, restaged per replay
by runner/, which `build_metadata` wraps (a prefill layout from gpu_ops.GpuMixerOps.capture_prefill_layout), or
derives from them on the device (the equal blocks of a verify graph, inside the graph). So the mixers dispatch
on the metadata alone, and the host work of a step (a KDA block layout, an MLA split count, the row offsets
copied to the device) is done once, not once per layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mstar.kernels import kda_fla, mla_attention
from mstar.kernels.mla_expanded import MLADims, prefers_expanded
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.transfer import to_device

from .serving import BatchPlan, StepKind


class KDAPath(enum.Enum):
    """The KDA kernels a step's layers run (mstar/kernels/kda_fla.py)."""

    DECODE = "decode"  # one row per slot, the state read and written in place by slot
    PREFILL = "prefill"  # a staged prefill layout (kda_fla.PrefillLayout), lengths on the device only
    BLOCKS = "blocks"  # short blocks and their pending prefixes in one pass (kda_fla.BlockLayout)
    VARLEN = "varlen"  # anything else (long prompts among verify blocks): ragged rows, lengths from the host


@dataclass(frozen=True)
class KDAStep:
    path: KDAPath
    layout: kda_fla.BlockLayout | kda_fla.PrefillLayout | None = None  # BLOCKS, PREFILL


@dataclass(frozen=True)
class MLAStep:
    """The decode kernel (one row per sequence) when `cu_seqlens` is None, else the multi-row causal kernel
    over those row offsets with at most `max_query_len` rows per sequence; each context cut in `num_splits`.
    `expanded`: a prefill step in the expanded form instead (mstar/kernels/mla_expanded.py), its prefixes
    (`prefix_lens` [B] on the device: rows cached before each chunk) attended by the absorbed kernel, cut in
    `num_splits`; prefix_lens None: no sequence has one (the host knows it), and that pass is skipped."""

    num_splits: int
    cu_seqlens: torch.Tensor | None = None
    max_query_len: int | None = None
    expanded: bool = False
    prefix_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class StepMetadata:
    kda: KDAStep
    mla: MLAStep | None  # None: no MLA layer runs the kernels


def build_metadata(plan: BatchPlan, pool: RecurrentStatePool, mla_heads: int | None,
                   mla_dims: MLADims | None = None) -> StepMetadata:
    """The step's metadata (`mla_heads`: the heads of the MLA layers the kernels run, None when none do;
    `mla_dims`: their widths, which the choice of the expanded form needs; None: always the absorbed form)."""
    mla = None if mla_heads is None else mla_step(plan, mla_heads, pool.state.device, mla_dims)
    return StepMetadata(kda=kda_step(plan, pool), mla=mla)


def kda_step(plan: BatchPlan, pool: RecurrentStatePool) -> KDAStep:
    """The KDA part: a GENERAL step takes the block path when every sequence with its pending prefix is short
    enough for it (one layout for all its KDA layers), else the ragged one."""
    if plan.kind is StepKind.DECODE:
        return KDAStep(KDAPath.DECODE)
    if plan.kind is StepKind.STAGED_PREFILL:
        return KDAStep(KDAPath.PREFILL, plan.staged.kda_layout)
    if plan.kind is StepKind.STAGED_BLOCKS:
        layout = plan.staged.kda_layout
        if layout is None:  # equal blocks: the layout follows from the staged slots and pending prefixes
            layout = kda_fla.BlockLayout.equal_blocks(plan.kda_slots, plan.staged.pending,
                                                      plan.seq_starts[1] - plan.seq_starts[0], pool.prefix_x.shape[2])
        return KDAStep(KDAPath.BLOCKS, layout)
    slots = plan.host_slots()
    pending, exact = plan.pending_bounds(pool)  # bounds, where a verify step in flight decides them
    longest = max(pending[b] + plan.seq_starts[b + 1] - plan.seq_starts[b] for b in range(len(slots)))
    if longest > kda_fla.RECURRENT_MAX_ROWS:
        return KDAStep(KDAPath.VARLEN)
    layout = kda_fla.BlockLayout.build(plan.seq_starts, slots, pending, plan.verify, pool.prefix_x.shape[2],
                                       pool.state.device, exact_pending=exact)
    return KDAStep(KDAPath.BLOCKS, layout)


def mla_step(plan: BatchPlan, heads: int, device: torch.device, dims: MLADims | None = None) -> MLAStep:
    """The MLA part, for layers of `heads` heads and widths `dims` on `device` (a plan may carry no input ids to take
    it from); the form by `expanded_form`."""
    expanded = dims is not None and expanded_form(plan, dims)
    if plan.kind is StepKind.STAGED_PREFILL:  # its lengths are on the device only
        cu = plan.staged.cu_seqlens
        return MLAStep(num_splits=1, cu_seqlens=cu, max_query_len=plan.staged.max_query_len, expanded=expanded,
                       prefix_lens=prefix_lens(plan, cu) if expanded else None)
    batch = len(plan.num_computed)
    rows = max(plan.seq_starts[b + 1] - plan.seq_starts[b] for b in range(batch))
    # a staged verify bucket's num_computed is the longest context a replay may see: its splits fit any replay
    splits = mla_attention.num_splits_for(batch, heads, max(plan.num_computed) + rows, query_rows=rows)
    if rows == 1:
        return MLAStep(num_splits=splits)
    # verify blocks (and eager chunks): split the context as decode does, for the same reason
    cu = (plan.staged.cu_seqlens if plan.kind is StepKind.STAGED_BLOCKS
          else to_device(plan.seq_starts, torch.long, device))
    # the host knows a fresh prompt has no prefix, unless a verify step in flight moves the positions
    has_prefix = plan.advance is not None or any(plan.num_computed)
    return MLAStep(num_splits=splits, cu_seqlens=cu, max_query_len=rows, expanded=expanded,
                   prefix_lens=prefix_lens(plan, cu) if expanded and has_prefix else None)


def expanded_form(plan: BatchPlan, dims: MLADims) -> bool:
    """Whether a step's MLA layers run the expanded form (mla_expanded.py): a prefill step (no decode-only step,
    no verify block) for which the roofline `prefers_expanded` counts fewer FLOPs than the absorbed form at its
    sequences' query lengths. A captured prefill bucket decides once, at capture, for its rows as one sequence
    (the step buckets are sized for; its lengths are on the device only): at K3's widths the buckets of 512 rows
    and more take it, 256 does not."""
    if plan.kind is StepKind.STAGED_PREFILL:
        rows = plan.staged.max_query_len
        return prefers_expanded([rows], dims, rows=rows)
    if plan.kind is not StepKind.GENERAL or any(plan.verify):
        return False
    starts = plan.seq_starts
    return prefers_expanded([starts[b + 1] - starts[b] for b in range(len(starts) - 1)], dims)


def prefix_lens(plan: BatchPlan, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] rows cached before each sequence's chunk, on the device (context_lens - q_len, at least 0: a bucket's
    padding sequence has no cached row)."""
    return (plan.kv.context_lens - (cu_seqlens[1:] - cu_seqlens[:-1])).clamp_min(0)
