"""The served path (scheduler, paged latent KV, KDA state pool, batched forward) against the reference."""

import copy
import dataclasses
import random

import pytest
import torch
from engine_run import numbered, run_to_completion
from greedy_ties import assert_greedy_matches

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import ParamError, SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate

NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def workload(tiny_model):
    """16 prompts of 1 to ~300 tokens with their output lengths and reference greedy continuations."""
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    lengths = [1, 2, 5, 15, 16, 17, 31, 33, 64, 100, 127, 150, 200, 257, 300, rng.randint(3, 290)]
    jobs = []
    for n in lengths:
        prompt = [rng.randrange(vocab - 256) for _ in range(n)]
        max_tokens = rng.randint(1, 24)
        jobs.append((prompt, max_tokens, greedy_generate(tiny_model, prompt, max_tokens)))
    return jobs


def run_engine(engine: EngineCore, jobs, arrivals_per_step=2):
    """Add requests a few per step (staggered), step until done; return each request's tokens."""
    run = run_to_completion(engine, numbered(jobs), per_step=arrivals_per_step)
    assert all(reason == "length" for reason in run.finish_reasons().values())
    return run.numbered_tokens(len(jobs))


def make_engine(model, tokenizer, *, pages=512, slots=17, page_size=16, mixed_prefill_decode=True, **sched):
    """A 512-token engine; the scheduler runs as many requests as there are KDA slots (but the sink)."""
    cfg = EngineConfig(max_seq_len=512,
                       resources={"mla_kv": {"page_size": page_size, "max_num_pages": pages},
                                  "kda_state": {"max_slots": slots}},
                       scheduler={"max_num_seqs": slots - 1, "max_num_batched_tokens": 2048, **sched},
                       model_kwargs={"mixed_prefill_decode": mixed_prefill_decode})
    return EngineCore(model, tokenizer, cfg)


def assert_pools_empty(engine):
    assert engine.kv.allocator.num_used == 0 and not engine.kv.pages
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.capacity
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("mixed", [True, False])
def test_served_greedy_equals_reference(tiny_model, tokenizer, workload, chunked, mixed):
    engine = make_engine(tiny_model, tokenizer, max_num_seqs=16, max_num_batched_tokens=512 if not chunked else 96,
                         chunked_prefill=chunked, mixed_prefill_decode=mixed)
    outputs = run_engine(engine, workload)
    assert_greedy_matches(tiny_model, workload, outputs)
    assert_pools_empty(engine)


def test_tiny_pools_give_the_same_tokens(tiny_model, tokenizer, workload):
    # 64 pages of 8 tokens (512 tokens, one max_seq_len) and 4 slots: far less than 16 requests need at once.
    engine = make_engine(tiny_model, tokenizer, pages=65, slots=5, page_size=8, max_num_seqs=4,
                         max_num_batched_tokens=64)
    outputs = run_engine(engine, workload, arrivals_per_step=4)
    assert_greedy_matches(tiny_model, workload, outputs)
    assert_pools_empty(engine)


def test_preemption_recomputes_to_the_same_tokens(tiny_model, tokenizer):
    """Prefill chunks of later prompts fill the 64-page pool; decodes past a page boundary must preempt."""
    vocab = tiny_model.config.vocab_size - 256
    jobs = []
    for n in (180, 170, 160, 150):
        prompt = torch.randint(0, vocab, (n,)).tolist()
        jobs.append((prompt, 60, greedy_generate(tiny_model, prompt, 60)))
    engine = make_engine(tiny_model, tokenizer, pages=65, slots=5, page_size=8, max_num_seqs=4,
                         max_num_batched_tokens=64)
    outputs = run_engine(engine, jobs, arrivals_per_step=4)
    assert engine.scheduler.num_preemptions > 0
    assert_greedy_matches(tiny_model, jobs, outputs, max_tied=1)
    assert_pools_empty(engine)


