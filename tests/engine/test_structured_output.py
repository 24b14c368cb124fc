"""Structured outputs: the device mask against a per-token loop, and the engine's constrained outputs
(regex, choice, JSON Schema) matching their grammar beside a plain greedy request that stays exactly
the reference's, with async scheduling on and off and with DSpark."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from engine_run import MODES, mode_engine, run_to_completion

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.structured_output import Grammar, apply_token_bitmask, choice_grammar
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


@pytest.mark.parametrize("trial", range(3))
def test_bitmask_application_equals_a_per_token_loop(trial):
    rng = random.Random()
    n, vocab = rng.randint(2, 6), rng.randint(33, 130)
    logits = torch.randn(n, vocab)
    rows = sorted(rng.sample(range(n), rng.randint(1, n)))
    allowed = [set(rng.sample(range(vocab), rng.randint(1, vocab))) for _ in rows]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -12345, dtype=torch.int32)  # poisoned: every word is written below
    for i, ok in enumerate(allowed):
        for w in range(words):
            value = sum(1 << b for b in range(32) if w * 32 + b in ok)
            bitmask[i, w] = value - (1 << 32) if value >= 1 << 31 else value
    got = apply_token_bitmask(logits, torch.tensor(rows), bitmask)
    want = logits.clone()
    for i, r in enumerate(rows):
        for t in range(vocab):
            if t not in allowed[i]:
                want[r, t] = float("-inf")
    assert torch.equal(got, want)


SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("mode", MODES)
def test_engine_outputs_match_their_grammar(tiny_model, tokenizer, draft, mode):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    engine = mode_engine(tiny_model, tokenizer, mode, draft)
    prompts = [[rng.randrange(vocab - 256) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    grammars = [Grammar("regex", "[0-9]{3}-[a-z]{2}", "guided_regex"), choice_grammar(["yes", "no", "maybe"],
                "guided_choice"), Grammar("json_schema", json.dumps(SCHEMA), "response_format")]
    for i, g in enumerate(grammars):
        engine.add_request(f"g{i}", prompts[i], SamplingParams(max_tokens=60, temperature=i * 0.5, grammar=g))
    engine.add_request("plain", prompts[3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    run = run_to_completion(engine)
    got = run.tokens_per_request()
    reasons = run.finish_reasons()
    stops = engine.model_stop_ids

    def text(rid):
        return tokenizer.decode([t for t in got[rid] if t not in stops])

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text("g0")), text("g0")
    assert text("g1") in ("yes", "no", "maybe"), text("g1")
    value = json.loads(text("g2"))
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool), value
    assert all(reasons[f"g{i}"] == "stop" for i in range(3)), reasons
    assert got["plain"] == greedy_generate(tiny_model, prompts[3], 10)
    if mode == "dspark":
        assert engine.spec.num_drafted > 0


@pytest.mark.parametrize(("grammar", "words"), [
    (Grammar("regex", "a(b", "guided_regex"), "guided_regex"),
    (Grammar("json_schema", json.dumps({"type": "nope"}), "response_format.json_schema"), "response_format"),
    (Grammar("lark", "start: (", "guided_grammar"), "guided_grammar"),
])
def test_bad_grammars_name_the_field(tiny_model, tiny_dirs, grammar, words):
    engine = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dirs[0]), EngineConfig(
        max_seq_len=64, resources={"mla_kv": {"page_size": 16, "max_num_pages": 16}}))
    with pytest.raises(ParamError, match=words):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, grammar=grammar))
