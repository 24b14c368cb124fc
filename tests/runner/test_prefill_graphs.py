"""Prefill CUDA graphs (mstar/runner/prefill_graphs.py), the parts that run anywhere: the buckets, which
plans a prefill graph takes, the staging into its fixed buffers (padding on the sinks), and the staged
step itself run eagerly through the GPU mixers (their Triton kernels in the interpreter) against the
torch path: one step, and the engine serving prompts through `run`. Capture and replay are
tests/engine/test_gpu_cuda_graphs.py's."""

import copy
import os
from dataclasses import replace

import pytest
import torch
from engine_run import numbered, run_to_completion
from greedy_ties import assert_greedy_matches, random_jobs
from prompt_scores import assert_prompt_logprobs

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams
from mstar.kernels import mla_attention
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
from mstar.models.kimi_k3.mla import GatedMLA
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, TorchMixerOps
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.runner.cuda_graphs import SINK
from mstar.runner.prefill_graphs import MAX_PREFILL_TOKENS, PrefillGraphs, prefill_buckets

PAGE, PAGES_PER_SEQ, SLOTS = 8, 8, 10  # max_seq_len 64
BUCKETS = (16, 32, 64)
MAX_SEQS = 8  # sequences of a captured prefill step (the scheduler's max_prefill_seqs)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the GPU mixers' kernels through Triton's interpreter")


def test_buckets_are_powers_of_two_up_to_the_step_budget():
    assert prefill_buckets(2048) == (256, 512, 1024, 2048)
    assert prefill_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert prefill_buckets(100_000) == (256, 512, 1024, 2048, 4096, MAX_PREFILL_TOKENS)
    assert prefill_buckets(100) == (100,)
    assert prefill_buckets(64, smallest=16) == BUCKETS
    for budget in (1, 255, 256, 257, 5000, 9000):
        buckets = prefill_buckets(budget)
        top = min(budget, MAX_PREFILL_TOKENS)
        assert buckets[-1] == top
        for n in range(1, top + 1):  # every step has a bucket, and pads to less than twice its tokens
            bucket = next(b for b in buckets if b >= n)
            assert bucket == buckets[0] or bucket < 2 * n
    with pytest.raises(ValueError, match="max_tokens=0"):
        prefill_buckets(0)


def pools(cfg):
    la = cfg.linear_attn
    kv = PagedLatentKV(cfg.layer_kinds.count("mla"), 1 + MAX_SEQS * PAGES_PER_SEQ, PAGE, cfg.kv_cache_width,
                       torch.float32)
    pool = RecurrentStatePool(cfg.layer_kinds.count("kda"), SLOTS, la.num_heads, la.head_dim,
                              la.short_conv_kernel_size, torch.float32, torch.float32, hidden_size=cfg.hidden_size,
                              max_block=3)
    kv.cache.normal_()
    pool.state.normal_(0, 0.3)
    pool.conv.normal_()
    return kv, pool


