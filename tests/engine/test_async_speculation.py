"""Speculative steps overlapped (async scheduling, engine/core.py): step N+1's drafts and verify blocks are
planned and launched before step N's verdicts reach the host, their anchors, positions and KDA pending
prefixes taken on the device (`BatchPlan.advance`). Against the synchronous loop and the reference: greedy
tokens, seeded sampled tokens, logprobs, stop ids and strings, max_tokens, aborts and preemption in the
middle of an overlapped step. The oracle draft (speculative/oracle.py) makes every accepted length 0..k
occur, so the shifts the device takes are not all zero."""

import random

import pytest
from greedy_ties import assert_greedy_matches

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.speculative.oracle import OracleSpeculation

K = 4


@pytest.fixture(scope="module")
def prompts(tiny_model):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size - 256
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 4, 13, 30, 57, 8)]


@pytest.fixture(scope="module")
def references(tiny_model, prompts):
    return [greedy_generate(tiny_model, p, 40) for p in prompts]


def make_engine(model, tokenizer, draft, *, overlap, oracle=None, pages=256, slots=9, max_seq_len=256, **sched):
    """An engine drafting K tokens per verify at every batch size; `oracle` (references, error rate) replaces
    the draft by the oracle, whose errors are seeded per block, so two engines that draft the same block draw
    the same drafts."""
    cfg = EngineConfig(max_seq_len=max_seq_len, resources={"mla_kv": {"page_size": 8, "max_num_pages": pages},
                                                   "kda_state": {"max_slots": slots}},
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64} | sched,
                       model_kwargs={"speculative_tokens": K, "async_scheduling": overlap})
    engine = EngineCore(model, tokenizer, cfg, SpeculativeModels(draft))
    if oracle is not None:
        truths, error_rate = oracle
        engine.spec = OracleSpeculation(engine.spec, truths, error_rate, seed=5)
    return engine


def overlapped_steps(engine) -> list[int]:
    """Counts, as the engine runs, its steps planned with a shift the device takes (a verify step in flight)."""
    seen, forward = [0], engine.runner.forward

    def counting(plan, tap_layers=()):
        seen[0] += plan.advance is not None
        return forward(plan, tap_layers)

    engine.runner.forward = counting
    return seen


def drive(engine, jobs, *, aborts=None):
    """Add every job, step until done (aborting request id at step n for each `aborts[id] = n`): per request,
    (tokens, text, logprob token ids, logprob values, finish reason, stop reason, error)."""
    for job in jobs:
        engine.add_request(*job)
    outs: dict[str, list] = {}
    aborts, steps = dict(aborts or {}), 0
    while engine.has_work():
        for request_id, at in list(aborts.items()):
            if steps == at:
                engine.abort_request(request_id)
                del aborts[request_id]
        for o in engine.step():
            assert not (outs.get(o.request_id) and outs[o.request_id][-1].finished), "output after finish"
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < 2000, "no progress"
    assert engine.kv.allocator.num_used == 0 and engine.pool.num_used == 0 and not engine.requests
    assert engine.spec.proposer.kv.allocator.num_used == 0 and engine._in_flight is None
    return {rid: ([t for o in os for t in o.new_token_ids], "".join(o.text for o in os),
                  [(lp.token_id, [t for t, _ in lp.top]) for o in os for lp in (o.logprobs or [])],
                  [lp.logprob for o in os for lp in (o.logprobs or [])], os[-1].finish_reason, os[-1].stop_reason,
                  os[-1].error) for rid, os in outs.items()}


def assert_same(got, expect):
    """Equal outputs; logprob values to rounding (a row's logits depend in their last bits on its batch)."""
    assert got.keys() == expect.keys()
    for rid in got:
        (*exact, values, reason, stop, error), (*exact2, values2, reason2, stop2, error2) = got[rid], expect[rid]
        assert (exact, reason, stop, error) == (exact2, reason2, stop2, error2), rid
        assert values == pytest.approx(values2, abs=1e-5), rid


def greedy_jobs(prompts, references, lengths):
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    truths = {f"r{i}": p + ref for i, (p, ref) in enumerate(zip(prompts, references, strict=True))}
    return jobs, truths


def test_overlapped_greedy_equals_the_reference_and_the_synchronous_loop(tiny_model, tokenizer, draft, prompts,
                                                                        references):
    jobs, truths = greedy_jobs(prompts, references, [40, 17, 33, 25, 40, 9])
    results, stats = {}, {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, draft, overlap=overlap, oracle=(truths, 0.3))
        overlapped = overlapped_steps(engine)
        results[overlap] = drive(engine, jobs)
        stats[overlap] = (engine.spec.num_rows, engine.spec.num_drafted, engine.spec.num_accepted,
                          engine.spec.accepted_by_position)
        assert (overlapped[0] > 0) == overlap
    assert_same(results[True], results[False])
    assert stats[True] == stats[False]  # the same blocks drafted and verified
    rows, drafted, accepted, by_position = stats[True]
    assert 0 < accepted < drafted and by_position[-1] > 0, stats  # every accepted length occurs
    outputs = [results[True][f"r{i}"][0] for i in range(len(jobs))]
    assert [len(o) for o in outputs] == [40, 17, 33, 25, 40, 9]
    assert_greedy_matches(tiny_model, [(p, len(o), ref[: len(o)]) for p, o, ref in zip(prompts, outputs, references,
                                                                                     strict=True)], outputs, max_tied=1)


