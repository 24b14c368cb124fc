"""Every kind of bad input is a 400 with an OpenAI error body that names the parameter; never a 500
or a hang, and no engine request is left behind."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, shared_tokenizer
from fastapi.testclient import TestClient

from mstar.server import build_app

MODEL = "kimi-k3-test"
MAX_SEQ_LEN = 256
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=MODEL)) as client:
        yield client


def long_text() -> str:
    return "word " * (MAX_SEQ_LEN * 2)


# (endpoint, body, expected param, a phrase of the message)
BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", None, "not valid JSON"),
    (COMPLETIONS, b"", None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", None, "must be a JSON object"),
    (COMPLETIONS, {}, "prompt", "required"),
    (COMPLETIONS, {"prompt": {"a": 1}}, "prompt", "prompt takes"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt[1]", "prompt takes"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": []}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": ["ok", ""]}, "prompt[1]", "empty"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": long_text()}, "prompt", "maximum context"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_SEQ_LEN}, "max_tokens", "does not fit"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "integer"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature", ">= 0"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', "temperature", "finite number"),
    (COMPLETIONS, b'{"prompt": "hi", "top_p": NaN}', "top_p", "finite number"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -2}, "top_k", ">= 0"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 100000}, "top_k", "vocabulary size"),  # the engine's own check
    (COMPLETIONS, {"prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
    (COMPLETIONS, {"prompt": "hi", "n": 1000}, "n", "less than or equal to 128"),
    (COMPLETIONS, {"prompt": ["a"] * 100, "n": 3}, "n", "choices per request"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs", "integer"),
    (COMPLETIONS, {"prompt": "hi", "stop": ""}, "stop", "non-empty"),
    (COMPLETIONS, {"prompt": "hi", "stop": [1]}, "stop[0]", "stop takes"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["s"] * 17}, "stop", "at most 16"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "hi", "seed": "x"}, "seed", "integer"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed", "less than or equal"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream", "boolean"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "bool"),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, "model", "does not exist"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),  # 0 only with echo
    (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "must be in [-2.0, 2.0]"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias", "must be token ids"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999999": 5}}, "logit_bias", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias", "[-100.0, 100.0]"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "above max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "greater than"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    (CHAT, {"messages": HI, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream"),
    (CHAT, {"messages": HI, "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "guided_regex": 5}, "guided_regex", "non-empty string"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "non-empty list"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs",
     "exactly one"),
    (COMPLETIONS, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, "use_beam_search", "beam search"),
    (CHAT, {}, "messages", "required"),
    (CHAT, {"messages": []}, "messages", "at least one"),
    (CHAT, {"messages": "hi"}, "messages", "valid array"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'user'"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "content takes"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "text-only"),
    (CHAT, {"messages": [{"role": "tool", "content": "result"}]}, "messages", "no tool name"),
    (CHAT, {"messages": [{"role": "user", "content": long_text()}]}, "messages", "maximum context"),
    # refused on its characters, before tokenizing (a token holds at most max_token_bytes of them)
    (CHAT, {"messages": [{"role": "user", "content": "a" * 10**6}]}, "messages", "characters"),
    (COMPLETIONS, {"prompt": ["hi", "a" * 10**6]}, "prompt[1]", "characters"),
    (CHAT, {"messages": HI, "model": "other"}, "model", "does not exist"),
    (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens", ">= 1"),
    (CHAT, {"messages": HI, "max_completion_tokens": MAX_SEQ_LEN}, "max_completion_tokens", "does not fit"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    (CHAT, {"messages": HI, "logprobs": 3}, "logprobs", "boolean"),
    (CHAT, {"messages": HI, "temperature": -0.5}, "temperature", ">= 0"),
    (CHAT, {"messages": HI, "top_k": 100000}, "top_k", "vocabulary size"),  # the engine's own check
    (CHAT, {"messages": HI, "n": 0}, "n", "greater than or equal to 1"),
    (CHAT, {"messages": HI, "chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking", "bool"),
    (CHAT, {"messages": HI, "chat_template_kwargs": {"thinkng": False}}, "chat_template_kwargs.thinkng",
     "Unknown field"),
    (CHAT, {"messages": HI, "chat_template_kwargs": {"thinking_effort": "extreme"}},
     "chat_template_kwargs.thinking_effort", "not supported"),
    (CHAT, {"messages": HI, "tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name",
     "at least 1"),
    (CHAT, {"messages": HI, "tool_choice": "always"}, "tool_choice", "tool_choice takes"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, "tool_choice", "declares no tools"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "does not declare"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, "response_format", "at most one"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs json_schema.schema"),
    (CHAT, {"messages": HI, "guided_json": "{bad"}, "guided_json", "not valid JSON"),
    (CHAT, {"messages": HI, "guided_choice": ["a", 1]}, "guided_choice", "non-empty list of strings"),
    (CHAT, {"messages": HI, "guided_grammar": ""}, "guided_grammar", "non-empty string"),
    (CHAT, {"messages": HI, "chat_template": "{{ messages }}"}, "chat_template", "K3's own chat format"),
    (CHAT, {"messages": HI, "reasoning_effort": "extreme"}, "reasoning_effort", "not supported"),
    (CHAT, {"messages": HI, "reasoning_effort": "low", "chat_template_kwargs": {"thinking_effort": "high"}},
     "reasoning_effort", "disagree"),
    (CHAT, {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}},
     "reasoning_effort", "turns thinking off"),
    (CHAT, {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"thinking_effort": "high"}},
     "reasoning_effort", "disagree"),
    (CHAT, {"messages": HI, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message", "assistant's"),
    (CHAT, {"messages": [*HI, {"role": "assistant", "content": "x"}], "continue_final_message": True},
     "add_generation_prompt", "set add_generation_prompt to false"),
    (CHAT, {"messages": HI, "stop_token_ids": [-3]}, "stop_token_ids", "outside the vocabulary"),
    (CHAT, {"messages": HI, "repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
]


# Each JSON body also as a streaming request: the 400 must come before any event is sent.
CASES = [(*case, stream) for case in BAD_REQUESTS for stream in (False, True)
         if isinstance(case[1], dict) or not stream]


@pytest.mark.parametrize(("endpoint", "body", "param", "phrase", "stream"), CASES)
def test_bad_request_is_400(client, engine, endpoint, body, param, phrase, stream):
    if isinstance(body, dict):
        if stream and "stream" not in body:
            body = {**body, "stream": True}
        response = client.post(endpoint, json=body)
    else:
        response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert phrase in error["message"], error["message"]
    assert not engine.active


def test_neutral_unsupported_values_are_accepted(client):
    body = {"prompt": "hi", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "best_of": 1, "echo": False, "user": "u", "guided_json": None, "use_beam_search": False,
            "skip_special_tokens": True, "prompt_logprobs": None, "vllm_xargs": None, "add_special_tokens": True,
            "stream_options": None}
    assert client.post(COMPLETIONS, json=body).status_code == 200
    # what OpenAI's documentation lists, at the values a client sends when it does not ask for the feature
    chat = {"messages": [*HI, {"role": "assistant", "content": "yo", "refusal": None, "annotations": [],
                               "audio": None, "function_call": None}, {"role": "user", "content": "more"}],
            "max_tokens": 2, "n": 1, "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "modalities": ["text"], "stream_options": {"include_usage": True},
            "safety_identifier": "s", "prompt_cache_key": "p", "functions": None, "function_call": None,
            "prediction": None, "add_special_tokens": False}
    assert client.post(CHAT, json=chat).status_code == 200, client.post(CHAT, json=chat).text


# What a probe sent and got a 200 for, the field ignored: now each is honoured or a 400 naming it.
PROBED = [
    (COMPLETIONS, {"top_logprobs": 2}, "top_logprobs", "Unknown field 'top_logprobs'"),
    (COMPLETIONS, {"vllm_xargs": {"a": 1}}, "vllm_xargs", "not supported"),
    (COMPLETIONS, {"documents": [{"text": "x"}]}, "documents", "Unknown field 'documents'"),
    (COMPLETIONS, {"some_future_field": [1, 2]}, "some_future_field", "Unknown field"),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions", "declare them as tools"),
    (CHAT, {"function_call": "auto"}, "function_call", "use tool_choice"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "text only"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    (CHAT, {"documents": [{"text": "x"}]}, "documents", "put them in a message"),
    (CHAT, {"store": True}, "store", "stores no completions"),
    (CHAT, {"service_tier": "flex"}, "service_tier", "one tier"),
    (CHAT, {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", "padding"),
    (CHAT, {"messages": [*HI, {"role": "assistant", "content": None, "refusal": "no"}]}, "messages[1].refusal",
     "'content'"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "nickname": "x"}], "colour": 1},
     "messages[0].nickname", "Unknown fields 'messages[0].nickname', 'colour'"),
    (CHAT, {"response_format": {"type": "json_object", "json_schema": {"schema": {}}, "mode": "x"}},
     "response_format.mode", "Unknown field"),
]


@pytest.mark.parametrize(("endpoint", "extra", "param", "phrase"), PROBED, ids=[c[2] for c in PROBED])
def test_unimplemented_and_unknown_fields_are_a_400_naming_them(client, engine, endpoint, extra, param, phrase):
    body = {"prompt": "hi"} if endpoint == COMPLETIONS else {"messages": HI}
    response = client.post(endpoint, json={**body, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"], error
    assert error["code"] in ("unknown_parameter", "unsupported")
    assert not engine.active


def test_unknown_route_and_method(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = client.get(COMPLETIONS)
    assert response.status_code == 405 and "message" in response.json()["error"]


def test_invalid_requests_are_counted(client):
    before = _invalid_count(client)
    client.post(COMPLETIONS, json={"prompt": "hi", "top_p": 7})
    client.post(COMPLETIONS, json={"prompt": "hi", "top_k": 100000})  # refused by the engine
    assert _invalid_count(client) == before + 2


def _invalid_count(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'mstar_request_failure_total{{model_name="{MODEL}",reason="invalid_request"}}'):
            return float(line.split()[-1])
    raise AssertionError("no invalid_request counter")


def test_unhealthy_engine_is_503(client, engine):
    engine.is_healthy = False
    try:
        response = client.post(COMPLETIONS, json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unhealthy"
        assert client.post(CHAT, json={"messages": HI}).status_code == 503
        assert client.get("/health").status_code == 503
    finally:
        engine.is_healthy = True
    assert client.get("/health").status_code == 200
