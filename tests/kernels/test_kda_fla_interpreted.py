"""The GPU KDA path (models/kimi_k3/gpu_ops.py over mstar/kernels/kda_fla.py: fla's recurrent kernel, our
block kernels, the one-launch decode step of kda_decode.py, stacked projections and the one-launch head norm
(`fused`), host-indexed state pool) run on the CPU through Triton's interpreter in fp32, against the torch
mixer. It catches layout and indexing
bugs before the GPU does (a strided beta that fla read as contiguous gave 5% error here). On a GPU
machine the same paths run in tests/kernels/test_gpu_kda.py."""

import copy
import os
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (no GPU)")

fla_kda = pytest.importorskip("fla.ops.kda")
from engine_run import numbered, run_to_completion  # noqa: E402

from mstar.kernels import kda_decode, kda_fla  # noqa: E402
from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps  # noqa: E402
from mstar.models.kimi_k3.kda import KimiDeltaAttention  # noqa: E402
from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind, TorchMixerOps  # noqa: E402
from mstar.resources.recurrent_pool import RecurrentStatePool  # noqa: E402
from mstar.tools.make_tiny import k3_fixture  # noqa: E402

HEADS, HEAD_DIM, HIDDEN, SLOTS = 4, 16, 64, 9


def layer_and_pool():
    raw = k3_fixture()
    t = raw["text_config"]
    t.update(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    t["linear_attn_config"].update(head_dim=HEAD_DIM, num_heads=HEADS, kda_layers=[1], full_attn_layers=[2])
    attn = KimiDeltaAttention(parse_config(raw), 0).requires_grad_(False)
    with torch.no_grad():
        for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d):
            conv.weight.normal_(0, 0.5)
        attn.dt_bias.normal_(-3, 0.5)
    pool = RecurrentStatePool(1, SLOTS, HEADS, HEAD_DIM, 4, torch.float32, torch.float32, hidden_size=HIDDEN,
                              max_block=8)
    pool.state.normal_(0, 0.3)
    pool.conv.normal_()
    pool.prefix_x.normal_()
    return attn, pool


