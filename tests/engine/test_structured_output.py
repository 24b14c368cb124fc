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
from mstar.speculative.oracle import OracleSpeculation


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


class _GrammarBreakingOracle(OracleSpeculation):
    """The oracle draft (speculative/oracle.py) over the constrained greedy outputs, each draft wrong with
    probability 0.3 (the next token id: mostly one the grammar forbids there); it keeps every block it
    proposes, to check afterwards that some held a forbidden draft."""

    def __init__(self, base, references):
        super().__init__(base, references, error_rate=0.3)
        self.blocks: list[tuple[str, int, list[int]]] = []  # (request id, anchor position, drafts)

    def propose(self, decl, requests, input_ids, advance):
        drafts = super().propose(decl, requests, input_ids, advance)
        shift = advance.tolist() if advance is not None else [0] * len(decl.seqs)
        for b, proposal in drafts.items():
            s = decl.seqs[b]
            self.blocks.append((s.request_id, s.num_computed + shift[b], proposal.tokens.tolist()))
        return drafts


def _forbidden_blocks(engine, blocks, prompts, outputs, grammars) -> int:
    """How many proposed blocks held a draft the grammar forbids after the tokens before it. A block anchored
    past the output's end is the row of a request that had ended (async scheduling: dropped), not counted."""
    count = 0
    for rid, anchor, drafts in blocks:
        if anchor + 1 - len(prompts[rid]) > len(outputs[rid]):
            continue
        matcher = engine.grammars.matcher(grammars[rid])
        before = outputs[rid][: anchor + 1 - len(prompts[rid])]
        assert matcher.consume_tokens(before), (rid, before)
        count += matcher.validate_tokens(drafts) < len(drafts)
    return count


GRAMMARS = {"schema": Grammar("json_schema", json.dumps(SCHEMA), "response_format"),
            "regex": Grammar("regex", "([a-z]{2,5} ){3}[0-9]{2,5}", "guided_regex")}


@pytest.mark.parametrize("overlap", [False, True])
def test_dspark_drafts_for_grammar_requests_keep_the_constrained_greedy_output(tiny_model, tokenizer, draft,
                                                                                 overlap):
    """Greedy constrained output with DSpark equals it without, for drafts that the grammar allows (kept where
    the target agrees) and drafts it forbids (always rejected); a sampled constrained request drafted for the
    same way matches its grammar. A plain greedy request shares the steps and stays the reference's."""
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    prompts = {rid: [rng.randrange(vocab - 256) for _ in range(rng.randint(3, 30))] for rid in GRAMMARS}
    jobs = [(rid, prompts[rid], SamplingParams(max_tokens=60, temperature=0, grammar=g)) for rid, g in GRAMMARS.items()]
    reference_run = run_to_completion(mode_engine(tiny_model, tokenizer, "sync"), jobs)
    undrafted = reference_run.tokens_per_request()
    assert all(reason == "stop" for reason in reference_run.finish_reasons().values())
    plain = [rng.randrange(vocab - 256) for _ in range(12)]
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=GRAMMARS["regex"])
    engine = mode_engine(tiny_model, tokenizer, "dspark", draft)
    engine._overlap = overlap
    pad = [0] * 64  # past a grammar's end the engine may still draft: the oracle needs tokens there
    references = {rid: prompts[rid] + undrafted[rid] + pad for rid in GRAMMARS}
    references |= {"sampled": prompts["regex"] + undrafted["regex"] + pad,
                   "plain": plain + greedy_generate(tiny_model, plain, 16) + pad}
    engine.spec = _GrammarBreakingOracle(engine.spec, references)
    run = run_to_completion(engine, [*jobs, ("sampled", prompts["regex"], sampled),
                                     ("plain", plain, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))])
    got = run.tokens_per_request()
    for rid in GRAMMARS:
        assert got[rid] == undrafted[rid], rid
    assert got["plain"] == greedy_generate(tiny_model, plain, 16)
    text = tokenizer.decode([t for t in got["sampled"] if t not in engine.model_stop_ids])
    assert re.fullmatch(GRAMMARS["regex"].source, text), text
    spec = engine.spec
    grammar_blocks = [blk for blk in spec.blocks if blk[0] in GRAMMARS]
    assert grammar_blocks and 0 < spec.num_accepted < spec.num_drafted
    # drafts the grammar forbids were proposed, and right ones kept (the output is the reference, so a block
    # whose first draft is the reference's next token kept it)
    outputs = {rid: undrafted[rid] for rid in GRAMMARS}
    assert _forbidden_blocks(engine, grammar_blocks, prompts, outputs, GRAMMARS) > 0
    assert any(drafts[0] == references[rid][anchor + 1] for rid, anchor, drafts in grammar_blocks)