@pytest.mark.parametrize("drafter", ["oracle", "dspark"])
def test_overlapped_sampling_stops_and_logprobs_equal_the_synchronous_loop(tiny_model, tokenizer, draft, prompts,
                                                                          references, drafter):
    """Seeded sampled requests (their drafts and verification draw from their own generators, in the same
    order), greedy ones with logprobs, stop ids and stop strings that end a request inside a block."""
    rng = random.Random(1)
    jobs = []
    for i, (prompt, ref) in enumerate(zip(prompts, references, strict=True)):
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(5, 30), temperature=0, logprobs=2, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(ref[9],), ignore_eos=True)
        elif kind == 2:
            text = tokenizer.decode(ref[:20])
            params = SamplingParams(max_tokens=30, temperature=0, stop=(text[10:13],) if len(text) > 13 else (),
                                    ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=50 + i, logprobs=1,
                                    ignore_eos=True)
        jobs.append((f"r{i}", prompt, params))
    oracle = ({f"r{i}": p + ref for i, (p, ref) in enumerate(zip(prompts, references, strict=True))}, 0.3)
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, draft, overlap=overlap,
                             oracle=oracle if drafter == "oracle" else None)
        overlapped = overlapped_steps(engine)
        results[overlap] = drive(engine, jobs)
        assert engine.spec.num_drafted > 0 and (overlapped[0] > 0) == overlap
    assert_same(results[True], results[False])
    assert {r[4] for r in results[True].values()} >= {"stop", "length"}


def test_an_abort_in_the_middle_of_an_overlapped_step(tiny_model, tokenizer, draft, prompts, references):
    """Aborted while its verify block runs and the next one is queued behind it: the request ends with
    "abort" and a prefix of its tokens, its neighbours are unchanged, every pool ends empty."""
    jobs, truths = greedy_jobs(prompts, references, [40, 30, 30, 30, 30, 30])
    aborts = {"r1": 4, "r4": 6}
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, tokenizer, draft, overlap=overlap, oracle=(truths, 0.3))
        in_flight, abort = [], engine.abort_request

        def aborting(request_id, engine=engine, abort=abort, in_flight=in_flight):
            in_flight.append(engine.requests[request_id].unresolved > 0 and engine._in_flight is not None)
            abort(request_id)

        engine.abort_request = aborting
        results[overlap] = drive(engine, jobs, aborts=aborts)
        assert in_flight == [overlap] * len(aborts)
    for rid in aborts:
        assert results[True][rid][4] == "abort"
        i, tokens = int(rid[1:]), results[True][rid][0]
        assert_greedy_matches(tiny_model, [(prompts[i], len(tokens), references[i][: len(tokens)])], [tokens],
                              max_tied=1)
    survivors = [rid for rid in results[True] if rid not in aborts]
    assert_same({r: results[True][r] for r in survivors}, {r: results[False][r] for r in survivors})


def test_preemption_while_a_verify_step_is_in_flight(tiny_model, tokenizer, draft, prompts, references):
    """Pools so small that verify rows preempt, some while their request's block is in flight: the
    preempted request keeps the tokens that block emits and is recomputed with them."""
    chosen = [4, 3, 2, 5]  # 57, 30, 13 and 8 tokens: with 40 more each they need 35 pages, the pool has 23
    prompts, references = [prompts[i] for i in chosen], [references[i] for i in chosen]
    jobs, truths = greedy_jobs(prompts, references, [40] * len(prompts))
    engine = make_engine(tiny_model, tokenizer, draft, overlap=True, oracle=(truths, 0.2), pages=24, slots=5,
                         max_seq_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    overlapped = overlapped_steps(engine)
    preempted_in_flight = []
    real_preempt = engine.scheduler._preempt

    def preempt(request):
        preempted_in_flight.append(request.unresolved > 0)
        real_preempt(request)

    engine.scheduler._preempt = preempt
    outs = drive(engine, jobs)
    assert any(preempted_in_flight) and overlapped[0] > 0, (preempted_in_flight, overlapped)
    outputs = [outs[f"r{i}"][0] for i in range(len(jobs))]
    assert_greedy_matches(tiny_model, [(p, 40, ref) for p, ref in zip(prompts, references, strict=True)], outputs,
                          max_tied=1)


def test_the_next_verify_step_is_launched_before_the_last_ones_tokens_reach_the_host(tiny_model, tokenizer, draft,
                                                                                     prompts, references):
    """One request: its verify steps are launched while the one before is in flight (but for the last few,
    near max_tokens, where the room left depends on the verdict), each fed as its anchor the newest token of
    the step before, which the device took from that step's results before the host saw it."""
    jobs, truths = greedy_jobs(prompts[3:4], references[3:4], [40])
    engine = make_engine(tiny_model, tokenizer, draft, overlap=True, oracle=(truths, 0.3))
    events, forward, append = [], engine.runner.forward, engine._append

    def recording_forward(plan, tap_layers=()):
        events.append(("forward", [plan.input_ids[0].item()]))
        return forward(plan, tap_layers)

    def recording_append(request, tokens, logprobs):
        events.append(("append", tokens))
        return append(request, tokens, logprobs)

    engine.runner.forward, engine._append = recording_forward, recording_append
    tokens = drive(engine, jobs)["r0"][0]
    assert tokens == references[3][:40]
    in_flight = 0  # forwards whose tokens have not been appended yet
    overlapped = 0
    for i, (kind, values) in enumerate(events):
        if kind == "append":
            in_flight -= 1
            continue
        if i:  # the first forward is the prefill; the later ones feed the newest token as their anchor
            if in_flight:  # launched before that token reached the host: it is the next append's last
                overlapped += 1
                assert values[0] == next(v for k, v in events[i:] if k == "append")[-1]
            else:
                assert values[0] == next(v for k, v in reversed(events[:i]) if k == "append")[-1]
        in_flight += 1
    verify_steps = sum(kind == "forward" for kind, _ in events) - 1
    assert overlapped >= verify_steps - 3, events