def prefill_plan(cfg, lengths, cached, slots, sample=None):
    """Sequence b: lengths[b] new rows after cached[b] cached ones (a chunked prompt's continuation when
    > 0) on KDA slot slots[b] and pages of its own; its last row sampled where sample[b] (default all)."""
    sample = sample or [True] * len(lengths)
    table = torch.tensor([[1 + s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)] for s in range(len(lengths))])
    starts, written, sample_rows = [0], [], []
    for b, (n, c) in enumerate(zip(lengths, cached, strict=True)):
        positions = torch.arange(c, c + n)
        written.append(table[b, positions // PAGE] * PAGE + positions % PAGE)
        starts.append(starts[-1] + n)
        if sample[b]:
            sample_rows.append(starts[-1] - 1)
    kv = LatentKVPlan(table, torch.cat(written), torch.tensor(lengths) + torch.tensor(cached))
    return BatchPlan(input_ids=torch.randint(0, cfg.vocab_size, (starts[-1],)), seq_starts=tuple(starts),
                     num_computed=tuple(cached), kv=kv, kda_slots=torch.tensor(slots),
                     sample_rows=torch.tensor(sample_rows, dtype=torch.long), verify=(False,) * len(lengths),
                     slot_ids=tuple(slots))


def gpu_mixers(model):
    """The GPU mixers with every MLA layer on the Triton kernels (which a backend picks for bf16 only): the
    interpreter runs them in fp32 too."""
    return GpuMixerOps(frozenset(m for m in model.modules() if isinstance(m, GatedMLA)))


def prefill_graphs(model, tap_layers=()):
    kv, pool = pools(model.config)
    serving = ServingModel(model, kv, pool, gpu_mixers(model))
    return PrefillGraphs(serving, max_tokens=BUCKETS[-1], max_seqs=MAX_SEQS, max_seq_len=PAGE * PAGES_PER_SEQ,
                         tap_layers=tap_layers, buckets=BUCKETS)


def test_a_model_the_graphs_cannot_capture_is_refused_naming_the_step_kind(tiny_model):
    with pytest.raises(RuntimeError, match="cannot capture this model's prefill step: .*CUDA device"):
        prefill_graphs(tiny_model).capture()


def test_which_plans_a_prefill_graph_takes(tiny_model):
    cfg = tiny_model.config
    graphs = prefill_graphs(tiny_model)
    assert [graphs.bucket_for(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]
    ragged = prefill_plan(cfg, [5, 1, 13], [0, 9, 0], (4, 1, 7))
    assert graphs.can_run(ragged)
    assert graphs.can_run(prefill_plan(cfg, [1] * 8, [3] * 8, tuple(range(1, 9))))  # decode rows are rows too
    assert graphs.can_run(prefill_plan(cfg, [60, 4], [0, 0], (1, 2)))  # the largest bucket, exactly
    assert not graphs.can_run(prefill_plan(cfg, [1] * 9, [3] * 9, tuple(range(1, 10))))  # too many sequences
    assert not graphs.can_run(prefill_plan(cfg, [60, 5], [0, 0], (1, 2)))  # too many tokens
    assert not graphs.can_run(replace(ragged, verify=(False, True, False)))
    assert not graphs.can_run(replace(ragged, sample_rows=torch.arange(MAX_SEQS + 1)))
    wide = LatentKVPlan(torch.ones(3, PAGES_PER_SEQ + 1, dtype=torch.long), ragged.kv.slot_mapping,
                        ragged.kv.context_lens)
    assert not graphs.can_run(replace(ragged, kv=wide))  # contexts past max_seq_len
    graphs.serving.pool.prefix_len[1] = 2  # slot 1 has a pending prefix to replay first
    assert not graphs.can_run(ragged)
    graphs.serving.pool.prefix_len[1] = 0
    graphs.stage(ragged)
    assert not graphs.can_run(graphs.bucket_plan(32))  # a staged plan is not a step to stage


def test_staging_pads_the_bucket_with_sinks(tiny_model):
    """The step's values land in the first entries of each buffer; everything after them, up to the bucket,
    points at the sinks, whatever an earlier (larger) step left there."""
    cfg = tiny_model.config
    graphs = prefill_graphs(tiny_model)
    graphs.stage(prefill_plan(cfg, [20, 30, 2, 1, 1], [0, 5, 0, 7, 1], (9, 8, 7, 6, 5)))  # leftovers to overwrite
    plan = prefill_plan(cfg, [5, 1, 13], [0, 9, 0], (4, 1, 7), sample=[True, False, True])
    assert graphs.stage(plan) == 32
    staged = graphs.bucket_plan(32)
    assert staged.input_ids.shape == (32,) and staged.staged.max_query_len == 32
    assert staged.kv.page_table.shape == (MAX_SEQS + 1, PAGES_PER_SEQ)
    assert staged.sample_rows.tolist() == [4, 18] + [0] * (MAX_SEQS - 2)
    assert torch.equal(staged.input_ids, torch.cat([plan.input_ids, torch.zeros(13, dtype=torch.long)]))
    assert staged.kv.slot_mapping.tolist() == plan.kv.slot_mapping.tolist() + [SINK] * 13
    assert torch.equal(staged.kv.page_table[:3], plan.kv.page_table)
    assert (staged.kv.page_table[3:] == SINK).all()
    assert staged.kv.context_lens.tolist() == [5, 10, 13] + [0] * 6  # padding attends to nothing
    assert staged.kda_slots.tolist() == [4, 1, 7] + [SINK] * 6
    layout = staged.staged.kda_layout
    assert staged.staged.cu_seqlens is layout.cu_seqlens and layout.slots.data_ptr() == staged.kda_slots.data_ptr()
    assert layout.cu_seqlens.tolist() == [0, 5, 6, 19] + [32] * 6  # then the padding sequence, then empty ones
    assert layout.lengths.tolist() == [5, 1, 13, 13] + [0] * 5
    assert layout.row_seq.tolist() == [0] * 5 + [1] + [2] * 13 + [3] * 13


@interpreted
def test_a_short_page_table_leaves_columns_no_kernel_reads(tiny_model):
    """A step whose page tables are narrower than an earlier step's stages only its own columns (a fill would
    cost a launch every step): the stale page ids past them lie beyond every context, and the step computes
    what the eager step on the narrow plan computes."""
    pytest.importorskip("fla.ops.kda")
    cfg = tiny_model.config
    graphs = prefill_graphs(tiny_model)
    serving = graphs.serving
    wide = prefill_plan(cfg, [20, 3], [0, 0], (1, 2))
    wide = replace(wide, kv=replace(wide.kv, page_table=wide.kv.page_table.flip(0)))  # row 0: other pages
    graphs.stage(wide)
    plan = prefill_plan(cfg, [4], [0], (3,))
    plan = replace(plan, kv=LatentKVPlan(plan.kv.page_table[:, :1], plan.kv.slot_mapping, plan.kv.context_lens))
    ref_kv, ref_pool = copy.deepcopy(serving.kv), copy.deepcopy(serving.pool)
    expect, _ = ServingModel(tiny_model, ref_kv, ref_pool, TorchMixerOps()).forward(plan)
    capture_eagerly(graphs)
    got, _ = graphs.run(plan)
    assert graphs.page_table[0].tolist() == plan.kv.page_table[0].tolist() + wide.kv.page_table[0, 1:].tolist()
    assert rel(got, expect) < 1e-5, rel(got, expect)


class EagerGraph:
    """A captured graph's stand-in on the CPU: `replay` runs the bucket's staged step eagerly into the
    outputs a capture would return (buffers of the bucket's shapes), so `run` and the engine take every path
    a replay takes. Nothing runs at "capture": in Triton's interpreter each KDA prefill costs seconds."""

    def __init__(self, graphs: PrefillGraphs, bucket: int):
        self.step = lambda: graphs.serving.forward(graphs.bucket_plan(bucket), graphs.tap_layers)
        _, rows, samples = graphs.bucket_shape(bucket)
        cfg = graphs.serving.config
        taps = torch.empty(rows, len(graphs.tap_layers) * cfg.hidden_size) if graphs.tap_layers else None
        self.outputs = (torch.empty(samples, cfg.vocab_size), taps)

    def replay(self):
        for out, new in zip(self.outputs, self.step(), strict=True):
            if out is not None:
                out.fill_(float("nan"))  # what the replay does not write stays poisoned
                out.copy_(new)


def capture_eagerly(graphs: PrefillGraphs) -> None:
    for bucket in reversed(graphs.buckets):
        graph = EagerGraph(graphs, bucket)
        graphs.graphs[bucket] = (graph, graph.outputs)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@interpreted
def test_a_staged_prefill_step_computes_the_eager_step(tiny_model):
    """Three sequences, one a chunked prompt's continuation over its cached pages, one not sampled, through
    stage + the bucket's plan on the GPU mixers (MLA's Triton kernel, the staged KDA layout) against the
    torch mixers on the plan itself: sampled logits, DSpark taps, the KV rows written, every KDA slot's state
    and window but the sink's."""
    pytest.importorskip("fla.ops.kda")
    cfg = tiny_model.config
    graphs = prefill_graphs(tiny_model, tap_layers=(1, 4))
    serving = graphs.serving
    plan = prefill_plan(cfg, [5, 1, 13], [0, 9, 0], (4, 1, 7), sample=[True, False, True])
    ref_kv, ref_pool = copy.deepcopy(serving.kv), copy.deepcopy(serving.pool)
    expect, expect_taps = ServingModel(tiny_model, ref_kv, ref_pool, TorchMixerOps()).forward(plan, (1, 4))
    capture_eagerly(graphs)
    got, taps = graphs.run(plan)
    assert got.shape == expect.shape and taps.shape == expect_taps.shape
    assert rel(got, expect) < 1e-5, rel(got, expect)
    assert rel(taps, expect_taps) < 1e-5, rel(taps, expect_taps)
    (_, (_, all_taps)) = graphs.graphs[32]
    assert torch.isfinite(all_taps).all()  # the padding rows too: they run as a sequence, on the sinks
    rows = plan.kv.slot_mapping
    cache, ref_cache = (c.view(c.shape[0], -1, c.shape[-1]) for c in (serving.kv.cache, ref_kv.cache))
    assert rel(cache[:, rows], ref_cache[:, rows]) < 1e-5
    for name in ("state", "conv"):
        assert rel(getattr(serving.pool, name)[:, 1:], getattr(ref_pool, name)[:, 1:]) < 1e-5, name
    assert graphs.replays == 1


@interpreted
def test_the_padding_sequence_attends_to_nothing_and_empty_ones_are_harmless():
    """The MLA multi-row kernel over a staged layout: the real sequences' rows equal the reference, the
    padding sequence (context 0) comes out zero, the empty sequences write nothing."""
    torch.manual_seed(0)
    heads, latent, rope, rows = 4, 64, 16, 24
    cache = torch.randn(12, PAGE, latent + rope)
    contexts = [5, 12, 9]  # of 5, 1 and 9 rows: the second a continuation
    layout_cu = torch.tensor([0, 5, 6, 15, rows, rows, rows])  # then a padding sequence of 9 rows, two empty
    table = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 7, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    lens = torch.tensor(contexts + [0, 0, 0])
    q = torch.randn(rows, heads, latent + rope)
    out = torch.full((rows, heads, latent), float("nan"))
    mla_attention.paged_mla_prefill(q[..., :latent], q[..., latent:], cache, table, layout_cu, lens, 0.1, out,
                                    max_query_len=rows)
    expect = mla_attention.paged_mla_prefill_reference(q[:15], cache, table[:3], layout_cu[:4], lens[:3], 0.1,
                                                       rope_dim=rope)
    assert rel(out[:15], expect) < 1e-5
    assert (out[15:] == 0).all()


def staged_engine(tiny_model, tiny_dir) -> tuple[EngineCore, PrefillGraphs, list]:
    """An engine (fp32 tiny model, chunked prefill with a 32-token budget) whose prefill steps run through
    PrefillGraphs.run over eager stand-ins of the graphs; the list collects the plans it staged."""
    cfg = EngineConfig(max_seq_len=PAGE * PAGES_PER_SEQ, resources={"mla_kv": {"page_size": PAGE, "max_num_pages": 40},
                                                                    "kda_state": {"max_slots": 5}},
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 32})
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg)
    core.runner.serving.ops = gpu_mixers(tiny_model)
    graphs = PrefillGraphs(core.runner.serving, max_tokens=32, max_seqs=cfg.scheduler.max_prefill_seqs,
                           max_seq_len=cfg.max_seq_len, buckets=(16, 32))
    capture_eagerly(graphs)
    staged = []
    run = graphs.run
    graphs.run = lambda plan: (staged.append(plan), run(plan))[1]
    core.runner.graphs = [graphs]
    return core, graphs, staged


@interpreted
def test_the_engine_prefills_through_staged_steps_like_the_reference(tiny_model, tiny_dir):
    """The engine (fp32 tiny model, chunked prefill with a 32-token budget) with its prefill steps run
    through PrefillGraphs.run over eager stand-ins of the graphs: greedy tokens equal the reference's, and
    chunked continuations went through the staged steps."""
    pytest.importorskip("fla.ops.kda")
    jobs = random_jobs(tiny_model, (3, 45, 20), (2, 3))
    core, graphs, staged = staged_engine(tiny_model, tiny_dir)
    got = run_to_completion(core, numbered(jobs)).numbered_tokens(len(jobs))
    rows = [(c, p.seq_starts[b + 1] - p.seq_starts[b]) for p in staged for b, c in enumerate(p.num_computed)]
    assert any(cached and n > 1 for cached, n in rows)  # a chunked prompt's continuation ran staged
    assert graphs.replays == len(staged) > 0
    assert_greedy_matches(tiny_model, jobs, got)


@interpreted
def test_staged_prefill_steps_score_prompt_rows_like_the_reference(tiny_model, tiny_dir):
    """Requests with prompt_logprobs whose logits rows (prompt rows and sampled rows) fit a graph's max_seqs
    rows replay staged steps too (the others run eagerly): their scores equal the reference's."""
    pytest.importorskip("fla.ops.kda")
    prompts = [p for p, _, _ in random_jobs(tiny_model, (3, 5, 20), (1, 1))]
    core, graphs, staged = staged_engine(tiny_model, tiny_dir)
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)) for i, p in enumerate(prompts)]
    out = run_to_completion(core, jobs, per_step=1).outputs
    assert any(p.sample_rows.shape[0] > len(p.seq_starts) - 1 for p in staged)  # prompt rows replayed
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs(tiny_model, prompt, out[f"r{i}"][0].prompt_logprobs, 2, 1e-4)
