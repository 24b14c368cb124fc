"""The GPU mixers' step metadata (models/kimi_k3/step_metadata.py): which KDA path and MLA kernel a step's
layers run, chosen once per step from the plan; the staged kinds' device buffers passed through as they are."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from mstar.kernels import kda_fla, mla_attention
from mstar.kernels.mla_expanded import K3_DIMS
from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind
from mstar.models.kimi_k3.step_metadata import KDAPath, build_metadata
from mstar.resources.latent_kv import LatentKVPlan
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


def with_kv(plan: BatchPlan, context_lens: list[int]) -> BatchPlan:
    """The plan with a kv plan whose context lengths (on the device) are these."""
    return replace(plan, kv=LatentKVPlan(None, None, torch.tensor(context_lens)))


def test_long_prefill_chunks_take_the_expanded_form_where_the_roofline_says():
    """From 341 tokens in one K3 sequence a GENERAL step runs the expanded form; a fresh prompt skips the prefix
    pass; chunks after cached rows get each sequence's prefix length on the device (also a shifted plan's, whose
    positions only the device knows); verify blocks, decode steps and layers without widths keep the absorbed."""
    dims = K3_DIMS
    meta = build_metadata(plan_of([341], [0]), pool_with_pending({}), HEADS, dims)
    assert meta.mla.expanded and meta.mla.prefix_lens is None and meta.mla.max_query_len == 341
    assert not build_metadata(plan_of([340], [0]), pool_with_pending({}), HEADS, dims).mla.expanded
    assert not build_metadata(plan_of([341], [0]), pool_with_pending({}), HEADS).mla.expanded  # no widths given
    q_lens, computed = [400, 1, 1, 37], [100, 50, 7, 0]
    plan = with_kv(plan_of(q_lens, computed), [n + c for n, c in zip(q_lens, computed, strict=True)])
    meta = build_metadata(plan, pool_with_pending({}), HEADS, dims)
    assert meta.mla.expanded and meta.mla.prefix_lens.tolist() == computed
    assert meta.mla.cu_seqlens.tolist() == list(plan.seq_starts)
    assert meta.mla.num_splits == mla_attention.num_splits_for(4, HEADS, 100 + 400, query_rows=400)
    shifted = replace(with_kv(plan_of([500, 1], [0, 0]), [500, 9]), advance=torch.tensor([0, 8]), max_advance=(0, 8))
    assert build_metadata(shifted, pool_with_pending({}), HEADS, dims).mla.prefix_lens.tolist() == [0, 8]
    many_short = plan_of([100] * 8, [0] * 8)
    assert not build_metadata(many_short, pool_with_pending({}), HEADS, dims).mla.expanded
    verify = plan_of([1000, 4], [0, 30], verify=(False, True))
    assert not build_metadata(verify, pool_with_pending({}), HEADS, dims).mla.expanded
    decode = plan_of([1, 1], [3000, 20], kind=StepKind.DECODE)
    assert not build_metadata(decode, pool_with_pending({}), HEADS, dims).mla.expanded


def test_a_captured_prefill_bucket_takes_the_form_of_its_rows_as_one_sequence():
    """A staged prefill bucket decides at capture (its lengths are on the device): 512 rows and more expanded, with
    the prefix lengths computed on the device from the staged offsets and lengths; 256 rows absorbed."""
    cu = torch.tensor([0, 300, 301, 512, 512])  # two chunks, a decode row, the padding sequence, an empty one
    context = [300 + 64, 5000, 0, 0]
    for rows, expanded in ((512, True), (256, False)):
        staged = with_kv(plan_of([rows], [0], kind=StepKind.STAGED_PREFILL, staged=StagedLayout(cu, None, rows)),
                         context)
        mla = build_metadata(staged, pool_with_pending({}), HEADS, K3_DIMS).mla
        assert mla.expanded is expanded and mla.cu_seqlens is cu and mla.num_splits == 1
        assert mla.prefix_lens.tolist() == [64, 4999, 0, 0] if expanded else mla.prefix_lens is None
