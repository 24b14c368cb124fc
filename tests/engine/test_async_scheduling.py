"""Async scheduling (EngineCore launches step N+1 before it finishes step N) against the synchronous loop:
the same tokens, logprobs, finish reasons and stops, grammar requests' too; the overlap itself; and the one
packed transfer of a step's results against the per-value reads it replaced."""

import json
import random
import re

import pytest
import torch
from engine_run import run_to_completion
from greedy_ties import assert_greedy_matches

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.engine.sampler import gather_logprobs
from mstar.engine.step_results import pack, unpack
from mstar.engine.structured_output import Grammar, choice_grammar
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.serving import StepKind


def make_engine(model, tokenizer, *, overlap, pages=256, slots=9, page_size=8, draft=None,
                mixed_prefill_decode=True, **sched):
    sched = {"max_num_seqs": 8, "max_num_batched_tokens": 64} | sched
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": page_size, "max_num_pages": pages},
                                                   "kda_state": {"max_slots": slots}},
                       scheduler=sched, model_kwargs={"speculative_tokens": 3 if draft is not None else 0,
                                                      "async_scheduling": overlap,
                                                      "mixed_prefill_decode": mixed_prefill_decode})
    return EngineCore(model, tokenizer, cfg, SpeculativeModels(draft) if draft is not None else None)


def drive(engine, jobs, *, arrivals_per_step=1, aborts=None):
    """Add `jobs` ((request id, prompt, params)) a few per step, step until done, abort request id at
    step n for each `aborts[id] = n`; every output of every request, in order."""
    aborts = dict(aborts or {})

    def abort_due(step):
        for request_id in [r for r, at in aborts.items() if at == step]:
            engine.abort_request(request_id)

    return run_to_completion(engine, jobs, per_step=arrivals_per_step, before_step=abort_due, allow_errors=True,
                             max_steps=3000).outputs


def summary(outs):
    """Per request: tokens, text, logprobs, finish reason, stop reason, error."""
    return {rid: ([t for o in os for t in o.new_token_ids], "".join(o.text for o in os),
                  [lp for o in os for lp in (o.logprobs or [])], os[-1].finish_reason, os[-1].stop_reason,
                  os[-1].error) for rid, os in outs.items()}


def assert_same(got, expect):
    """Equal summaries: tokens, text, finish and logprob token ids exactly; logprob values to rounding.
    (The logits of a row depend in their last bits on the batch around it on CPU, as on GPU, and the
    two loops batch differently: async scheduling runs an extra row for a request that stopped.)"""
    assert got.keys() == expect.keys()
    for rid in got:
        (tokens, text, lps, *end), (tokens2, text2, lps2, *end2) = got[rid], expect[rid]
        assert (tokens, text, end) == (tokens2, text2, end2), rid
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in lps] == [(lp.token_id, [t for t, _ in lp.top])
                                                                          for lp in lps2], rid
        values = [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]
        values2 = [v for lp in lps2 for v in (lp.logprob, *(x for _, x in lp.top))]
        assert values == pytest.approx(values2, abs=1e-5), rid


def assert_pools_empty(engine):
    assert engine.kv.allocator.num_used == 0 and not engine.kv.pages
    assert engine.pool.num_used == 0
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine._in_flight is None


@pytest.fixture(scope="module")
def mixed_jobs(tiny_model, tokenizer):
    """Greedy and seeded requests with stop ids, stop strings, logprobs and max_tokens of every kind."""
    rng = random.Random(7)
    vocab = tiny_model.config.vocab_size - 256
    jobs = []
    for i, n in enumerate([1, 3, 9, 17, 40, 70, 5, 120, 2, 33]):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        free_run = greedy_generate(tiny_model, prompt, 12)
        kind = i % 5
        if kind == 0:  # greedy to max_tokens, with logprobs
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, logprobs=3, ignore_eos=True)
        elif kind == 1:  # a stop id mid-way
            params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(free_run[5],), ignore_eos=True)
        elif kind == 2:  # a stop string
            text = tokenizer.decode(free_run)
            params = SamplingParams(max_tokens=20, temperature=0, stop=(text[4:7],) if len(text) >= 7 else (),
                                    ignore_eos=True)
        elif kind == 3:  # seeded sampling with top-p, logprobs
            params = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=1,
                                    ignore_eos=True)
        else:  # seeded sampling, a stop id it may or may not draw
            params = SamplingParams(max_tokens=15, temperature=1.2, top_k=20, seed=i, stop_token_ids=(free_run[3],),
                                    ignore_eos=True)
        jobs.append((f"r{i}", prompt, params))
    return jobs


