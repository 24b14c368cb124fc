"""The forced tool-call grammar against chat.py's own format: turns chat.py renders are accepted, turns
that break the forcing or a schema are refused, and random walks through the grammar's masks (fresh
tools and choices each run) always parse as tool calls whose arguments validate under their schemas."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import llguidance
import llguidance.torch
import pytest
import torch
from paths import ROOT

from mstar.models.kimi_k3.assistant_output import parse_assistant_output
from mstar.models.kimi_k3.chat import build_chat_segments
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.tool_grammar import MAX_FORCED_CALLS, forced_tool_call_grammar


def _tool(name: str, parameters: dict | None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


WEATHER = _tool("get_weather", {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}, "note": {"type": ["string", "null"], "maxLength": 6}}})
# a `pattern` cannot be held in per-argument markup: these calls carry one JSON block
CODE = _tool('set "code"', {
    "type": "object", "required": ["code"], "additionalProperties": False,
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}, "on": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}})
NO_ARGS = _tool("ping", None)
TOOLS = [WEATHER, CODE, NO_ARGS]


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.from_dir(ROOT / "models" / "kimi_k3_mini")


@pytest.fixture(scope="module")
def lltok(tok):
    from llguidance.tiktoken import lltokenizer_from_encoding

    return lltokenizer_from_encoding(tok.encoding, n_vocab=tok.vocab_size, eos_token=list(tok.stop_ids))


def _matcher(lltok, tools, **kw) -> llguidance.LLMatcher:
    grammar = forced_tool_call_grammar(tools, **kw)
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _rendered_turn(tok, calls: list[tuple[str, dict]], thinking: bool, reasoning: str = "") -> list[int]:
    """What the model writes after the generation prompt, as chat.py renders such an assistant turn."""
    message = {"role": "assistant", "content": "", "reasoning_content": reasoning,
               "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls]}
    whole = tok.encode_segments(build_chat_segments([message], thinking=thinking, thinking_effort=None,
                                                    add_generation_prompt=False))
    prompt = tok.encode_segments(build_chat_segments([], thinking=thinking, thinking_effort=None))
    assert whole[:len(prompt)] == prompt
    return whole[len(prompt):-1]  # the closing <|end_of_msg|> is the stop token the engine adds


def _accepts(matcher, ids: list[int]) -> bool:
    return all(matcher.consume_token(t) for t in ids) and matcher.is_stopped()


@pytest.mark.parametrize("thinking", [False, True])
def test_turns_chat_renders_are_accepted(tok, lltok, thinking):
    calls = [("get_weather", {"city": "Tokyo", "days": 3, "note": None}), ("ping", {}),
             ("get_weather", {"city": "Paris", "days": 7, "unit": "f", "note": "warm"})]
    turn = _rendered_turn(tok, calls, thinking, reasoning="Look it up <|close|>think.")
    assert _accepts(_matcher(lltok, TOOLS, starts_in_think=thinking), turn)
    one = _rendered_turn(tok, calls[:1], thinking)
    assert _accepts(_matcher(lltok, TOOLS, name="get_weather", starts_in_think=thinking), one)
    assert _accepts(_matcher(lltok, TOOLS, starts_in_think=thinking, parallel=False), one)


def _refuses(matcher, ids: list[int]) -> bool:
    return not _accepts(matcher, ids)


def test_turns_that_break_the_forcing_or_a_schema_are_refused(tok, lltok):
    def required():
        return _matcher(lltok, TOOLS, starts_in_think=False)

    two = _rendered_turn(tok, [("ping", {}), ("ping", {})], False)
    assert _refuses(_matcher(lltok, TOOLS, name="ping", starts_in_think=False), two)  # named: exactly one call
    assert _refuses(_matcher(lltok, TOOLS, starts_in_think=False, parallel=False), two)
    assert _refuses(_matcher(lltok, TOOLS, name="get_weather", starts_in_think=False),
                    _rendered_turn(tok, [("ping", {})], False))
    assert _refuses(required(), _rendered_turn(tok, [], False))  # required: at least one call
    assert _refuses(required(), _rendered_turn(tok, [("get_weather", {"city": "Rome", "days": 3})], False))
    assert _refuses(required(), _rendered_turn(tok, [("get_weather", {"city": "Paris", "days": 8})], False))
    assert _refuses(required(), _rendered_turn(tok, [("get_weather", {"city": "Paris"})], False))
    assert _refuses(required(), _rendered_turn(tok, [("get_weather", {"days": 2, "city": "Paris"})], False))
    assert _refuses(required(), _rendered_turn(tok, [("get_weather", {"city": "Paris", "days": 1,
                                                                       "note": "too long"})], False))
    assert _refuses(required(), _rendered_turn(tok, [("other", {})], False))
    content = _rendered_turn(tok, [("ping", {})], False)
    assert _refuses(required(), tok.encode("Calling.") + content)  # the response channel stays empty
    with pytest.raises(ValueError, match="not one of the tools"):
        forced_tool_call_grammar(TOOLS, name="missing", starts_in_think=False)


def _random_schema(rng: random.Random) -> dict:
    properties = {}
    for i in range(rng.randint(0, 4)):
        kind = rng.choice(["enum", "int", "bool", "short", "array", "object", "nullable", "pattern"])
        properties[f"p{i}"] = {
            "enum": {"enum": rng.sample(["x", "y & z", 'q"uote', "", 3, True, None], rng.randint(1, 4))},
            "int": {"type": "integer", "minimum": -5, "maximum": rng.randint(-5, 50)},
            "bool": {"type": "boolean"},
            "short": {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 5)},
            "array": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            "object": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
                       "additionalProperties": False},
            "nullable": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            "pattern": {"type": "string", "pattern": "^[a-c]{1,3}$"},
        }[kind]
    required = [key for key in properties if rng.random() < 0.5]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _allowed(matcher, vocab_size: int) -> list[int]:
    mask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # poisoned: every word is written
    llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


@pytest.mark.parametrize("trial", range(8))
def test_random_walks_parse_as_calls_that_validate(tok, lltok, trial):
    rng = random.Random()
    tools = [_tool(f"tool_{i}", _random_schema(rng)) for i in range(rng.randint(1, 3))]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    name = rng.choice([None, tools[-1]["function"]["name"]])
    thinking, parallel = rng.random() < 0.5, rng.random() < 0.7
    for _ in range(3):
        matcher = _matcher(lltok, tools, name=name, starts_in_think=thinking, parallel=parallel)
        turn: list[int] = []
        while not matcher.is_stopped():
            allowed = _allowed(matcher, tok.vocab_size)
            special = [t for t in allowed if tok.is_special(t)]  # markup often, so that walks end soon
            token = rng.choice(special if special and rng.random() < 0.4 else allowed)
            assert matcher.consume_token(token)
            turn.append(token)
            assert len(turn) < 5000, tok.decode(turn)
        parsed = parse_assistant_output(turn, thinking=thinking, tokenizer=tok)
        assert parsed.content is None, tok.decode(turn)
        calls = parsed.tool_calls
        assert 1 <= len(calls) <= (MAX_FORCED_CALLS if parallel and name is None else 1), tok.decode(turn)
        for call in calls:
            assert name is None or call["function"]["name"] == name
            arguments = json.loads(call["function"]["arguments"])
            assert jsonschema_rs.is_valid(schemas[call["function"]["name"]], arguments), (tok.decode(turn), arguments)


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"s": {"type": [{"a": 1}]}}},
    {"type": "object", "properties": {"s": {"enum": [1], "type": 5}}},
    {"type": "object", "properties": {"s": {"type": "string"}}, "required": [{"x": 1}]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "a(b"}}},
])
def test_a_malformed_schema_leaves_the_error_to_the_grammar_engine(lltok, parameters):
    """What the per-argument form cannot read goes to the JSON block, whose compiler names the problem
    (the server turns it into a 400 naming `tools`), never a crash here."""
    grammar = forced_tool_call_grammar([_tool("f", parameters)], starts_in_think=False)
    assert "failed to compile JSON schema" in llguidance.LLMatcher.validate_grammar(grammar, lltok)
