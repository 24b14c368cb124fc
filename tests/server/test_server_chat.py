"""POST /v1/chat/completions through FastAPI's TestClient against the deterministic fake engine:
prompt building, reasoning/content/tool-call splitting, streaming equal to non-streaming."""

from __future__ import annotations

import json

import pytest
from fake_engine import EXPECTED_TOOL_CALLS, FakeEngine, shared_tokenizer, sse
from fastapi.testclient import TestClient

from mstar.models.kimi_k3.assistant_output import parse_assistant_output
from mstar.models.kimi_k3.chat import encode_chat
from mstar.models.kimi_k3.tool_grammar import forced_tool_call_grammar
from mstar.server import build_app

MODEL = "kimi-k3-test"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return shared_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module", params=[1, 3], ids=["1-token-deltas", "3-token-deltas"])
def engine(request, tok):
    return FakeEngine(tok, max_seq_len=2048, tokens_per_delta=request.param)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=MODEL)) as client:
        yield client


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat_stream(client, **body) -> list[dict]:
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse(response.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def merge_stream(events: list[dict]) -> dict[int, dict]:
    """Per choice: the role, concatenated reasoning/content, tool calls, token ids, logprobs, finish."""
    out: dict[int, dict] = {}
    for event in events:
        assert event["object"] == "chat.completion.chunk"
        for choice in event["choices"]:
            entry = out.setdefault(choice["index"], {"role": None, "reasoning": "", "content": "", "tool_calls": [],
                                                     "token_ids": [], "logprobs": [], "finish_reason": None,
                                                     "kinds": []})
            assert entry["finish_reason"] is None, "a chunk after the choice finished"
            delta = choice["delta"]
            if "role" in delta:
                assert entry["role"] is None and not entry["kinds"], "the role comes first, once"
                entry["role"] = delta["role"]
            assert delta.get("reasoning") == delta.get("reasoning_content"), "vLLM's name carries the same text"
            for key, field in (("reasoning_content", "reasoning"), ("content", "content")):
                if delta.get(key):
                    entry[field] += delta[key]
                    entry["kinds"].append(field)
            for call in delta.get("tool_calls") or []:
                assert call["index"] == len(entry["tool_calls"])
                entry["tool_calls"].append(call)
                entry["kinds"].append("tool_calls")
            entry["token_ids"] += choice.get("token_ids") or []
            entry["logprobs"] += (choice["logprobs"] or {}).get("content") or []
            entry["finish_reason"] = choice["finish_reason"]
    return out


def calls_of(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def test_prompt_is_encode_chat_and_reply_is_split(client, engine, tok):
    body = chat(client, model=MODEL, messages=user("Hello there"), seed=1, return_token_ids=True)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    expected_prompt = encode_chat(tok, user("Hello there"), None, thinking=True)
    assert engine.calls[-1].prompt_ids == expected_prompt == body["prompt_token_ids"]
    [choice] = body["choices"]
    message = choice["message"]
    assert message["role"] == "assistant" and "tool_calls" not in message
    assert message["reasoning_content"].startswith("I think about")
    assert message["reasoning"] == message["reasoning_content"]  # current vLLM's name
    assert message["content"].startswith("Answer:")
    assert choice["finish_reason"] == "stop"
    parsed = parse_assistant_output(choice["token_ids"], tokenizer=tok, thinking=True)
    assert (message["reasoning_content"], message["content"]) == (parsed.reasoning_content, parsed.content)
    assert body["usage"] == {"prompt_tokens": len(expected_prompt), "completion_tokens": len(choice["token_ids"]),
                             "total_tokens": len(expected_prompt) + len(choice["token_ids"]),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.calls[-1].params.max_tokens == engine.max_seq_len - len(expected_prompt)


def test_thinking_off(client, engine, tok):
    body = chat(client, messages=user("Hi"), chat_template_kwargs={"thinking": False})
    assert engine.calls[-1].prompt_ids == encode_chat(tok, user("Hi"), None, thinking=False)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"].startswith("Answer:")


def test_thinking_effort_and_content_parts(client, engine, tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    chat(client, messages=parts, chat_template_kwargs={"thinking": True, "thinking_effort": "low"})
    assert engine.calls[-1].prompt_ids == encode_chat(tok, parts, None, thinking=True, thinking_effort="low")


def test_tool_calls(client, engine, tok):
    body = chat(client, messages=user("Weather? [[tool]]"), tools=[WEATHER_TOOL, TIME_TOOL], seed=2)
    assert engine.calls[-1].prompt_ids == encode_chat(tok, user("Weather? [[tool]]"), [WEATHER_TOOL, TIME_TOOL])
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls_of(calls) == EXPECTED_TOOL_CALLS
    assert all(c["type"] == "function" and c["id"] for c in calls) and len({c["id"] for c in calls}) == 2
    assert choice["message"]["content"].startswith("Answer:")


def test_malformed_tool_section_is_kept_as_content(client):
    message = chat(client, messages=user("[[badtool]]"), seed=2)["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"].endswith('<|open|>tools<|sep|><|open|>call index="1"<|sep|>oops<|close|>call<|sep|>'
                                       "<|close|>tools<|sep|>")


def test_spelled_markup_stays_text(client):
    message = chat(client, messages=user("[[spelled]]"), tools=[WEATHER_TOOL])["choices"][0]["message"]
    assert "<|open|>tools<|sep|> and <|close|>response<|sep|> as text" in message["content"]
    assert "tool_calls" not in message


@pytest.mark.parametrize("directive", ["plain", "[[tool]]", "[[badtool]]", "[[spelled]]", "[[stray]]"])
def test_stream_equals_whole(client, directive):
    body = {"messages": user(f"go {directive}"), "tools": [WEATHER_TOOL], "seed": 11, "n": 2, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True}
    whole = chat(client, **body)
    streamed = merge_stream(chat_stream(client, **body))
    assert sorted(streamed) == [0, 1]
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        message = choice["message"]
        assert got["role"] == "assistant"
        assert (got["reasoning"] or None) == message["reasoning_content"]
        assert got["content"] == (message["content"] or "")
        assert calls_of(got["tool_calls"]) == calls_of(message.get("tool_calls") or [])
        assert got["token_ids"] == choice["token_ids"]
        assert got["logprobs"] == choice["logprobs"]["content"]
        assert got["finish_reason"] == choice["finish_reason"]
        kinds = got["kinds"]
        first_content = kinds.index("content") if "content" in kinds else len(kinds)
        assert "reasoning" not in kinds[first_content:], "reasoning after content"


def test_stream_chunks_and_usage(client, tok):
    events = chat_stream(client, messages=user("usage"), max_completion_tokens=12,
                         stream_options={"include_usage": True}, return_token_ids=True)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["prompt_token_ids"] == encode_chat(tok, user("usage"), None)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    no_usage = chat_stream(client, messages=user("usage"), max_tokens=3)
    assert all("usage" not in e for e in no_usage)


def test_length_cut_inside_thinking(client):
    body = chat(client, messages=user("short"), max_tokens=3)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"]


def test_seeded_choices(client, engine):
    body = chat(client, messages=user("seeds"), n=3, seed=40)
    assert [call.params.seed for call in engine.calls[-3:]] == [40, 41, 42]
    for i, choice in enumerate(body["choices"]):
        alone = chat(client, messages=user("seeds"), seed=40 + i)["choices"][0]
        assert alone["message"] == choice["message"]


def test_stop_string_in_chat(client):
    whole = chat(client, messages=user("stop"), seed=7)["choices"][0]["message"]
    words = whole["content"].split()
    stop = words[-1]
    cut = chat(client, messages=user("stop"), seed=7, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["message"]["content"] == whole["content"][: whole["content"].index(stop)]
    assert cut["message"]["reasoning_content"] == whole["reasoning_content"]
    streamed = merge_stream(chat_stream(client, messages=user("stop"), seed=7, stop=[stop]))[0]
    assert streamed["content"] == cut["message"]["content"] and streamed["finish_reason"] == "stop"


def test_chat_logprobs_format(client, tok):
    body = chat(client, messages=user("lp"), logprobs=True, top_logprobs=3, return_token_ids=True, max_tokens=20)
    choice = body["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(choice["token_ids"]) == 20
    for entry, token_id in zip(entries, choice["token_ids"], strict=True):
        assert bytes(entry["bytes"]) == tok.token_bytes(token_id)
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
    assert chat(client, messages=user("lp"), max_tokens=2)["choices"][0]["logprobs"] is None
    assert chat(client, messages=user("lp"), logprobs=True, max_tokens=2)["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []


def test_conversation_with_tool_results(client, engine, tok):
    messages = [
        {"role": "developer", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat(client, messages=messages, tools=[WEATHER_TOOL])
    as_system = [{**messages[0], "role": "system"}] + messages[1:]
    assert engine.calls[-1].prompt_ids == encode_chat(tok, as_system, [WEATHER_TOOL])


def test_tool_choice_none_and_auto_are_rendered(client, engine, tok):
    chat(client, messages=user("time"), tools=[WEATHER_TOOL], tool_choice="none")
    assert engine.calls[-1].prompt_ids == encode_chat(tok, user("time"), [WEATHER_TOOL], tool_choice="none")
    chat(client, messages=user("time"), tools=[WEATHER_TOOL], tool_choice="auto")
    assert engine.calls[-1].prompt_ids == encode_chat(tok, user("time"), [WEATHER_TOOL])


@pytest.mark.parametrize("thinking", [True, False])
def test_forced_tool_choices_render_the_required_note_and_send_the_tool_grammar(client, engine, tok, thinking):
    tools = [WEATHER_TOOL, TIME_TOOL]
    kwargs = {"chat_template_kwargs": {"thinking": thinking}}
    want_prompt = encode_chat(tok, user("time"), tools, tool_choice="required", thinking=thinking)
    for choice, name, parallel in (("required", None, True), ("required", None, False),
                                   ({"type": "function", "function": {"name": "get_time"}}, "get_time", True)):
        chat(client, messages=user("time"), tools=tools, tool_choice=choice, parallel_tool_calls=parallel, **kwargs)
        call = engine.calls[-1]
        assert call.prompt_ids == want_prompt
        assert call.params.grammar.source == forced_tool_call_grammar(tools, name=name, starts_in_think=thinking,
                                                                      parallel=parallel)


def test_response_format_text_changes_nothing(client, engine, tok):
    chat(client, messages=user("json"), response_format={"type": "text"})
    assert engine.calls[-1].prompt_ids == encode_chat(tok, user("json"), None)


def test_engine_error_mid_stream(client, engine):
    events = chat_stream(client, messages=user("[[engine-error]]"))
    assert "simulated engine failure" in events[-1]["error"]["message"]
    assert not engine.active


def test_no_request_left_behind(client, engine):
    for _ in range(3):
        chat(client, messages=user("x"), max_tokens=2)
    assert not engine.active and not engine.aborted
