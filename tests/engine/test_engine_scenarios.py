"""Random engine scenarios: the features combined as users combine them, against the greedy reference.

Each scenario draws async scheduling on or off, DSpark off, with the oracle draft (every accepted length
occurs) or the tiny draft, the prefix cache on or off with its page size and snapshot interval, pools small
enough to preempt or large, the batch and token budget, requests with a shared system prompt or not, with
prompt_logprobs and logprobs or not, arriving all at once or a few per step, and sometimes an abort. Every
request that is not aborted must give the reference's greedy tokens (ties excepted) and its prompt scores,
and the pools must end empty. The features' own tests check each one alone, and their chosen corners
(test_async_speculation.py's preemption while a verify block is in flight, which no random scenario here
reliably reaches); these look for what only a combination breaks. The scenarios are fresh each run; a
failure names its seed: `scenario(tiny_model, tokenizer, draft, SEED)`.
"""

from __future__ import annotations

import random

import pytest
from engine_run import run_to_completion
from greedy_ties import assert_greedy_matches
from prompt_scores import assert_prompt_logprobs

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.speculative.oracle import OracleSpeculation

MAX_SEQ_LEN = 128
SCENARIOS = 4  # per run (~10 s each on one core)


def scenario_config(rng: random.Random, num_requests: int, tokens_needed: int) -> tuple[EngineConfig, str | None]:
    """An engine config of random features, and the drafter (None, "oracle" or "dspark")."""
    drafter = rng.choice([None, "oracle", "dspark"])
    drafts = rng.choice([2, 4]) if drafter else 0
    cache = rng.random() < 0.6
    page = rng.choice([4, 8, 16])
    seqs = rng.choice([2, 4, 8])
    # From a third of what the requests need (preemption) to plenty; never less than one full sequence.
    pages = max(rng.choice([tokens_needed // page // 3 + 8, tokens_needed // page + 2 * num_requests, 512]),
                MAX_SEQ_LEN // page + 4)
    slots = max(rng.choice([num_requests + 1, 4, 9, 16]), seqs + 1)  # the spare ones hold cache snapshots
    budget = max(rng.choice([16, 32, 64]), seqs * (drafts + 1))
    cfg = EngineConfig(max_seq_len=MAX_SEQ_LEN,
                       resources={"mla_kv": {"page_size": page, "max_num_pages": pages},
                                  "kda_state": {"max_slots": slots}},
                       scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": budget},
                       prefix_cache={"enabled": cache, "kda_snapshot_interval": page * rng.choice([1, 2])},
                       model_kwargs={"speculative_tokens": drafts, "async_scheduling": rng.random() < 0.6,
                                     "cuda_graphs": False})
    return cfg, drafter


def scenario(model, tokenizer, draft, seed: int) -> None:
    rng = random.Random(seed)
    vocab = model.config.vocab_size - 256
    system = [rng.randrange(vocab) for _ in range(rng.randint(5, 40))]
    jobs = []
    for i in range(rng.randint(2, 7)):
        own = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0, ignore_eos=True,
                                prompt_logprobs=rng.choice([None, None, None, 1, 3]),
                                logprobs=rng.choice([None, None, 2]))
        jobs.append((f"r{i}", system + own if rng.random() < 0.5 else own, params))
    cfg, drafter = scenario_config(rng, len(jobs), sum(len(p) + s.max_tokens for _, p, s in jobs))
    engine = EngineCore(model, tokenizer, cfg, SpeculativeModels(draft) if drafter else None)
    if drafter == "oracle":
        truths = {rid: p + greedy_generate(model, p, s.max_tokens + 8) for rid, p, s in jobs}
        engine.spec = OracleSpeculation(engine.spec, truths, rng.choice([0.1, 0.3, 0.6]), seed=seed)
    aborts = {f"r{rng.randrange(len(jobs))}": rng.randint(1, 10)} if rng.random() < 0.3 else {}

    def abort_due(step: int) -> None:
        for request_id, at in aborts.items():
            if at == step:
                engine.abort_request(request_id)

    run = run_to_completion(engine, jobs, per_step=rng.choice([1, 2, len(jobs)]), before_step=abort_due)
    kept = [(rid, p, s) for rid, p, s in jobs if rid not in aborts]
    assert all(len(run.tokens(rid)) == s.max_tokens for rid, _, s in kept)
    assert_greedy_matches(model, [(p, s.max_tokens, greedy_generate(model, p, s.max_tokens)) for _, p, s in kept],
                          [run.tokens(rid) for rid, _, _ in kept], max_tied=1)
    for rid, prompt, params in kept:
        if params.prompt_logprobs is not None:
            [scores] = [o.prompt_logprobs for o in run.outputs[rid] if o.prompt_logprobs is not None]
            assert_prompt_logprobs(model, prompt, scores, params.prompt_logprobs)
    pools = [engine.kv] + ([engine.spec.proposer.kv] if engine.spec else [])
    assert all(kv.allocator.num_used == 0 and not kv.pages for kv in pools)
    assert engine.pool.num_used == 0 and not engine.requests and not engine.scheduler.has_work()


@pytest.mark.parametrize("index", range(SCENARIOS))
def test_a_random_scenario_gives_the_reference_tokens(tiny_model, tokenizer, draft, index):
    seed = random.randrange(1 << 30)
    try:
        scenario(tiny_model, tokenizer, draft, seed)
    except AssertionError as e:
        raise AssertionError(f"scenario seed {seed}: {e}") from e
