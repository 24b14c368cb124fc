"""DSpark speculative decoding on tensor- and expert-parallel ranks: rank 0 drafts (with whole-vocabulary
heads), every rank verifies, and greedy output equals the single-rank reference.

- in one process: a follower that only applies rank 0's step messages mirrors rank 0's caches and KDA
  state through verify steps with accepted drafts (the pending prefix lengths travel in the messages);
- real gloo processes: TP2, EP2 and TP4 x EP2 with the real tiny draft, concurrent requests, preemption;
  rank 0's draft context equals the one made from the single-rank model's taps;
- mstar-serve over HTTP with configs/kimi_k3_tiny_tp2_dspark.yaml; then a follower killed mid-request ends
  rank 0 within 10 s, naming the rank in the log, and the client is told its step failed.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
from engine_run import numbered, run_to_completion
from greedy_ties import assert_greedy_matches, random_jobs
from live_server import start_mstar_serve
from paths import ROOT
from processes import descendants, is_spawned_rank
from test_distributed_lifecycle import Stream
from test_distributed_sharding import _Healthy, _Recorder

from mstar.config import EngineConfig
from mstar.distributed.loader import load_vocab_heads
from mstar.distributed.worker import (
    EXIT_RANK_FAILED,
    LeaderExecutor,
    Timeouts,
    follower_runner,
    follower_speculative,
    pool_geometry,
    start_ranks,
)
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.speculative.oracle import OracleSpeculation

CONFIG = ROOT / "configs" / "kimi_k3_tiny_tp2_dspark.yaml"
TIMEOUTS = Timeouts(startup_s=120, control_s=20, collective_s=60, stop_s=10)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Prompts of 6 to 60 tokens, three just short of a page boundary, their output lengths and reference
    continuations. The first three alone outgrow the 7 pages of `SMALL_ENGINE` as they decode: preemption
    is certain."""
    return random_jobs(tiny_model, (15, 31, 47, 6, 60), max_tokens=(20, 24))


# A small KV pool and token budget: chunked prefill, mixed steps, verify blocks and preemption all happen.
SMALL_ENGINE = EngineConfig(
    max_seq_len=112,
    resources={"mla_kv": {"page_size": 16, "max_num_pages": 8}, "kda_state": {"max_slots": 9}},
    scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 48},
    model_kwargs={"speculative_tokens": 3},
)


def run(core: EngineCore, workload, after_step=lambda: None) -> list[list[int]]:
    run = run_to_completion(core, numbered(workload, lambda n: SamplingParams(max_tokens=n, **GREEDY)),
                            after_step=after_step, max_steps=500)
    return run.numbered_tokens(len(workload))


def test_whole_vocab_heads_are_the_checkpoints(tiny_dir, tiny_model):
    embed, lm_head = load_vocab_heads(tiny_dir)
    assert torch.equal(embed.weight, tiny_model.model.embed_tokens.weight)
    assert torch.equal(lm_head.weight, tiny_model.lm_head.weight)


def test_a_follower_keeps_the_draft_taps_for_its_decode_graphs(draft):
    """Without the draft, a follower still knows which taps rank 0's steps compute, so that its decode
    graphs are captured with them and it replays the same steps rank 0 replays."""
    spec = follower_speculative(SpeculativeModels(draft))
    assert spec.draft is None and spec.heads is None
    assert spec.taps() == tuple(draft.config.target_layer_ids) == SpeculativeModels(draft).taps()


def test_follower_mirrors_rank0_through_verify_steps(tiny_model, tokenizer, draft, workload):
    """Every cache, KDA state and pending prefix of a follower that only applies rank 0's step messages equals
    rank 0's after every step, through verify steps that accept some drafts (an oracle draft errs at a quarter
    of the positions) and preemption. The follower gets no draft, yet its pools hold verify blocks of k + 1 rows."""
    core = EngineCore(tiny_model, tokenizer, SMALL_ENGINE, SpeculativeModels(draft))
    references = {f"r{i}": prompt + ref for i, (prompt, _, ref) in enumerate(workload)}
    core.spec = OracleSpeculation(core.spec, references, error_rate=0.25)
    channel = _Recorder()
    core.executor = LeaderExecutor(core.executor, core.pool, _Healthy(), channel)
    follower = follower_runner(tiny_model, SMALL_ENGINE, follower_speculative(SpeculativeModels(draft)))
    assert pool_geometry(follower.kv, follower.pool) == pool_geometry(core.kv, core.pool)
    assert follower.pool.prefix_x.shape[2] == 3 + 1

    def mirror():
        channel.replay_new(follower)
        for ours, theirs in (
            (core.pool.state, follower.pool.state),
            (core.pool.conv, follower.pool.conv),
            (core.pool.prefix_x, follower.pool.prefix_x),
            (core.kv.cache, follower.kv.cache),
        ):
            assert torch.equal(ours, theirs)

    outputs = run(core, workload, mirror)
    assert_greedy_matches(tiny_model, workload, outputs, max_tied=1)
    assert 0 < core.spec.num_accepted < core.spec.num_drafted
    assert max(max(m.prefix_lens, default=0) for m in channel.messages) > 1  # accepted drafts replayed
    assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2)], ids=["tp2", "ep2", "tp4-ep2-hybrid"])
