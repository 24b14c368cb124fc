"""The server under uvicorn on 127.0.0.1 (a free port, a background thread), driven by the real
`openai` client and by httpx: the client's own parsing of our responses, and client disconnects
(streaming and not) aborting the engine requests."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import EXPECTED_TOOL_CALLS, FakeEngine, shared_tokenizer
from live_server import live_fixtures, wait_until

MODEL = "kimi-k3-live"
CANCELLED = f'mstar_request_failure_total{{model_name="{MODEL}",reason="cancelled"}}'
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=2048)


server, client = live_fixtures(MODEL, timeout=20)


# ---- the openai client ------------------------------------------------------------------------


def test_models(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, seed=3, logprobs=2,
                                    extra_body={"return_token_ids": True, "top_k": 50})
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert len(choice.logprobs.tokens) == 6 and len(choice.logprobs.top_logprobs) == 6
    assert len(choice.token_ids) == 6  # vLLM's extension, kept as an extra field
    assert out.usage.completion_tokens == 6


def test_completion_stream(client):
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, seed=8, n=2)
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, seed=8, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.completion_tokens == 20


def test_chat_with_tools_and_reasoning(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather? [[tool]]"}], tools=[WEATHER_TOOL], seed=1
    )
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_TOOL_CALLS
    assert choice.message.reasoning_content.startswith("I think about")
    assert choice.message.content.startswith("Answer:")


def test_chat_stream(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "go [[tool]]"}], "tools": [WEATHER_TOOL],
              "seed": 5, "logprobs": True, "top_logprobs": 1}
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, calls, logprobs, finish = "", "", [], [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            logprobs += (choice.logprobs.content or []) if choice.logprobs else []
            finish = choice.finish_reason or finish
    assert reasoning == whole.message.reasoning_content and content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert [e.token for e in logprobs] == [e.token for e in whole.logprobs.content]
    assert finish == "tool_calls"


def test_chat_extensions_through_extra_body(client, engine):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=30,
        extra_body={"chat_template_kwargs": {"thinking": False}, "return_token_ids": True, "ignore_eos": True},
    )
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content.startswith("Answer:")
    assert out.prompt_token_ids == engine.calls[-1].prompt_ids
    assert engine.calls[-1].params.ignore_eos and out.choices[0].finish_reason == "length"


def test_errors_reach_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="not-this-one", prompt="hi")
    assert err.value.param == "model" and err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert err.value.param == "temperature" and "temperature" in err.value.message
    with pytest.raises(openai.APIError, match="simulated engine failure"):
        for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[engine-error]]"}],
                                                stream=True):
            pass


# ---- disconnects ----------------------------------------------------------------------------------


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exposed")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_streaming_disconnect_aborts(server, engine, endpoint, n):
    body = {"max_tokens": 1000, "ignore_eos": True, "stream": True, "n": n}
    if endpoint == "/v1/completions":
        body["prompt"] = "[[slow]] tell me everything"
    else:
        body["messages"] = [{"role": "user", "content": "[[slow]] tell me everything"}]
    cancelled = _metric(server, CANCELLED)
    with httpx.Client(base_url=server.url, timeout=10) as http, http.stream("POST", endpoint, json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                request_id = json.loads(line[6:])["id"]
                events += 1
            if events == 4:
                break
    ids = {f"{request_id}-{i}" for i in range(n)}
    assert wait_until(lambda: not engine.active & ids), "the engine requests were not aborted"
    assert ids <= set(engine.aborted)
    assert wait_until(lambda: _metric(server, CANCELLED) == cancelled + n)


def test_openai_stream_closed_early_aborts(client, engine):
    stream = client.completions.create(model=MODEL, prompt="[[slow]] more", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    stream.close()
    request_id = first.id + "-0"
    assert wait_until(lambda: request_id not in engine.active) and request_id in engine.aborted


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_aborts(server, engine, endpoint):
    marker = f"[[slow]] whole {endpoint}"
    body = {"max_tokens": 1000, "ignore_eos": True}
    body.update({"prompt": marker} if endpoint == "/v1/completions" else {"messages": [{"role": "user",
                                                                                         "content": marker}]})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + endpoint, json=body, timeout=httpx.Timeout(5, read=0.3))
    started = [c.request_id for c in engine.calls if marker in engine.tokenizer.decode(c.prompt_ids)]
    assert len(started) == 1
    assert wait_until(lambda: started[0] not in engine.active), "the engine request was not aborted"
    assert started[0] in engine.aborted


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_before_the_first_token_aborts(server, engine, endpoint):
    """A streamed request answers only with its first token: leaving before that must abort too."""
    marker = f"[[late]] {endpoint}"
    body = {"max_tokens": 10, "stream": True}
    body.update({"prompt": marker} if endpoint == "/v1/completions" else {"messages": [{"role": "user",
                                                                                         "content": marker}]})
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", server.url + endpoint, json=body,
                                                        timeout=httpx.Timeout(5, read=0.3)) as response:
        response.read()
    started = [c.request_id for c in engine.calls if marker in engine.tokenizer.decode(c.prompt_ids)]
    assert len(started) == 1
    assert wait_until(lambda: started[0] not in engine.active), "the engine request was not aborted"
    assert started[0] in engine.aborted


def test_server_still_serves_after_disconnects(client, engine):
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text
    assert wait_until(lambda: not engine.active)