@pytest.mark.parametrize("sched", [{}, {"mixed_prefill_decode": False}, {"max_num_seqs": 3},
                                   {"chunked_prefill": False, "max_num_batched_tokens": 256}])
def test_async_equals_sync(tiny_model, tokenizer, mixed_jobs, sched):
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, overlap=overlap, **sched)
        results[overlap] = summary(drive(engine, mixed_jobs))
        assert_pools_empty(engine)
    assert_same(results[True], results[False])
    reasons = {s[3] for s in results[True].values()}
    assert {"stop", "length"} <= reasons, reasons  # the workload really stops both ways


def test_async_greedy_equals_reference_under_preemption(tiny_model, tokenizer):
    """Pools so small that decodes preempt (some while their newest token is in flight)."""
    vocab = tiny_model.config.vocab_size - 256
    rng = random.Random(3)
    jobs = []
    for n in (90, 80, 70, 60):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        jobs.append((prompt, 40, greedy_generate(tiny_model, prompt, 40)))
    requests = [(f"r{i}", p, SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True))
                for i, (p, mt, _) in enumerate(jobs)]
    engine = make_engine(tiny_model, tokenizer, overlap=True, pages=33, slots=5, max_num_seqs=4,
                         max_num_batched_tokens=32)
    outs = summary(drive(engine, requests, arrivals_per_step=4))
    assert engine.scheduler.num_preemptions > 0
    assert_greedy_matches(tiny_model, jobs, [outs[f"r{i}"][0] for i in range(len(jobs))], max_tied=1)
    assert_pools_empty(engine)


def test_abort_while_a_step_is_in_flight(tiny_model, tokenizer, mixed_jobs):
    """Aborts between steps (with async scheduling, while the step that decodes the request runs): the
    request ends with "abort" and nothing after it, its neighbours are unchanged, the pools end empty."""
    aborts = {"r1": 4, "r3": 9, "r6": 7}  # r<i> arrives at step i; r6 is aborted while its prefill runs
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, overlap=overlap)
        results[overlap] = summary(drive(engine, mixed_jobs, aborts=aborts))
        assert_pools_empty(engine)
        for rid in aborts:
            assert results[overlap][rid][3] == "abort"
    survivors = [rid for rid in results[True] if rid not in aborts]
    assert_same({rid: results[True][rid] for rid in survivors}, {rid: results[False][rid] for rid in survivors})
    # An aborted request's outputs are a prefix of what it produced without the abort.
    free = summary(drive(make_engine(tiny_model, tokenizer, overlap=True), mixed_jobs))
    for rid in aborts:
        got = results[True][rid][0]
        assert got == free[rid][0][: len(got)]


def test_speculation_runs_the_same_with_async_scheduling_on(tiny_model, tokenizer, draft, mixed_jobs):
    """Speculative steps overlap too (tests/engine/test_async_speculation.py): the same outputs either way."""
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, overlap=overlap, draft=draft)
        results[overlap] = summary(drive(engine, mixed_jobs))
        assert engine.spec.num_drafted > 0
        assert_pools_empty(engine)
    assert_same(results[True], results[False])


