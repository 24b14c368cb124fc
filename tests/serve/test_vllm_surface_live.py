"""vLLM's request fields and routes against the real tiny engine behind the real server, through the
`openai` client: each honoured field changes the output as its definition says (checked against the
reference model with the same processing), each refused one is a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import live_fixtures, tiny_engine_fixture
from logits_reference import reference_processed_greedy

from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.chat import encode_chat
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.server.protocol import CHAT_REFUSED, REFUSED

MODEL = "kimi_k3_tiny"
GREEDY = {"ignore_eos": True, "return_token_ids": True}
HI = [{"role": "user", "content": "Say hi."}]


engine = tiny_engine_fixture(max_seq_len=512, kv_pages=128)
server, client = live_fixtures(MODEL, timeout=60)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("def fibonacci(n):\n")


def complete(client, prompt, max_tokens=8, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={**GREEDY, **extra}).choices[0]


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.7},
    {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    {"logit_bias": "first-token"},
    {"min_tokens": 5, "stop_token_ids": "first-token"},
], ids=["repetition", "presence+frequency", "logit_bias", "min_tokens"])
def test_processing_fields_follow_their_definition(client, tiny_model, prompt, fields):
    free = greedy_generate(tiny_model, prompt, 8)
    if fields.get("logit_bias") == "first-token":
        fields = {"logit_bias": {str(free[0]): -100}}
    if fields.get("stop_token_ids") == "first-token":
        fields = {**fields, "stop_token_ids": [free[0]]}  # without min_tokens: one token, then stop
    choice = complete(client, prompt, **fields)
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=fields.get("min_tokens", 0),
                            presence_penalty=fields.get("presence_penalty", 0.0),
                            frequency_penalty=fields.get("frequency_penalty", 0.0),
                            repetition_penalty=fields.get("repetition_penalty", 1.0),
                            logit_bias=tuple((int(k), v) for k, v in fields.get("logit_bias", {}).items()))
    stop_ids = frozenset(fields.get("stop_token_ids", ()))
    assert choice.token_ids == reference_processed_greedy(tiny_model, prompt, params, stop_ids)
    if "logit_bias" in fields:
        assert choice.token_ids[0] != free[0]
    if "min_tokens" in fields:
        assert len(choice.token_ids) >= 5


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny_model, prompt):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={**GREEDY, "truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].token_ids == greedy_generate(tiny_model, prompt[-3:], 6)


def test_echo_and_continuous_usage(client):
    r = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text.startswith("import os\n")
    chunks = list(client.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, stream=True, echo=True,
                                            temperature=0, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].text.startswith("import os\n")
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks][-1] == 4 and chunks[-1].usage.total_tokens == 4 + \
        chunks[-1].usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_reasoning_effort_continue_and_reasoning_field(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, reasoning_effort="low",
                                       extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == encode_chat(engine.tokenizer, HI, thinking_effort="low")
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    # "none", OpenAI's value for no reasoning: K3's thinking off, as chat_template_kwargs.thinking=false asks
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, reasoning_effort="none",
                                       extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == encode_chat(engine.tokenizer, HI, thinking=False)
    assert r.prompt_token_ids != encode_chat(engine.tokenizer, HI)
    assert not r.choices[0].message.model_extra.get("reasoning_content")
    partial = [*HI, {"role": "assistant", "content": "Hi th"}]
    r = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4,
                                       extra_body={"return_token_ids": True, "continue_final_message": True,
                                                   "add_generation_prompt": False})
    want = encode_chat(engine.tokenizer, partial, continue_final_message=True, add_generation_prompt=False)
    assert r.prompt_token_ids == want and want[-len(engine.tokenizer.encode("Hi th")):] == \
        engine.tokenizer.encode("Hi th")


def _not_neutral(neutral):
    return "x" if neutral is None else (not neutral if isinstance(neutral, bool) else 7)


REFUSED_CASES = [(name, {name: _not_neutral(refused.neutral[0])}) for name, refused in
                 {**REFUSED, **CHAT_REFUSED}.items()]
REFUSED_CASES += [
    ("chat_template", {"chat_template": "{{ x }}"}),
    ("some_future_field", {"some_future_field": [1, 2]}),  # unknown: a 400 listing it, never ignored
]


@pytest.mark.parametrize(("name", "body"), REFUSED_CASES, ids=[c[0] for c in REFUSED_CASES])
def test_refused_fields_are_a_400_naming_them(client, name, body):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=body)
    assert err.value.body["param"] == name, err.value.body


def test_tokenize_detokenize_version_ping(server, engine):
    tok = engine.tokenizer
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 512 and "".join(r["token_strs"]) == "hello world"
        r = http.post("/tokenize", json={"messages": HI, "model": MODEL}).json()
        assert r["tokens"] == encode_chat(tok, HI) and r["token_strs"] is None
        assert http.post("/detokenize", json={"tokens": tok.encode("a b c")}).json() == {"prompt": "a b c"}
        bad = http.post("/detokenize", json={"tokens": [10**8]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert isinstance(http.get("/version").json()["version"], str)
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


# ---- /v1/responses ------------------------------------------------------------------------------


def test_responses_text_equals_chat_and_streams_the_same(client):
    kw = dict(model=MODEL, instructions="Be brief.", input="Say hi.", max_output_tokens=12, temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.usage.output_tokens <= 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Say hi."}],
                                          max_tokens=12, temperature=0).choices[0]
    reasoning = [i for i in r.output if i.type == "reasoning"]
    assert (reasoning[0].content[0].text if reasoning else None) == (chat.message.model_extra["reasoning_content"]
                                                                     or None)
    assert r.output_text == (chat.message.content or "")
    assert (r.status == "incomplete") == (chat.finish_reason == "length")
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if r.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_refuses_what_it_does_not_honour(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", extra_body=body)
    assert err.value.body["param"] == param, err.value.body