def test_stop_ids_stop_strings_and_abort(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    prompt = tokenizer.encode("def main():\n    print(")
    free_run = greedy_generate(tiny_model, prompt, 12)
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(free_run[4],),
                                                   ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    def abort_b(step):
        if step == 3:
            engine.abort_request("b")

    outs = run_to_completion(engine, before_step=abort_b).outputs
    a = outs["a"]
    assert a[-1].finished and a[-1].finish_reason == "stop" and a[-1].stop_reason == free_run[4]
    assert [t for o in a for t in o.new_token_ids] == free_run[: free_run.index(free_run[4]) + 1]
    b = outs["b"]
    assert b[-1].finished and b[-1].finish_reason == "abort"
    assert_pools_empty(engine)

    text = tokenizer.decode(free_run)
    stop = text[3:6] if len(text) >= 6 else None
    if stop:
        engine.add_request("c", prompt, SamplingParams(max_tokens=12, temperature=0, stop=(stop,), ignore_eos=True))
        outs = run_to_completion(engine).outputs["c"]
        assert "".join(o.text for o in outs) == text[: text.index(stop)]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_seeded_sampling_is_reproducible_across_batches(tiny_model, tokenizer):
    prompt = tokenizer.encode("import os\n")
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)

    def run(neighbours):
        engine = make_engine(tiny_model, tokenizer)
        for i in range(neighbours):
            engine.add_request(f"n{i}", tokenizer.encode(f"x = {i}\n"),
                               SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
        engine.add_request("s", prompt, params)
        return run_to_completion(engine).tokens("s")

    assert run(0) == run(3)


def test_bad_requests_are_refused(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    with pytest.raises(ParamError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ParamError, match="outside the vocabulary"):
        engine.add_request("x", [10**6], SamplingParams())
    with pytest.raises(ParamError, match="maximum sequence length"):
        engine.add_request("x", [1] * 500, SamplingParams(max_tokens=20))
    engine.add_request("x", [1, 2], SamplingParams())
    with pytest.raises(ParamError, match="already in use"):
        engine.add_request("x", [1, 2], SamplingParams())


def test_pool_too_small_for_max_seq_len_is_a_config_error(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="max_num_pages"):
        make_engine(tiny_model, tokenizer, pages=8)



def test_non_finite_logits_fail_only_that_request(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    forward = engine.runner.forward

    def poisoned(plan, tap_layers=()):
        logits, taps = forward(plan, tap_layers)
        if "bad" in engine.requests and engine.requests["bad"].output_ids:
            logits = logits.clone()
            logits[:, 7] = float("nan")  # every sampled row; only "bad" is still running by then
        return logits, taps

    engine.runner.forward = poisoned
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    engine.add_request("bad", [4, 5, 6], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine, allow_errors=True).outputs
    assert outs["good"][-1].finish_reason == "length"
    last = outs["bad"][-1]
    assert last.finish_reason == "error" and "non-finite" in last.error
    assert_pools_empty(engine)


def test_tie_aware_comparison_still_catches_a_wrong_token(tiny_model, workload):
    """The near-tie excuse must not hide a real error: a token the reference ranks far below its argmax fails."""
    # The shortest prompt: few routed tokens, so no router near tie can excuse the wrong token by chance.
    prompt, max_tokens, expect = min((job for job in workload if len(job[2]) >= 2), key=lambda job: len(job[0]))
    with torch.no_grad():
        logits = tiny_model(torch.tensor(prompt + expect[:1]), None).logits[-1]
    wrong = expect[:1] + [int(logits.argmin())] + expect[2:]
    with pytest.raises(AssertionError, match="no near tie"):
        assert_greedy_matches(tiny_model, [(prompt, max_tokens, expect)], [wrong])


def test_a_stop_id_outside_the_vocabulary_stops_nothing(tiny_model, tokenizer):
    """A model cut to a small tokenizer may keep the checkpoint's EOS id; it can never be sampled, so the
    engine (and the grammar engine, which refuses such ids) leaves it out instead of failing to start."""
    vocab = tiny_model.config.vocab_size
    model = copy.copy(tiny_model)  # the same weights under a config whose EOS lies outside the vocabulary
    model.config = dataclasses.replace(tiny_model.config, eos_token_id=vocab + 162_000)
    engine = make_engine(model, tokenizer)
    assert engine.model_stop_ids and all(t < vocab for t in engine.model_stop_ids)
    assert vocab + 162_000 not in engine.model_stop_ids
    prompt = [5, 6, 7]
    assert run_engine(engine, [(prompt, 4, None)]) == [greedy_generate(tiny_model, prompt, 4)]