def test_speculative_logprobs_are_those_of_the_emitted_tokens(tiny_model, tokenizer, draft):
    """Verify rows pack a token and logprobs per row; each emitted token must get its own row's."""
    prompt = tokenizer.encode("def main():\n    print(")
    params = SamplingParams(max_tokens=14, temperature=0, logprobs=2, ignore_eos=True)
    got = {}
    for spec in (None, draft):
        engine = make_engine(tiny_model, tokenizer, overlap=True, draft=spec)
        got[spec is None] = summary(drive(engine, [("a", prompt, params)]))["a"]
    (plain_tokens, _, plain_lps, *_), (spec_tokens, _, spec_lps, *_) = got[True], got[False]
    assert spec_tokens == plain_tokens
    assert [lp.token_id for lp in spec_lps] == spec_tokens
    for a, b in zip(spec_lps, plain_lps, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_logits_fail_only_that_request(tiny_model, tokenizer, overlap):
    engine = make_engine(tiny_model, tokenizer, overlap=overlap)
    forward = engine.runner.forward

    def poisoned(plan, tap_layers=()):
        logits, taps = forward(plan, tap_layers)
        bad = engine.requests.get("bad")
        # From its fourth token on (tokens sampled before this step, in flight or not): decode steps,
        # one logits row per sequence.
        if bad is not None and bad.num_generated >= 3:
            assert plan.kind is StepKind.DECODE
            logits = logits.clone()
            logits[plan.slot_ids.index(engine.pool.slots["bad"])] = float("nan")
        return logits, taps

    engine.runner.forward = poisoned
    jobs = [("good", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
            ("bad", [4, 5, 6], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))]
    outs = summary(drive(engine, jobs, arrivals_per_step=2))
    assert outs["good"][3] == "length" and len(outs["good"][0]) == 12
    assert_greedy_matches(tiny_model, [([1, 2, 3], 12, greedy_generate(tiny_model, [1, 2, 3], 12))],
                          [outs["good"][0]])
    assert outs["bad"][3] == "error" and "non-finite" in outs["bad"][5]
    assert len(outs["bad"][0]) == 3
    assert_pools_empty(engine)


# --- the overlap itself ---------------------------------------------------------------------------------


def record_events(engine):
    """Log each forward ("forward", its input ids) and each token the engine appends ("append", token)."""
    events = []
    forward, append = engine.runner.forward, engine._append

    def recording_forward(plan, tap_layers=()):
        events.append(("forward", plan.input_ids.tolist()))
        return forward(plan, tap_layers)

    def recording_append(request, tokens, logprobs):
        events.extend(("append", t) for t in tokens)
        return append(request, tokens, logprobs)

    engine.runner.forward = recording_forward
    engine._append = recording_append
    return events


@pytest.mark.parametrize("overlap", [False, True])
def test_the_next_step_is_launched_before_the_last_ones_tokens_reach_the_host(tiny_model, tokenizer, overlap):
    prompt = [5, 6, 7, 8]
    engine = make_engine(tiny_model, tokenizer, overlap=overlap)
    events = record_events(engine)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = drive(engine, [])
    tokens = [t for o in outs["a"] for t in o.new_token_ids]
    assert tokens == greedy_generate(tiny_model, prompt, 4)
    kinds = [kind for kind, _ in events]
    if overlap:
        # Step N+1 (fed N's token on the device) is launched before N's token is appended; a request
        # whose max_tokens are all in flight is not scheduled again.
        assert kinds == ["forward", "forward", "append", "forward", "append", "forward", "append", "append"]
    else:
        assert kinds == ["forward", "append"] * 4
    fed = [ids for kind, ids in events if kind == "forward"]
    assert fed == [prompt] + [[t] for t in tokens[:-1]]


def test_a_stop_costs_one_discarded_row(tiny_model, tokenizer):
    """A stop the host sees only when the token arrives: the next step already computed one more row for
    the request; that row's token is dropped, and the outputs are those of the synchronous loop."""
    prompt = [9, 10, 11]
    free_run = greedy_generate(tiny_model, prompt, 8)
    stop = free_run[2]
    assert stop not in free_run[:2]
    runs = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, overlap=overlap)
        events = record_events(engine)
        engine.add_request("a", prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,),
                                                       ignore_eos=True))
        runs[overlap] = (summary(drive(engine, []))["a"], sum(kind == "forward" for kind, _ in events))
        assert_pools_empty(engine)
    assert runs[True][0] == runs[False][0]
    assert runs[True][0][0] == free_run[:3] and runs[True][0][3] == "stop"
    assert (runs[False][1], runs[True][1]) == (3, 4)


def test_a_request_preempted_with_its_token_in_flight_is_recomputed_with_it(tiny_model, tokenizer):
    """Preempted while the step that samples its newest token runs, a request is re-prefilled at once:
    the prefill's last row is that token, gathered on the device from the step in flight."""
    prompt = list(range(30, 50))
    reference = greedy_generate(tiny_model, prompt, 10)
    engine = make_engine(tiny_model, tokenizer, overlap=True)
    events = record_events(engine)
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))

    def preempt_mid_flight(step):
        if step == 4:
            request = engine.requests["a"]
            assert request.num_inflight == 1 and len(request.output_ids) == 3
            engine.scheduler._preempt(request)

    tokens = run_to_completion(engine, before_step=preempt_mid_flight, max_steps=41).tokens("a")
    assert_greedy_matches(tiny_model, [(prompt, 10, reference)], [tokens])
    fed = [ids for kind, ids in events if kind == "forward"]
    assert prompt + tokens[:4] in fed  # the re-prefill: prompt, three tokens on the host, the one in flight
    assert_pools_empty(engine)


# --- one transfer per step ------------------------------------------------------------------------------


