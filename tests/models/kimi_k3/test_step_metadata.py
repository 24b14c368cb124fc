"""The GPU mixers' step metadata (models/kimi_k3/step_metadata.py): which KDA path and MLA kernel a step's
layers run, chosen once per step from the plan; the staged kinds' device buffers passed through as they are."""

from __future__ import annotations

import random

import torch

from mstar.kernels import kda_fla, mla_attention
from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind
from mstar.models.kimi_k3.step_metadata import KDAPath, build_metadata
from mstar.resources.recurrent_pool import RecurrentStatePool

HEADS = 12


def pool_with_pending(pending: dict[int, int]) -> RecurrentStatePool:
    pool = RecurrentStatePool(1, 9, 2, 8, 4, torch.float32, torch.float32, hidden_size=16, max_block=8)
    for slot, n in pending.items():
        pool.prefix_len[slot] = n
    return pool


def plan_of(lengths: list[int], computed: list[int], verify: tuple[bool, ...] = (), **fields) -> BatchPlan:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    slots = tuple(range(1, len(lengths) + 1))
    return BatchPlan(input_ids=torch.zeros(starts[-1], dtype=torch.long), seq_starts=tuple(starts),
                     num_computed=tuple(computed), kv=None, kda_slots=torch.tensor(slots), sample_rows=None,
                     verify=verify, slot_ids=slots, **fields)


def test_decode_rows_take_the_decode_kernels_with_the_splits_of_the_longest_context():
    contexts = [random.randint(0, 4000) for _ in range(random.randint(1, 16))]
    meta = build_metadata(plan_of([1] * len(contexts), contexts, kind=StepKind.DECODE), pool_with_pending({}), HEADS)
    assert meta.kda.path is KDAPath.DECODE and meta.kda.layout is None
    assert meta.mla.cu_seqlens is None
    assert meta.mla.num_splits == mla_attention.num_splits_for(len(contexts), HEADS, max(contexts) + 1)


def test_short_blocks_share_one_layout_and_the_multi_row_kernel_takes_the_row_offsets():
    """Verify blocks after pending prefixes and a short chunk: the block path, its layout built once for every
    KDA layer, covering each sequence's pending rows; MLA over the plan's row offsets, split for k+1 rows."""
    k = random.randint(1, 7)
    pool = pool_with_pending({1: 2, 2: 1})
    plan = plan_of([k + 1, k + 1, 3], [40, 900, 7], verify=(True, True, False))
    meta = build_metadata(plan, pool, HEADS)
    assert meta.kda.path is KDAPath.BLOCKS
    assert isinstance(meta.kda.layout, kda_fla.BlockLayout)
    layout = meta.kda.layout  # each sequence's [pending prefix ; rows], the chunk's rows folded
    assert (layout.ends - layout.starts).tolist() == [2 + k + 1, 1 + k + 1, 3] and layout.fold.tolist() == [2, 1, 3]
    rows = max(k + 1, 3)  # the longest query of the step: a block, or the 3-row chunk when k = 1
    assert meta.mla.cu_seqlens.tolist() == list(plan.seq_starts) and meta.mla.max_query_len == rows
    assert meta.mla.num_splits == mla_attention.num_splits_for(3, HEADS, 900 + rows, query_rows=rows)


def test_a_sequence_too_long_for_the_block_kernel_sends_the_step_down_the_ragged_path():
    n = kda_fla.RECURRENT_MAX_ROWS + random.randint(1, 100)
    meta = build_metadata(plan_of([1, n], [30, 0]), pool_with_pending({}), HEADS)
    assert meta.kda.path is KDAPath.VARLEN and meta.kda.layout is None
    assert meta.mla.max_query_len == n
    # a pending prefix counts toward the length: a block that fits alone does not with its prefix
    meta = build_metadata(plan_of([8], [30], verify=(True,)), pool_with_pending({1: kda_fla.RECURRENT_MAX_ROWS}),
                          HEADS)
    assert meta.kda.path is KDAPath.VARLEN


def test_staged_steps_read_their_device_buffers():
    blocks_layout, prefill_layout, cu = object(), object(), torch.arange(0, 13, 4)
    blocks = plan_of([4, 4, 4], [100, 100, 100], verify=(True,) * 3, kind=StepKind.STAGED_BLOCKS,
                     staged=StagedLayout(cu, blocks_layout))
    meta = build_metadata(blocks, pool_with_pending({}), HEADS)
    assert meta.kda.path is KDAPath.BLOCKS and meta.kda.layout is blocks_layout
    assert meta.mla.cu_seqlens is cu and meta.mla.max_query_len == 4
    prefill = plan_of([32], [0], kind=StepKind.STAGED_PREFILL, staged=StagedLayout(cu, prefill_layout, 32))
    meta = build_metadata(prefill, pool_with_pending({}), HEADS)
    assert meta.kda.path is KDAPath.PREFILL and meta.kda.layout is prefill_layout
    assert meta.mla.cu_seqlens is cu and meta.mla.max_query_len == 32 and meta.mla.num_splits == 1


def test_without_mla_kernel_layers_there_is_no_mla_metadata():
    assert build_metadata(plan_of([1], [3], kind=StepKind.DECODE), pool_with_pending({}), None).mla is None