def staged(plan: BatchPlan, layout) -> StagedLayout:
    """`layout` as a staged step's KDA layout (the row offsets are the plan's: only the MLA kernel reads them)."""
    return StagedLayout(torch.tensor(plan.seq_starts), layout)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def step_against_torch(attn, pool, lengths, verify, slots, **shift):
    """A step of sequences with `lengths` rows on `slots`, random rows x, and what the torch mixer makes of
    it on a copy of the pool: (plan, x, the copy after the step, the torch output). `shift`: the plan's
    advance and max_advance."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    plan = BatchPlan(input_ids=None, seq_starts=tuple(starts), num_computed=(0,) * len(lengths), kv=None,
                     kda_slots=torch.tensor(slots), sample_rows=None, verify=verify, slot_ids=slots, **shift)
    ref = copy.deepcopy(pool)
    x = torch.randn(starts[-1], HIDDEN)
    return plan, x, ref, TorchMixerOps().kda(attn, 0, x, plan, ref)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("max_rows", [kda_decode.DECODE_STEP_MAX_ROWS, 0])
def test_decode_writes_the_pool_in_place_like_torch(stacked, max_rows, monkeypatch):
    """A decode step, slots out of order: kda_decode.decode_step after the input projections, or (past its row
    bound, forced here by a bound of 0) the chain of launches of larger batches (kda_fla.decode)."""
    monkeypatch.setattr(kda_decode, "DECODE_STEP_MAX_ROWS", max_rows)
    attn, pool = layer_and_pool()
    slots = (7, 2, 5, 1)
    plan = BatchPlan(input_ids=None, seq_starts=(0, 1, 2, 3, 4), num_computed=(9,) * 4, kv=None,
                     kda_slots=torch.tensor(slots), sample_rows=None, kind=StepKind.DECODE, slot_ids=slots)
    ref = copy.deepcopy(pool)
    x = torch.randn(4, HIDDEN)
    expect = TorchMixerOps().kda(attn, 0, x, plan, ref)
    y = GpuMixerOps(fused=stacked).kda(attn, 0, x, plan, pool)
    assert rel(y, expect) < 1e-5
    assert rel(pool.state, ref.state) < 1e-5 and rel(pool.conv, ref.conv) < 1e-5  # untouched slots included


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("longest", [13, 40])
def test_ragged_step_with_verify_rows_and_pending_prefixes_matches_torch(stacked, longest):
    """Prefill chunks, a decode row and verify blocks in one step, through GpuMixerOps' choice of path (a
    40-row prompt: the ragged fla path; else the short-block kernels); slots 5 and 6 first replay an
    accepted pending prefix of 3 rows; verify blocks stay pending (inputs kept, the state not folded)."""
    attn, pool = layer_and_pool()
    lengths = [1, 5, longest, 1, 8]
    verify = (False, False, False, True, True)
    slots = (3, 1, 8, 5, 6)
    for slot in (5, 6):
        pool.prefix_len[slot] = 3
    plan, x, ref, expect = step_against_torch(attn, pool, lengths, verify, slots)
    y = GpuMixerOps(fused=stacked).kda(attn, 0, x, plan, pool)
    assert rel(y, expect) < 1e-5
    for name in ("state", "conv", "prefix_x"):
        assert rel(getattr(pool, name), getattr(ref, name)) < 1e-5, name


@pytest.mark.parametrize("stacked", [False, True])
def test_short_blocks_fold_the_prefix_in_one_pass_like_torch(stacked):
    """A staged short-block layout (kernels/kda_blocks.py): verify blocks after an accepted pending prefix, a verify
    block without one, a decode row after a prefix, an ordinary short prompt; states, windows and pending
    prefixes of every slot end as the torch mixer leaves them (slot 4 gets a prefix of all 3 rows)."""
    attn, pool = layer_and_pool()
    lengths = [4, 4, 1, 7, 4]
    verify = (True, True, False, False, True)
    slots = (5, 2, 6, 8, 4)
    for slot, n in ((5, 2), (6, 3), (4, 3)):
        pool.prefix_len[slot] = n
    plan, x, ref, expect = step_against_torch(attn, pool, lengths, verify, slots)
    layout = kda_fla.BlockLayout.build(plan.seq_starts, slots, [pool.prefix_len[s] for s in slots], verify,
                                       pool.prefix_x.shape[2], x.device)
    blocks = replace(plan, kind=StepKind.STAGED_BLOCKS, staged=staged(plan, layout))
    y = GpuMixerOps(fused=stacked).kda(attn, 0, x, blocks, pool)
    assert rel(y, expect) < 1e-5, rel(y, expect)
    for name in ("state", "conv", "prefix_x"):
        assert rel(getattr(pool, name), getattr(ref, name)) < 1e-5, name


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("capacity", [None, 12], ids=["eager", "captured"])
def test_pending_prefixes_known_only_on_the_device_match_torch(stacked, capacity):
    """A step planned while the verify step before it runs (async scheduling): each slot's pending prefix is
    its prefix_len (the anchor row) plus the drafts that step keeps, `advance`, on the device only, at most
    `max_advance`. The layout is sized by those bounds and places the rows on the device, compact (an eager
    step) or at a fixed capacity (a captured one); the step ends as the torch mixer (which reads advance back)
    leaves it: outputs, states, windows and the next pending prefixes."""
    attn, pool = layer_and_pool()
    lengths = [4, 4, 1, 4]
    verify = (True, True, False, True)
    slots = (5, 2, 6, 4)
    for slot in (5, 2, 4):
        pool.prefix_len[slot] = 1
    advance, bounds = torch.tensor([2, 0, 0, 3]), (3, 3, 0, 3)
    plan, x, ref, expect = step_against_torch(attn, pool, lengths, verify, slots, advance=advance,
                                              max_advance=bounds)
    if capacity is not None:
        pending, exact = plan.pending_bounds(pool)
        assert pending == [4, 4, 0, 4] and exact.tolist() == [3, 1, 0, 4]
        layout = kda_fla.BlockLayout.build(plan.seq_starts, slots, pending, verify, pool.prefix_x.shape[2], x.device,
                                           capacity=capacity, exact_pending=exact)
        plan = replace(plan, kind=StepKind.STAGED_BLOCKS, staged=staged(plan, layout))
    y = GpuMixerOps(fused=stacked).kda(attn, 0, x, plan, pool)
    assert rel(y, expect) < 1e-5, rel(y, expect)
    for name in ("state", "conv", "prefix_x"):
        assert rel(getattr(pool, name), getattr(ref, name)) < 1e-5, name


@pytest.mark.parametrize("stacked", [False, True])
def test_equal_verify_blocks_with_a_derived_layout_match_torch(stacked):
    """A captured verify step stages only each block's pending prefix (on the device, while the step before
    decides it); the layout is derived from those and the slots (`BlockLayout.equal_blocks`): the step ends
    as the torch mixer leaves it."""
    attn, pool = layer_and_pool()
    slots = (5, 2, 4)
    for slot in slots:
        pool.prefix_len[slot] = 1
    advance, bounds = torch.tensor([2, 0, 3]), (3, 3, 3)
    plan, x, ref, expect = step_against_torch(attn, pool, [4, 4, 4], (True,) * 3, slots, advance=advance,
                                              max_advance=bounds)
    _, exact = plan.pending_bounds(pool)
    plan = replace(plan, kind=StepKind.STAGED_BLOCKS,
                   staged=StagedLayout(torch.tensor(plan.seq_starts), None, pending=exact))
    y = GpuMixerOps(fused=stacked).kda(attn, 0, x, plan, pool)
    assert rel(y, expect) < 1e-5, rel(y, expect)
    for name in ("state", "conv", "prefix_x"):
        assert rel(getattr(pool, name), getattr(ref, name)) < 1e-5, name


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize(("lengths", "num_rows"), [([5, 1, 13], 24), ([2, 7, 1, 3, 9, 1, 4, 6], 33), ([6, 2], 8)])
def test_a_staged_prefill_step_matches_torch(stacked, lengths, num_rows):
    """A staged PrefillLayout of at most 8 sequences over num_rows rows: ragged sequences
    (shorter than the conv window too) continue their slots' states and windows; the rows past them form a
    padding sequence on the sink slot, the sequences after it are empty (their offsets what fla's graph
    mode takes). Outputs, states and windows of every slot but the sink end as the torch mixer leaves them,
    though the layout came from device tensors alone."""
    attn, pool = layer_and_pool()
    slots = (7, 2, 5, 1, 8, 3, 4, 6)[: len(lengths)]
    plan, x, ref, expect = step_against_torch(attn, pool, lengths, (), slots)
    n = x.shape[0]
    layout = kda_fla.PrefillLayout.allocate(num_rows, torch.zeros(9, dtype=torch.long))
    layout.slots[: len(slots)] = torch.tensor(slots)  # the padding sequence and the empty ones: the sink, 0
    layout.stage(torch.tensor(plan.seq_starts))
    assert layout.num_seqs == 9
    assert layout.cu_seqlens.tolist() == [*plan.seq_starts] + [num_rows] * (9 - len(lengths))
    padding = [len(lengths)] * (num_rows - n)  # the padding sequence follows the step's
    assert layout.row_seq.tolist() == [b for b, m in enumerate(lengths) for _ in range(m)] + padding
    padded = torch.cat([x, torch.randn(num_rows - n, HIDDEN)])
    prefill = replace(plan, kind=StepKind.STAGED_PREFILL, staged=staged(plan, layout))
    y = GpuMixerOps(fused=stacked).kda(attn, 0, padded, prefill, pool)
    assert y.shape == padded.shape and torch.isfinite(y).all()
    assert rel(y[:n], expect) < 1e-5, rel(y[:n], expect)
    for name in ("state", "conv"):  # slot 0 is the sink, which the padding sequence wrote
        assert rel(getattr(pool, name)[:, 1:], getattr(ref, name)[:, 1:]) < 1e-5, name


def served_through_gpu_kda(tiny_model, tiny_dir, lengths, max_tokens, cfg, draft=None):
    """Greedy jobs of random prompts of `lengths` served by an engine on the tiny fp32 model whose KDA layers run
    through GpuMixerOps (by the interpreter here; CUDA picks it on a GPU): (the engine, the jobs, the tokens)."""
    import random

    from mstar.engine.core import EngineCore, SpeculativeModels
    from mstar.models.kimi_k3.generate import greedy_generate
    from mstar.models.kimi_k3.tokenizer import KimiTokenizer

    rng = random.Random()
    jobs = []
    for n in lengths:
        prompt = [rng.randrange(1000) for _ in range(n)]
        jobs.append((prompt, max_tokens, greedy_generate(tiny_model, prompt, max_tokens)))
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg,
                      None if draft is None else SpeculativeModels(draft))
    core.runner.serving.ops = GpuMixerOps()
    return core, jobs, run_to_completion(core, numbered(jobs)).numbered_tokens(len(jobs))


def test_served_speculative_greedy_through_the_gpu_kda_paths_equals_the_reference(tiny_model, tiny_dirs):
    """The engine with DSpark (k=3) on the tiny fp32 model, its KDA layers through GpuMixerOps (decode,
    short-block verify with pending prefixes, ragged prefill) run by the interpreter: greedy tokens
    equal the reference's."""
    from greedy_ties import assert_greedy_matches

    from mstar.config import EngineConfig
    from mstar.models.dspark.model import K3DSparkModel

    draft = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=torch.float32)
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 8, "max_num_pages": 200},
                                                   "kda_state": {"max_slots": 5}},
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64},
                       model_kwargs={"speculative_tokens": 3})
    core, jobs, got = served_through_gpu_kda(tiny_model, tiny_dirs[0], (2, 20, 45), 8, cfg, draft)
    assert core.spec.num_rows > 0  # verify steps ran
    assert_greedy_matches(tiny_model, jobs, got)


