"""DSpark speculative decoding in the engine: greedy output with speculation equals without, the
draft's context rows are exactly the accepted positions, and the KDA state is never rolled back."""

import random

import pytest
import torch
from engine_run import greedy, numbered, run_to_completion
from greedy_ties import assert_greedy_matches

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.speculative.oracle import OracleSpeculation


@pytest.fixture(scope="module")
def jobs(tiny_model):
    rng = random.Random()
    out = []
    for n in [1, 3, 9, 16, 17, 40, 90, 150]:
        prompt = [rng.randrange(1000) for _ in range(n)]
        max_tokens = rng.randint(5, 30)
        out.append((prompt, max_tokens, greedy_generate(tiny_model, prompt, max_tokens)))
    return out


def make_engine(model, tokenizer, draft, k, schedule=(), mixed_prefill_decode=True, **sched):
    cfg = EngineConfig(max_seq_len=512, resources={"mla_kv": {"page_size": 8, "max_num_pages": 400},
                                                   "kda_state": {"max_slots": 9}},
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 96, **sched},
                       model_kwargs={"speculative_tokens": k, "speculative_schedule": schedule,
                                     "mixed_prefill_decode": mixed_prefill_decode})
    return EngineCore(model, tokenizer, cfg, SpeculativeModels(draft) if k else None)


def run(engine, jobs, params=greedy):
    result = run_to_completion(engine, numbered(jobs, params), per_step=1, max_steps=3000)
    return result.numbered_tokens(len(jobs)), result.steps


def oracle_engine(model, tokenizer, draft, jobs, k, error_rate, schedule=(), **sched):
    engine = make_engine(model, tokenizer, draft, k=k, schedule=schedule, **sched)
    references = {f"r{i}": p + ref for i, (p, _, ref) in enumerate(jobs)}
    engine.spec = OracleSpeculation(engine.spec, references, error_rate)
    return engine


def assert_pools_empty(engine):
    assert engine.kv.allocator.num_used == 0 and engine.pool.num_used == 0
    assert engine.spec.proposer.kv.allocator.num_used == 0 and not engine.spec.proposer.kv.pages


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("mixed", [True, False])
def test_oracle_drafts_match_reference(tiny_model, tokenizer, draft, jobs, k, mixed):
    engine = oracle_engine(tiny_model, tokenizer, draft, jobs, k, error_rate=0.25, mixed_prefill_decode=mixed)
    outputs, _ = run(engine, jobs)
    assert_greedy_matches(tiny_model, jobs, outputs, max_tied=1)
    assert 0 < engine.spec.num_accepted < engine.spec.num_drafted
    assert_pools_empty(engine)


def test_schedule_switches_k_as_the_batch_grows_and_shrinks(tiny_model, tokenizer, draft, jobs):
    # Staggered lengths (40..75 tokens) keep all 8 requests decoding together for a while, so the batch
    # grows through every bucket, then shrinks through them again as requests finish.
    jobs = [(p, mt, greedy_generate(tiny_model, p, mt)) for (p, _, _), mt in zip(jobs, range(40, 80, 5), strict=True)]
    schedule = ((2, 7), (4, 4), (6, 1), (8, 0))
    engine = oracle_engine(tiny_model, tokenizer, draft, jobs, 7, error_rate=0.1, schedule=schedule)
    seen = set()
    real_schedule = engine.scheduler.schedule

    def spy():
        decl = real_schedule()
        if decl is not None:
            verify = [s for s in decl.seqs if s.verify]
            if verify:  # the schedule's drafts for this batch (rows near max_tokens draft fewer)
                seen.add((len(verify), engine.spec.schedule.drafts_for(len(verify))))
        return decl

    engine.scheduler.schedule = spy
    outputs, _ = run(engine, jobs)
    assert_greedy_matches(tiny_model, jobs, outputs, max_tied=1)
    drafts_used = {k for _, k in seen}
    assert {7, 4, 1, 0}.issubset(drafts_used), seen
    assert_pools_empty(engine)


def test_real_draft_greedy_equals_speculation_off(tiny_model, tokenizer, draft, jobs):
    on, _ = run(make_engine(tiny_model, tokenizer, draft, k=7, schedule=((4, 7), (8, 3))), jobs)
    off, _ = run(make_engine(tiny_model, tokenizer, draft, k=0), jobs)
    assert_greedy_matches(tiny_model, jobs, on, max_tied=1)
    assert_greedy_matches(tiny_model, jobs, off, max_tied=1)


def test_draft_context_rows_are_the_accepted_positions(tiny_model, tokenizer, draft):
    engine = make_engine(tiny_model, tokenizer, draft, k=4)
    prompt = list(range(5, 45))
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    request = engine.requests["a"]
    n = request.num_computed
    assert n > len(prompt)
    ids = torch.tensor((request.prompt_ids + request.output_ids)[:n])
    taps = tiny_model(ids, tap_layers=draft.config.target_layer_ids).taps
    expect = draft.context_kv(taps, torch.arange(n))
    kv = engine.spec.proposer.kv
    pages = torch.tensor(kv.pages["a"])
    for layer, rows in enumerate(expect):
        torch.testing.assert_close(kv.rows(layer, pages, n), rows, rtol=1e-4, atol=1e-4)
    assert kv.lengths["a"] == n == engine.kv.lengths["a"]


def test_sampled_speculation_is_seeded_and_complete(tiny_model, tokenizer, draft, jobs):
    def params(mt):
        return SamplingParams(max_tokens=mt, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)

    a, _ = run(make_engine(tiny_model, tokenizer, draft, k=3), jobs, params)
    b, _ = run(make_engine(tiny_model, tokenizer, draft, k=3), jobs, params)
    assert a == b
    assert [len(x) for x in a] == [mt for _, mt, _ in jobs]