def test_packed_results_read_back_as_the_separate_reads_did():
    """`pack` + `unpack` against what the engine used to read value by value: the finite check, the tokens,
    and per request `gather_logprobs` with its own k (`SampleResult.token_logprobs`)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 4
    logits[2, 17] = float("nan")
    logits[4, 3] = float("inf")
    tokens = torch.randint(0, 300, (6,))
    accepted = torch.tensor([0, 0, 2, 2, 2, 0])
    finite = torch.isfinite(logits).all(-1)
    rows = unpack(pack(finite, tokens, accepted, gather_logprobs(logits, tokens, 5)))
    assert [r.finite for r in rows] == finite.tolist() == [True, True, False, True, False, True]
    assert [r.token for r in rows] == tokens.tolist()
    assert [r.accepted for r in rows] == accepted.tolist()
    for k in (0, 1, 5):
        for i in (0, 1, 3, 5):
            alone = gather_logprobs(logits[i : i + 1], tokens[i : i + 1], k).token_logprobs([k])[0]
            assert rows[i].token_logprob(k) == alone
    plain = unpack(pack(finite, tokens, accepted))
    assert [(r.token, r.logprob, r.top) for r in plain] == [(t, None, ()) for t in tokens.tolist()]


def test_the_serve_config_switches_it(tiny_model, tokenizer, tiny_dir):
    from mstar.config import parse_serve_config

    cfg = parse_serve_config({"model": "kimi_k3", "checkpoint": str(tiny_dir), "max_seq_len": 256, "resources": {
        "mla_kv": {"page_size": 16, "max_num_pages": 17}}})
    assert cfg.model_kwargs.async_scheduling is None  # the engine's default: on CUDA devices, so not here
    assert not EngineCore(tiny_model, tokenizer, cfg)._overlap
    on = cfg.with_overrides("model_kwargs.async_scheduling=true")
    assert EngineCore(tiny_model, tokenizer, on)._overlap
    assert not EngineCore(tiny_model, tokenizer, on.with_overrides("model_kwargs.async_scheduling=false"))._overlap


# --- structured outputs overlap too -----------------------------------------------------------------


@pytest.fixture(scope="module")
def grammar_jobs(tiny_model):
    """Grammar requests of every kind beside plain ones: greedy with logprobs, seeded sampling, penalties,
    a choice that completes within a few tokens while the others go on, a regex cut by max_tokens."""
    rng = random.Random(11)
    vocab = tiny_model.config.vocab_size - 256
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                         "required": ["n", "s"], "additionalProperties": False})
    params = [
        SamplingParams(max_tokens=40, temperature=0, logprobs=2, grammar=Grammar("json_schema", schema, "g")),
        SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=3,
                       grammar=Grammar("regex", "[a-z]{3,9}-[0-9]+", "g")),
        SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                       grammar=Grammar("regex", "([a-c]{2} ){2,6}", "g")),
        SamplingParams(max_tokens=20, temperature=0.8, seed=9, grammar=choice_grammar(["yes", "no"], "g")),
        SamplingParams(max_tokens=6, temperature=0, grammar=Grammar("regex", "[a-z]{200}", "g")),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, seed=21, ignore_eos=True),
    ]
    return [(f"g{i}", [rng.randrange(vocab) for _ in range(rng.randint(2, 25))], p) for i, p in enumerate(params)]


@pytest.mark.parametrize("speculative", [False, True])
def test_grammar_requests_overlap_with_the_outputs_of_the_synchronous_loop(tiny_model, tokenizer, draft,
                                                                          grammar_jobs, speculative):
    """With async scheduling a step holding grammar requests stays in flight (its successor's masks are made
    after its forward is queued): tokens, logprobs, texts and finish reasons equal the synchronous loop's."""
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, overlap=overlap, draft=draft if speculative else None)
        in_flight = []  # after each step: whether a step holding a grammar request is in flight

        def note(engine=engine, in_flight=in_flight):
            step = engine._in_flight
            in_flight.append(step is not None and any(r.matcher is not None for r in step.requests))

        outs = run_to_completion(engine, grammar_jobs, per_step=2, after_step=note)
        results[overlap] = summary(outs.outputs)
        assert any(in_flight) == overlap
        assert_pools_empty(engine)
        if speculative:
            assert engine.spec.num_drafted > 0
    assert_same(results[True], results[False])
    reasons = {rid: s[3] for rid, s in results[True].items()}
    assert reasons["g3"] == "stop" and reasons["g4"] == "length", reasons


def test_a_grammar_steps_successor_is_launched_before_its_tokens_reach_the_host(tiny_model, tokenizer):
    """The order of the plain overlap (test above): step N+1's forward is queued before N's token is
    appended (and the matcher advanced); N+1's mask, made after that append, keeps the output in the grammar."""
    engine = make_engine(tiny_model, tokenizer, overlap=True)
    events = record_events(engine)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0,
                                                         grammar=Grammar("regex", "[a-z]{200}", "g")))
    outs = drive(engine, [])
    assert [kind for kind, _ in events] == ["forward", "forward", "append", "forward", "append", "forward",
                                           "append", "append"]
    assert re.fullmatch("[a-z]+", tokenizer.decode([t for o in outs["a"] for t in o.new_token_ids]))