def test_served_greedy_decode_through_the_decode_kernel_equals_the_reference(tiny_model, tiny_dir):
    """The engine without speculation on the tiny fp32 model, its KDA layers through GpuMixerOps run by the
    interpreter: its decode steps (batches of up to 3 sequences) take kda_decode.decode_step; greedy tokens
    equal the reference's."""
    from greedy_ties import assert_greedy_matches

    from mstar.config import EngineConfig

    cfg = EngineConfig(max_seq_len=64, resources={"mla_kv": {"page_size": 8, "max_num_pages": 40},
                                                  "kda_state": {"max_slots": 5}},
                       scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 64})
    _, jobs, got = served_through_gpu_kda(tiny_model, tiny_dir, (3, 9, 17), 6, cfg)
    assert_greedy_matches(tiny_model, jobs, got)



@pytest.mark.parametrize(("lengths", "num_rows"), [([70, 3, 129], 256), ([64], 64), ([5, 1], 96)])
def test_the_staged_chunk_table_reaches_fla_as_chunk_kda_builds_it(lengths, num_rows, monkeypatch):
    """The captured prefill's chunked KDA calls fla's forward steps (q/k L2 norms, beta's sigmoid, chunk_kda_fwd)
    with the arguments chunk_kda(use_graph=True) gives them, its chunk table the one the layout staged once for the
    step rather than one built per call. fla's kernels autotune, which the interpreter cannot: the steps are
    recorded here (stand-ins of torch arithmetic), and tests/kernels/test_gpu_kda.py compares the outputs bit for
    bit on a GPU. The table of a smaller bucket is fla's too."""
    import fla.modules.norm.l2norm
    import fla.ops.common.gate
    import fla.ops.kda.chunk
    import fla.ops.kda.chunk_fwd
    from fla.ops.utils.index import prepare_chunk_indices_static
    from kda_chunk_table import chunk_kda_both_ways

    calls = []

    def chunk_kda_fwd(**kwargs):
        calls.append(kwargs)
        return (kwargs["q"] + kwargs["v"], kwargs["initial_state"] * 2, *[None] * 10)

    def l2norm_fwd(x):
        return x * 3, None

    def fused_beta_sigmoid(x, scale):
        return torch.sigmoid(x) * scale

    for module in (fla.ops.kda.chunk, fla.ops.kda.chunk_fwd, fla.modules.norm.l2norm, fla.ops.common.gate):
        for name, fake in (("chunk_kda_fwd", chunk_kda_fwd), ("l2norm_fwd", l2norm_fwd),
                           ("fused_beta_sigmoid", fused_beta_sigmoid)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)
    layout, theirs, ours = chunk_kda_both_ways("cpu", torch.float16, lengths, num_rows)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    (given, taken) = calls
    assert given.keys() - {"cu_seqlens_cpu", "disable_recompute", "return_intermediate_states", "cp_context",
                           "state_v_first"} == taken.keys()
    for key, value in taken.items():
        assert torch.equal(value, given[key]) if isinstance(value, torch.Tensor) else value == given[key], key
    smaller = layout.first_rows(num_rows // 2)
    smaller.stage(torch.tensor([0, num_rows // 2]))
    indices, offsets = prepare_chunk_indices_static(smaller.cu_seqlens, kda_fla.FLA_CHUNK,
                                                    smaller.chunk_indices.shape[0])
    assert torch.equal(smaller.chunk_indices, indices) and torch.equal(smaller.chunk_offsets, offsets)
