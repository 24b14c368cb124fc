"""prompt_logprobs: each prompt token's logprob, rank and best alternatives, against the reference model's
full-sequence log-softmax (fp32, CPU), with the prompt split into prefill chunks, another request
decoding in the same steps, async scheduling on and off and DSpark on; the generated tokens of both
requests stay the reference's greedy ones."""

from __future__ import annotations

import random

import pytest
import torch
from engine_run import MODES, greedy, mode_engine, run_to_completion
from greedy_ties import assert_greedy_matches
from prompt_scores import assert_prompt_logprobs

from mstar.config import EngineConfig
from mstar.engine import scheduler
from mstar.engine.core import EngineCore
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.sampler import gather_logprobs, token_ranks
from mstar.engine.step_results import LaunchedStep, pack, pack_prompt
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.resources.step import StepDecl
from mstar.resources.transfer import HostCopy


def _prompt(model, n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(model.config.vocab_size - 256) for _ in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_prompt_logprobs_equal_the_reference(tiny_model, tokenizer, draft, mode):
    """A long prompt (two or three 128-token chunks) arrives while a short request decodes: both share steps."""
    engine = mode_engine(tiny_model, tokenizer, mode, draft)
    decoding = _prompt(tiny_model, random.randint(2, 9))
    scored = _prompt(tiny_model, random.randint(140, 230))
    k = random.randint(0, 5)
    jobs = [("decoding", decoding, greedy(24)),
            ("scored", scored, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=k,
                                              logprobs=2))]

    def arrive(step: int) -> None:
        if step == 3:
            engine.add_request(*jobs[1])

    run = run_to_completion(engine, jobs[:1], before_step=arrive)
    first = run.outputs["scored"][0]
    assert first.prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in run.outputs["scored"][1:] + run.outputs["decoding"])
    assert_prompt_logprobs(tiny_model, scored, first.prompt_logprobs, k)
    expect = [(decoding, 24, greedy_generate(tiny_model, decoding, 24)), (scored, 3, greedy_generate(tiny_model,
                                                                                                  scored, 3))]
    assert_greedy_matches(tiny_model, expect, [run.tokens("decoding"), run.tokens("scored")])


def test_short_prompts_and_many_requests_at_once(tiny_model, tokenizer):
    """Prompts of one token (no entry), two, and several others in one step, each asking for its own k."""
    engine = mode_engine(tiny_model, tokenizer, "sync")
    prompts = [_prompt(tiny_model, n) for n in (1, 2, 7, 30, 61)]
    ks = [3, 0, 5, 1, 2]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k))
            for i, (p, k) in enumerate(zip(prompts, ks, strict=True))]
    run = run_to_completion(engine, jobs)
    for i, (prompt, k) in enumerate(zip(prompts, ks, strict=True)):
        got = run.outputs[f"r{i}"][0].prompt_logprobs
        assert_prompt_logprobs(tiny_model, prompt, got, k)