def test_parallel_dspark_greedy_equals_reference(tiny_dir, tiny_model, tokenizer, draft, workload, tp, ep):
    core, ranks = start_ranks(tiny_dir, tokenizer, SMALL_ENGINE, SpeculativeModels(draft), tp_size=tp, ep_size=ep,
                              timeouts=TIMEOUTS)
    try:
        outputs = run(core, workload)
        assert_greedy_matches(tiny_model, workload, outputs, max_tied=1)
        stats = core.stats()
        assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens > 0  # rank 0 drafted, every rank verified
        assert core.scheduler.num_preemptions > 0
        assert ranks.failed is None
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.processes] == [0] * (tp - 1)  # STOP ended every follower cleanly


def test_rank0_draft_context_comes_from_the_whole_models_taps(tiny_dir, tiny_model, tokenizer, draft):
    """Rank 0's taps are the residual stream, complete on every rank after each all-reduce: the draft's context
    rows on TP2 rank 0 equal those made from the single-rank model's taps."""
    core, ranks = start_ranks(tiny_dir, tokenizer, SMALL_ENGINE, SpeculativeModels(draft), tp_size=2, timeouts=TIMEOUTS)
    try:
        core.add_request("a", list(range(5, 45)), SamplingParams(max_tokens=20, **GREEDY))
        for _ in range(6):
            core.step()
        request = core.requests["a"]
        n = request.num_computed
        assert n > 40  # prefill rows and verified decode rows
        ids = torch.tensor((request.prompt_ids + request.output_ids)[:n])
        expect = draft.context_kv(tiny_model(ids, tap_layers=draft.config.target_layer_ids).taps, torch.arange(n))
        kv = core.spec.proposer.kv
        for layer, rows in enumerate(expect):
            torch.testing.assert_close(kv.rows(layer, torch.tensor(kv.pages["a"]), n), rows, rtol=1e-4, atol=1e-4)
    finally:
        ranks.stop()


def test_mstar_serve_tp2_dspark_greedy_over_http_then_a_dead_follower_ends_it(tiny_dirs, tiny_model):
    target_dir, draft_dir = tiny_dirs
    proc, url = start_mstar_serve(
        [
            "--config",
            str(CONFIG),
            "--tensor-comm-protocol",
            "GLOO",
            f"checkpoint={target_dir}",
            f"model_kwargs.speculative_draft={draft_dir}",
            "max_seq_len=512",
            "resources.mla_kv.max_num_pages=64",
            "resources.dspark_kv.max_num_pages=64",
        ]
    )
    try:
        prompt = list(range(5, 45))
        body = {"model": "kimi_k3_tiny", "prompt": prompt, "max_tokens": 16, "return_token_ids": True, **GREEDY}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == greedy_generate(tiny_model, prompt, 16)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        name = "mstar_spec_decode_num_draft_tokens_total{"
        drafted = next(line for line in metrics.splitlines() if line.startswith(name))
        assert float(drafted.split()[1]) > 0, "the server did not speculate"

        # A follower dies mid-request (an OOM kill, a GPU fault), on this server rather than one of its own.
        stream = Stream(url, list(range(3, 20)), max_tokens=400)
        stream.start()
        assert stream.first.wait(60)
        [follower] = [pid for pid in descendants(proc.pid) if is_spawned_rank(pid)]
        start = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        status = proc.wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
    log = proc.stdout.read()
    assert status == EXIT_RANK_FAILED, log
    assert elapsed < 10, f"rank 0 took {elapsed:.1f} s to stop"
    assert f"rank 1 (pid {follower}) exited with status -9" in log
    stream.join(10)
    assert not stream.is_alive(), "the client was left waiting"
    # The client is told its step failed; which rank died (and its pid) is the operator's, in the log above.
    assert stream.finish_reason != "length" and "internal error in the engine step" in (stream.error or ""), \
        stream.error
    assert "pid" not in stream.error and "failing the requests in flight: cmpl-" in log
