"""Decode CUDA graphs, the parts that run anywhere: buckets, the capture check, and the engine's
`decode` flag on plans (which steps a graph may replay). tests/test_gpu_cuda_graphs.py replays them."""

import torch

from mstar.engine.core import EngineConfig, EngineCore
from mstar.engine.cuda_graphs import capture_blockers, decode_buckets
from mstar.engine.params import SamplingParams
from mstar.engine.scheduler import SchedulerConfig
from mstar.engine.step import SeqStep, StepDecl
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.recurrent_pool import RecurrentStatePool


def test_buckets_cover_every_batch_size():
    assert decode_buckets(64) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(5) == (1, 2, 3, 4, 5)
    assert decode_buckets(12) == (1, 2, 3, 4, 5, 6, 7, 8, 12)
    for top in (1, 9, 33, 64):
        buckets = decode_buckets(top)
        assert all(any(b >= n for b in buckets) for n in range(1, top + 1)) and buckets[-1] == top


def test_a_cpu_model_is_refused_with_the_reason(tiny_model, tiny_dir):
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), EngineConfig(max_seq_len=256, cuda_graphs=True))
    assert core.graphs is None  # no effect on CPU
    assert any("CUDA device" in p for p in capture_blockers(core.serving))


def test_pending_prefix_is_seen_per_step():
    pool = RecurrentStatePool(1, 4, 2, 4, 4, torch.float32, torch.float32, max_block=3, hidden_size=8)
    a, b = StepDecl((SeqStep("a", 0, (1,), True),)), StepDecl((SeqStep("b", 0, (1,), True),))
    pool.admit(a)
    pool.admit(b)
    assert not pool.has_pending(a) and not pool.has_pending(b)
    pool.commit(StepDecl((SeqStep("b", 1, (1, 2, 3), True, verify=True, num_drafts=2, accepted=2),)))
    assert pool.has_pending(b) and not pool.has_pending(a)


def test_decode_flag_marks_exactly_the_one_row_steps(tiny_model, tiny_dir):
    cfg = EngineConfig(max_seq_len=256, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40))
    core = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg)
    plans = []
    forward = core.serving.forward
    core.serving.forward = lambda plan, taps=(): (plans.append(plan), forward(plan, taps))[1]
    for i, n in enumerate((3, 70, 1, 12)):
        core.add_request(f"r{i}", list(range(5, 5 + n)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while core.has_work():
        core.step()
    assert any(p.decode for p in plans) and any(not p.decode for p in plans)
    for p in plans:
        one_row = all(p.seq_starts[b + 1] - p.seq_starts[b] == 1 for b in range(len(p.seq_starts) - 1))
        assert p.decode == one_row, (p.seq_starts, p.decode)
        assert p.slot_ids == tuple(p.kda_slots.tolist())  # the host's copy, so that no layer syncs for it