def test_preempted_request_reports_each_prompt_token_once(tiny_model, tokenizer):
    """A pool too small for both: the later request preempts, recomputes its prompt, and still reports one
    entry per prompt token (the recompute claims no prompt rows that a launch already computed)."""
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 8, "max_num_pages": 41},
                                                   "kda_state": {"max_slots": 3}},
                       scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 64},
                       model_kwargs={"cuda_graphs": False})
    engine = EngineCore(tiny_model, tokenizer, cfg)
    prompts = [_prompt(tiny_model, 150), _prompt(tiny_model, 140)]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=2))
            for i, p in enumerate(prompts)]
    run = run_to_completion(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs(tiny_model, prompt, run.outputs[f"r{i}"][0].prompt_logprobs, 2)


def test_a_scoring_request_prefills_in_bounded_chunks(tiny_model, tokenizer, monkeypatch):
    """Its chunks stay within PROMPT_SCORING_CHUNK tokens (its logits rows bound the step's memory), whatever
    the step budget; another request's chunks do not."""
    monkeypatch.setattr(scheduler, "PROMPT_SCORING_CHUNK", 24)
    engine = mode_engine(tiny_model, tokenizer, "sync")
    chunks: dict[str, list[int]] = {"scored": [], "plain": []}
    inner = engine.executor

    class Recording:
        def execute(self, step):
            for s in step.decl.seqs:
                chunks[s.request_id].append(s.num_tokens)
            return inner.execute(step)

    engine.executor = Recording()
    prompt = _prompt(tiny_model, 100)
    run = run_to_completion(engine, [("scored", prompt, SamplingParams(max_tokens=2, temperature=0,
                                                                       prompt_logprobs=1)),
                                     ("plain", _prompt(tiny_model, 100), greedy(2))])
    assert max(chunks["scored"]) == 24 and max(chunks["plain"]) > 24
    assert_prompt_logprobs(tiny_model, prompt, run.outputs["scored"][0].prompt_logprobs, 1)


def test_a_scoring_request_bypasses_the_prefix_cache(tiny_model, tokenizer):
    """The same prompt twice: the second finds it cached, unless it asks for prompt_logprobs (cached rows
    have no logits), which it then gets in full."""
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 64},
                                                   "kda_state": {"max_slots": 12}},
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 128},
                       model_kwargs={"cuda_graphs": False},
                       prefix_cache={"enabled": True, "kda_snapshot_interval": 32})
    engine = EngineCore(tiny_model, tokenizer, cfg)
    prompt = _prompt(tiny_model, 100)
    run_to_completion(engine, [("warm", prompt, greedy(2))])
    cached = run_to_completion(engine, [("cached", prompt, greedy(2))])
    assert cached.outputs["cached"][-1].num_cached_tokens > 0
    scored = run_to_completion(engine, [("scored", prompt, SamplingParams(max_tokens=2, temperature=0,
                                                                          prompt_logprobs=1))])
    assert scored.outputs["scored"][-1].num_cached_tokens == 0
    assert_prompt_logprobs(tiny_model, prompt, scored.outputs["scored"][0].prompt_logprobs, 1)


@pytest.mark.parametrize("sampled", [0, 3])
def test_one_copy_holds_the_sampled_and_the_prompt_rows(sampled):
    """The sampled rows' block, then the prompt rows' block, flattened into one tensor, read back apart
    (a non-final chunk has prompt rows and no sampled row)."""
    vocab, prompt = 300, 5
    logits = torch.randn(sampled + prompt, vocab) * 4
    logits[sampled + 1, 7] = float("nan")
    tokens, targets = torch.randint(0, vocab, (sampled,)), torch.randint(0, vocab, (prompt,))
    mine = logits[sampled:]
    block = pack_prompt(torch.isfinite(mine).all(-1), gather_logprobs(mine, targets, 4), token_ranks(mine, targets))
    head = pack(torch.isfinite(logits[:sampled]).all(-1), tokens, torch.zeros_like(tokens),
                gather_logprobs(logits[:sampled], tokens, 2))
    step = LaunchedStep(0, StepDecl(()), (), (), rows=((0, sampled),), results=HostCopy(torch.cat(
        [head.flatten(), block.flatten()])), newest=tokens, accepted=tokens, prompt_rows=((0, prompt),),
        prompt_width=block.shape[-1])
    rows, scored = step.fetch()
    assert [r.token for r in rows] == tokens.tolist()
    assert [r.finite for r in scored] == [i != 1 for i in range(prompt)]
    for i, r in enumerate(scored):
        row = torch.log_softmax(mine[i], -1)
        assert r.entry.token_id == int(targets[i]) and r.entry.rank == int((mine[i] >= mine[i, targets[i]]).sum())
        if r.finite:
            assert r.entry.logprob == pytest.approx(float(row[targets[i]]), abs=1e-5)
            assert [t for t, _ in r.entry.top] == row.topk(4).indices.tolist()


def test_prompt_logprobs_out_of_range_is_refused():
    for bad in (-1, 21):
        with pytest.raises(ParamError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
