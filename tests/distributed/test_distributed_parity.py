"""TP2, EP2 and a TP x EP hybrid (4 ranks: 2 expert groups of 2), each also with the latent MoE's
projections sharded, serve the same greedy tokens as the single-rank reference: real gloo processes,
rank 0 in this process driving the engine, followers spawned."""

from __future__ import annotations

import pytest
from engine_run import numbered, run_to_completion
from greedy_ties import assert_greedy_matches, random_jobs

from mstar.config import EngineConfig
from mstar.distributed.worker import Timeouts, start_ranks
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

TIMEOUTS = Timeouts(startup_s=120, control_s=20, collective_s=60, stop_s=10)


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Prompts of 6 to 60 tokens, three of them just short of a page boundary (so the decode rows of a
    full pool need new pages at once and preempt), their output lengths and reference continuations."""
    return random_jobs(tiny_model, (15, 31, 47, 6, 60), max_tokens=(4, 10))


@pytest.mark.parametrize("tp, ep, latent_sharded", [(2, 1, False), (2, 2, False), (4, 2, False), (2, 1, True),
                                                    (4, 2, True)],
                         ids=["tp2", "ep2", "tp4-ep2-hybrid", "tp2-latent-sharded", "tp4-ep2-latent-sharded"])
def test_parallel_greedy_equals_reference(tiny_dir, tiny_model, workload, tp, ep, latent_sharded):
    # A small KV pool and token budget: chunked prefill, mixed steps and preemption all happen.
    engine = EngineConfig(max_seq_len=112, resources={"mla_kv": {"page_size": 16, "max_num_pages": 8},
                                                      "kda_state": {"max_slots": 9}},
                          scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 48})
    core, ranks = start_ranks(tiny_dir, KimiTokenizer.from_dir(tiny_dir), engine, tp_size=tp, ep_size=ep,
                              timeouts=TIMEOUTS, latent_sharded=latent_sharded)
    try:
        got = run_to_completion(core, numbered(workload), max_steps=500).numbered_tokens(len(workload))
        assert_greedy_matches(tiny_model, workload, got, max_tied=1)
        assert core.scheduler.num_preemptions > 0
        assert ranks.failed is None
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.processes] == [0] * (tp - 1)  # STOP ended every follower cleanly


def test_large_prefill_steps_split_their_rows_and_scatter_the_latent(tiny_dir, tiny_model):
    """A first step of 1,024 prompt rows over TP2 sharded-latent ranks runs its AttnRes stream sequence-parallel
    (each rank half the rows) and reduce-scatters the routed latent (both from 512 rows); the later steps, short,
    all-reduce as before. The same greedy tokens as the single rank."""
    from mstar.models.kimi_k3.moe import REDUCE_SCATTER_MIN_TOKENS
    from mstar.models.kimi_k3.sequence_parallel import SEQUENCE_PARALLEL_MIN_ROWS

    assert max(SEQUENCE_PARALLEL_MIN_ROWS, REDUCE_SCATTER_MIN_TOKENS) <= 1024
    workload = random_jobs(tiny_model, (520, 700), max_tokens=(3, 4))
    engine = EngineConfig(max_seq_len=768, resources={"mla_kv": {"page_size": 16, "max_num_pages": 100},
                                                      "kda_state": {"max_slots": 5}},
                          scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 1024})
    core, ranks = start_ranks(tiny_dir, KimiTokenizer.from_dir(tiny_dir), engine, tp_size=2, timeouts=TIMEOUTS,
                              latent_sharded=True)
    try:
        got = run_to_completion(core, numbered(workload), max_steps=50).numbered_tokens(len(workload))
        assert_greedy_matches(tiny_model, workload, got, max_tied=1)
        assert ranks.failed is None
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.processes] == [0]
