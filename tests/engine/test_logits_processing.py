"""min_tokens, logit_bias and the penalties: each definition against a plain per-token loop, the
batched processing of a step against it row by row, and the engine's greedy tokens against the
reference model with the same processing applied to its logits (batched with plain greedy requests,
which must come out as before), with async scheduling on and off."""

from __future__ import annotations

import random

import pytest
import torch
from engine_run import MODES, mode_engine, run_to_completion
from logits_reference import ref_process, reference_processed_greedy

from mstar.engine.logits_processing import (
    LogitsProcessing,
    RowHistory,
    apply_frequency_presence,
    apply_repetition_penalty,
)
from mstar.engine.params import ParamError, SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate

VOCAB = 40


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    bias = tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(vocab), rng.randint(0, 4)))
    return SamplingParams(max_tokens=50, temperature=rng.choice([0.0, 0.8]), min_tokens=rng.choice([0, 3, 50]),
                          presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                          frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                          repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2)]), logit_bias=bias)


def test_repetition_penalty_matches_its_definition():
    logits = torch.randn(5, VOCAB)
    seen = torch.rand(5, VOCAB) < 0.3
    penalty = torch.rand(5) * 2 + 0.1
    got = apply_repetition_penalty(logits, seen, penalty)
    for r in range(5):
        for t in range(VOCAB):
            v = logits[r, t].item()
            want = (v / penalty[r].item() if v > 0 else v * penalty[r].item()) if seen[r, t] else v
            assert got[r, t].item() == pytest.approx(want, rel=1e-6)


def test_frequency_and_presence_match_their_definition():
    logits = torch.randn(4, VOCAB)
    counts = torch.randint(0, 4, (4, VOCAB)).float()
    frequency, presence = torch.rand(4) * 4 - 2, torch.rand(4) * 4 - 2
    got = apply_frequency_presence(logits, counts, frequency, presence)
    for r in range(4):
        for t in range(VOCAB):
            c = counts[r, t].item()
            want = logits[r, t].item() - frequency[r].item() * c - (presence[r].item() if c > 0 else 0.0)
            assert got[r, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("trial", range(3))
def test_step_processing_equals_the_per_row_reference(trial):
    """Random rows, some processing, some not, some with an output token still in flight."""
    rng = random.Random()
    rows = 7
    logits = torch.randn(rows + 2, VOCAB)  # two more logits rows than histories: never touched
    inflight_tokens = torch.randint(0, VOCAB, (rows,))
    histories, outputs = [], []
    for r in range(rows):
        params = _random_params(rng, VOCAB) if rng.random() < 0.8 else SamplingParams(max_tokens=50)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        late = r if rng.random() < 0.4 else None
        stop_ids = frozenset(rng.sample(range(VOCAB), 3))
        histories.append(RowHistory(r + 1, params, prompt, output, late, stop_ids))
        outputs.append(output + ([int(inflight_tokens[r])] if late is not None else []))
    processing = LogitsProcessing.build(histories, inflight_tokens, "cpu")
    kept = logits.clone()
    got = processing.apply(logits) if processing is not None else logits
    assert torch.equal(logits, kept), "apply must not change its input"
    assert torch.equal(got[0], logits[0]) and torch.equal(got[-1], logits[-1])
    for h, output in zip(histories, outputs, strict=True):
        want = ref_process(logits[h.row], h.params, list(h.prompt_ids), output, h.stop_ids)
        assert torch.allclose(got[h.row], want, rtol=1e-5, atol=1e-6, equal_nan=False), h


def test_no_processing_builds_nothing():
    history = RowHistory(0, SamplingParams(max_tokens=4), [1, 2], [3], None, frozenset({5}))
    assert LogitsProcessing.build([history], None, "cpu") is None


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
])
def test_out_of_range_values_name_the_field(kwargs, name):
    with pytest.raises(ParamError, match=f"^{name} "):
        SamplingParams(max_tokens=16, **kwargs)


# ---- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_engine_greedy_with_processing_equals_the_reference(tiny_model, tokenizer, draft, mode):
    """With DSpark the processed requests get no drafts (their verify row is their one sampled row); the
    plain request is drafted for and stays greedy-exact."""
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    engine = mode_engine(tiny_model, tokenizer, mode, draft)
    prompts = [[rng.randrange(vocab - 256) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    free_run = greedy_generate(tiny_model, prompts[0], 10)
    stop = free_run[2]  # the plain run would stop at its third token; min_tokens holds it off
    processed = [
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, logit_bias=((free_run[0], -100.0), (7, 4.0)), ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, min_tokens=6, stop_token_ids=(stop,), ignore_eos=True),
    ]
    jobs = [(prompts[0], p) for p in processed] + [(prompts[1], SamplingParams(max_tokens=10, temperature=0,
                                                                               ignore_eos=True))]
    run = run_to_completion(engine, [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(jobs)])
    got = run.tokens_per_request()
    for i, (prompt, params) in enumerate(jobs):
        stop_ids = frozenset(params.stop_token_ids)
        assert got[f"r{i}"] == reference_processed_greedy(tiny_model, prompt, params, stop_ids), params
    assert got["r4"] == greedy_generate(tiny_model, prompts[1], 10)
    assert len(got["r3"]) >= 6  # without min_tokens its stop id ends it by the third token
    assert got["r2"][0] != free_run[0]  # a bias of -100 moved the argmax away
    if mode == "dspark":
        assert engine.spec.num_drafted > 0
