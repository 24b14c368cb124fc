"""Structured outputs through the real `openai` client against the tiny engine behind the real server:
json_schema / json_object outputs validate, regex and choice outputs match, a grammar request beside
plain greedy ones leaves their tokens those of the reference, and a bad schema or regex is a 400 naming
its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai
import pytest
from live_server import live_fixtures, tiny_engine_fixture

from mstar.engine.structured_output import Grammar, GrammarCompiler
from mstar.models.kimi_k3.generate import greedy_generate

MODEL = "kimi_k3_tiny"
HI = [{"role": "user", "content": "Give me a person as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


# 1024: the forced tool-call tests' declarations take 525 prompt tokens in the tiny vocabulary
engine = tiny_engine_fixture(max_seq_len=1024, kv_pages=256)
server, client = live_fixtures(MODEL, timeout=120)


def test_json_schema_outputs_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=120, temperature=temperature,
                                           response_format=fmt, extra_body={"chat_template_kwargs":
                                                                            {"thinking": False}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert jsonschema_rs.is_valid(SCHEMA, json.loads(choice.message.content)), choice.message.content


def test_json_object_regex_and_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=0.8,
                                  extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text), r.choices[0].text
    for body in ({"guided_choice": ["red", "green", "blue"]},
                 {"structured_outputs": {"choice": ["red", "green", "blue"]}}):
        r = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=10, temperature=1.0, extra_body=body)
        assert r.choices[0].text in ("red", "green", "blue"), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="n=", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "x" /[0-9]/ "y"'}})
    assert re.fullmatch("x[0-9]y", r.choices[0].text), r.choices[0].text


def test_completions_take_response_format(client, engine, tiny_model):
    # vLLM takes response_format on completions too, through the same grammars as chat's
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=120, temperature=1.0, seed=3,
                                  extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert jsonschema_rs.is_valid(SCHEMA, json.loads(r.choices[0].text)), r.choices[0].text
    # greedy, the tiny model writes one long string: the 40 tokens are a start that only JSON objects have
    vocab = tiny_model.config.vocab_size
    stops = tuple(t for t in engine.tokenizer.stop_ids if t < vocab)
    json_object = GrammarCompiler(engine.tokenizer.encoding, vocab, stops).matcher(
        Grammar("json_object", "", "response_format"))
    for fmt, valid in (({"type": "json_object"}, True), ({"type": "text"}, False)):
        r = client.completions.create(model=MODEL, prompt="An object:", max_tokens=40, temperature=0,
                                      extra_body={"response_format": fmt, "return_token_ids": True})
        ids = r.choices[0].token_ids
        assert (json_object.validate_tokens(ids) == len(ids)) == valid, r.choices[0].text


def test_grammar_request_leaves_plain_greedy_requests_unchanged(client, engine, tiny_model):
    prompts = [engine.tokenizer.encode(p) for p in ("def fibonacci(n):\n", "The sky is", "1, 2, 3,")]

    def plain(ids):
        return client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]

    def constrained():
        return client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0,
                                         extra_body={"guided_json": SCHEMA}).choices[0]

    with ThreadPoolExecutor(4) as pool:
        grammar = pool.submit(constrained)
        outs = list(pool.map(plain, prompts))
    assert jsonschema_rs.is_valid(SCHEMA, json.loads(grammar.result().text))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == greedy_generate(tiny_model, ids, 10)


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
])
def test_bad_grammars_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(next(iter(body))), err.value.body  # structured_outputs.grammar


# ---- forced tool calls (tool_choice "required" or a named function) ----------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "note": {"type": "string", "maxLength": 6}}}}}
# a string `pattern`: these calls carry their arguments as one JSON block (models/kimi_k3/tool_grammar.py)
CODE = {"type": "function", "function": {"name": "set_code", "parameters": {
    "type": "object", "required": ["code"], "additionalProperties": False,
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}, "on": {"type": "boolean"}}}}}
TOOLS = [WEATHER, CODE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


def _check_forced(choice, names: set[str]) -> list[tuple[str, dict]]:
    """The choice made tool calls only, of `names`, with arguments valid under their schemas."""
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content, choice
    calls = []
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in names and jsonschema_rs.is_valid(SCHEMAS[call.function.name], arguments), call
        calls.append((call.function.name, arguments))
    assert calls
    return calls


# The tiny model's weights are random: the grammar alone makes these valid. Two cases, as each token
# costs ~0.1 s here (several calls in one turn are tested on the grammar: test_tool_grammar.py).
@pytest.mark.parametrize(("tool_choice", "parallel", "temperature", "stream"), [
    ("required", False, 0.0, False),
    ({"type": "function", "function": {"name": "get_weather"}}, True, 1.0, True),
])
def test_forced_tool_calls_parse_and_validate(client, tool_choice, parallel, temperature, stream):
    names = set(SCHEMAS) if tool_choice == "required" else {tool_choice["function"]["name"]}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
              max_tokens=450, temperature=temperature, seed=11, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kw)
    calls = _check_forced(whole.choices[0], names)
    if not parallel or tool_choice != "required":
        assert len(calls) == 1
    if not stream:
        return
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for delta in chunk.choices[0].delta.tool_calls or ():
            streamed.setdefault(delta.index, []).append(delta.function.name or "")
            streamed[delta.index].append(delta.function.arguments or "")
    assert [(parts[0], json.loads("".join(parts[1:]))) for parts in streamed.values()] == calls


@pytest.mark.parametrize(("tool_choice", "temperature"), [({"type": "function", "name": "get_weather"}, 0.0),
                                                          ("required", 1.0)])
def test_forced_function_call_over_responses_parses_and_validates(client, tool_choice, temperature):
    """/v1/responses (what the Agents SDK speaks) forces the call as chat does: the function_call item's
    arguments are valid under the tool's schema. reasoning.effort "none" skips K3's think channel, which the
    tiny model's random weights would not close within the tokens there are."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                tool_choice=tool_choice, reasoning={"effort": "none"}, max_output_tokens=450,
                                temperature=temperature, parallel_tool_calls=False)
    assert r.status == "completed", r
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and not r.output_text, r.output
    names = set(SCHEMAS) if tool_choice == "required" else {tool_choice["name"]}
    assert calls[0].name in names and jsonschema_rs.is_valid(SCHEMAS[calls[0].name], json.loads(calls[0].arguments))


def test_forced_tool_choice_with_an_uncompilable_schema_is_a_400_naming_tools(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "a(b"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tools", err.value.body
