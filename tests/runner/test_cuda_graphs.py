"""Decode CUDA graphs, the parts that run anywhere: buckets, the capture check, and the engine's
`decode` flag on plans (which steps a graph may replay). tests/engine/test_gpu_cuda_graphs.py replays them."""

import copy
import os

import pytest
import torch
from engine_run import run_to_completion

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, StepKind, TorchMixerOps
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.step import SeqStep, StepDecl
from mstar.runner.cuda_graphs import DecodeGraphs, capture_blockers, decode_buckets


def test_buckets_cover_every_batch_size():
    assert decode_buckets(64) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(5) == (1, 2, 3, 4, 5)
    assert decode_buckets(12) == (1, 2, 3, 4, 5, 6, 7, 8, 12)
    for top in (1, 9, 33, 64):
        buckets = decode_buckets(top)
        assert all(any(b >= n for b in buckets) for n in range(1, top + 1)) and buckets[-1] == top


def test_a_cpu_model_is_refused_with_the_reason(tiny_model, tiny_dir):
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 64}},
                       model_kwargs={"cuda_graphs": True})
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg)
    assert core.runner.graphs == []  # no effect on CPU
    assert any("CUDA device" in p for p in capture_blockers(core.runner.serving))


def test_pending_prefix_is_seen_per_step():
    pool = RecurrentStatePool(1, 4, 2, 4, 4, torch.float32, torch.float32, max_block=3, hidden_size=8)
    a, b = StepDecl((SeqStep("a", 0, (1,), True),)), StepDecl((SeqStep("b", 0, (1,), True),))
    pool.admit(a)
    pool.admit(b)
    assert not pool.has_pending(a) and not pool.has_pending(b)
    pool.commit(StepDecl((SeqStep("b", 1, (1, 2, 3), True, verify=True, num_drafts=2, accepted=2),)))
    assert pool.has_pending(b) and not pool.has_pending(a)


def test_decode_flag_marks_exactly_the_one_row_steps(tiny_model, tiny_dir):
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 1024}},
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 40})
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg)
    plans = []
    forward = core.runner.forward
    core.runner.forward = lambda plan, taps=(): (plans.append(plan), forward(plan, taps))[1]
    for i, n in enumerate((3, 70, 1, 12)):
        core.add_request(f"r{i}", list(range(5, 5 + n)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    run_to_completion(core)
    decode = [p.kind is StepKind.DECODE for p in plans]
    assert any(decode) and not all(decode)
    for p in plans:
        one_row = all(p.seq_starts[b + 1] - p.seq_starts[b] == 1 for b in range(len(p.seq_starts) - 1))
        assert (p.kind is StepKind.DECODE) == one_row, (p.seq_starts, p.kind)
        assert p.slot_ids == tuple(p.kda_slots.tolist())  # the host's copy, so that no layer syncs for it
    # every step is counted, by shape, as run eagerly (no graphs on a CPU)
    counted = (("decode", "eager", sum(decode)), ("prefill", "eager", len(plans) - sum(decode)))
    assert core.stats().model_steps == counted


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU KDA path through Triton's interpreter")
def test_a_staged_verify_step_runs_the_kda_blocks_of_the_real_one(tiny_model):
    """DecodeGraphs(rows=k+1) stages a verify step into its fixed buffers and layout (padded to its bucket
    with a sink sequence); the KDA layer on that staged plan gives the real rows' outputs, states, windows
    and pending prefixes of the step itself. (The capture is tests/runner/test_gpu_cuda_graphs.py's.)"""
    pytest.importorskip("fla.ops.kda")
    cfg = tiny_model.config
    la, r = cfg.linear_attn, 3
    kv = PagedLatentKV(cfg.layer_kinds.count("mla"), 40, 8, cfg.kv_cache_width, torch.float32)
    pool = RecurrentStatePool(cfg.layer_kinds.count("kda"), 6, la.num_heads, la.head_dim, la.short_conv_kernel_size,
                              torch.float32, torch.float32, hidden_size=cfg.hidden_size, max_block=r)
    pool.state.normal_(0, 0.3)
    pool.conv.normal_()
    pool.prefix_x.normal_()
    slots = (4, 1, 3)
    pool.prefix_len[4], pool.prefix_len[3] = 2, 3  # accepted rows of the last verify blocks
    graphs = DecodeGraphs(ServingModel(tiny_model, kv, pool, GpuMixerOps()), max_batch=4, max_seq_len=64, rows=r,
                        buckets=(4,))
    plan = BatchPlan(input_ids=torch.zeros(9, dtype=torch.long), seq_starts=(0, 3, 6, 9), num_computed=(5, 9, 2),
                     kv=LatentKVPlan(torch.tensor([[1, 2], [3, 4], [5, 0]]), torch.arange(9), torch.tensor([8, 12, 5])),
                     kda_slots=torch.tensor(slots), sample_rows=torch.arange(9), verify=(True,) * 3, slot_ids=slots)
    assert graphs.can_run(plan)
    assert graphs.stage(plan) == 4
    staged = graphs.bucket_plan(4)
    layer = cfg.layer_kinds.index("kda")
    attn = tiny_model.model.layers[layer].self_attn
    ref = copy.deepcopy(pool)
    x = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        expect = TorchMixerOps().kda(attn, 0, x, plan, ref)
        got = GpuMixerOps().kda(attn, 0, torch.cat([x, torch.zeros(r, cfg.hidden_size)]), staged, pool)
    assert float((got[:9] - expect).norm() / expect.norm()) < 1e-5
    for name in ("state", "conv", "prefix_x"):
        real = list(slots)
        a, b = getattr(pool, name)[0, real], getattr(ref, name)[0, real]
        assert float((a - b).norm() / b.norm()) < 1e-5, name
