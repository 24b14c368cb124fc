"""POST /v1/completions through FastAPI's TestClient against the deterministic fake engine."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, shared_tokenizer, sse
from fastapi.testclient import TestClient

from mstar.server import build_app

MODEL = "kimi-k3-test"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return shared_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(tok):
    return FakeEngine(tok, max_seq_len=512)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=MODEL)) as client:
        yield client


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, **body) -> list:
    response = client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def streamed_choices(events: list) -> dict[int, dict]:
    """Per choice index: concatenated text and token ids, and the finish reason."""
    out: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            entry = out.setdefault(choice["index"], {"text": "", "token_ids": [], "finish_reason": None, "chunks": 0})
            assert entry["finish_reason"] is None, "a chunk after the choice finished"
            entry["text"] += choice["text"]
            entry["token_ids"] += choice.get("token_ids") or []
            entry["finish_reason"] = choice["finish_reason"]
            entry["chunks"] += 1
    return out


def test_basic_completion_shape(client, engine):
    body = complete(client, model=MODEL, prompt="Once upon a time", max_tokens=8, user="someone")
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["text"] and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and "token_ids" not in choice
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] == len(engine.tokenizer.encode("Once upon a time"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert engine.calls[-1].request_id == body["id"] + "-0"
    assert not engine.active


def test_prompt_forms_give_the_same_prompt_ids(client, engine, tok):
    ids = tok.encode("def main():")
    outs = [complete(client, prompt=p, max_tokens=4, temperature=0, return_token_ids=True)
            for p in ("def main():", ["def main():"], ids, [ids])]
    for out in outs:
        assert out["choices"][0]["prompt_token_ids"] == ids
        assert out["choices"][0]["text"] == outs[0]["choices"][0]["text"]


def test_several_prompts_each_get_n_choices(client, tok):
    body = complete(client, prompt=["first prompt", "second one"], n=2, max_tokens=3, seed=5, return_token_ids=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [tok.encode("first prompt")] * 2 + [
        tok.encode("second one")
    ] * 2
    assert body["usage"]["prompt_tokens"] == len(tok.encode("first prompt")) + len(tok.encode("second one"))
    assert body["usage"]["completion_tokens"] == 12
    single = complete(client, prompt="second one", max_tokens=3, seed=6)
    assert body["choices"][3]["text"] == single["choices"][0]["text"]


def test_greedy_is_deterministic_and_seeds_choose_choices(client, engine):
    greedy = [complete(client, prompt="abc", max_tokens=12, temperature=0)["choices"][0]["text"] for _ in range(2)]
    assert greedy[0] == greedy[1]
    body = complete(client, prompt="abc", max_tokens=12, n=3, seed=100)
    seeds = [call.params.seed for call in engine.calls[-3:]]
    assert seeds == [100, 101, 102]
    assert len({call.request_id for call in engine.calls[-3:]}) == 3
    for i, choice in enumerate(body["choices"]):
        alone = complete(client, prompt="abc", max_tokens=12, seed=100 + i)
        assert choice["text"] == alone["choices"][0]["text"]
    assert len({c["text"] for c in body["choices"]}) > 1


def test_unseeded_choices_have_no_seed(client, engine):
    complete(client, prompt="abc", max_tokens=2, n=2)
    assert [call.params.seed for call in engine.calls[-2:]] == [None, None]


def test_sampling_fields_reach_the_engine(client, engine):
    complete(client, prompt="abc", max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
             stop=["zz"], stop_token_ids=[7], ignore_eos=True)
    params = engine.calls[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 40, 0.05)
    assert params.stop == ("zz",) and params.stop_token_ids == (7,) and params.ignore_eos
    assert params.max_tokens == 3
    complete(client, prompt="abc")
    assert engine.calls[-1].params.max_tokens == 16  # OpenAI's default


def test_stop_string_cuts_the_text(client):
    full = complete(client, prompt="stop test", max_tokens=40, seed=3)["choices"][0]["text"]
    words = full.split()
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    for body in (complete(client, prompt="stop test", max_tokens=40, seed=3, stop=stop),
                 complete(client, prompt="stop test", max_tokens=40, seed=3, stop=["never-there", stop])):
        [choice] = body["choices"]
        assert choice["text"] == expected
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    streamed = streamed_choices(stream(client, prompt="stop test", max_tokens=40, seed=3, stop=[stop]))
    assert streamed[0]["text"] == expected and streamed[0]["finish_reason"] == "stop"
    included = complete(client, prompt="stop test", max_tokens=40, seed=3, stop=stop, include_stop_str_in_output=True)
    assert included["choices"][0]["text"] == expected + stop


def test_stop_token_ids_and_ignore_eos(client, tok):
    natural = complete(client, prompt="eos test", max_tokens=200, seed=1, return_token_ids=True)["choices"][0]
    assert natural["finish_reason"] == "stop" and natural["token_ids"][-1] == tok.eos_id
    assert natural["stop_reason"] == tok.eos_id
    stop_id = natural["token_ids"][3]
    cut = complete(client, prompt="eos test", max_tokens=200, seed=1, return_token_ids=True, stop_token_ids=[stop_id])
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == natural["token_ids"][: natural["token_ids"].index(stop_id) + 1]
    endless = complete(client, prompt="eos test", max_tokens=200, seed=1, ignore_eos=True)
    assert endless["choices"][0]["finish_reason"] == "length"
    assert endless["usage"]["completion_tokens"] == 200


def test_logprobs_format(client, tok):
    body = complete(client, prompt="logprob test", max_tokens=10, seed=2, logprobs=3, return_token_ids=True)
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    n = len(choice["token_ids"])
    assert n == 10
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(logprobs[key]) == n
    assert logprobs["tokens"] == [tok.token_bytes(i).decode("utf-8", "replace") for i in choice["token_ids"]]
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"])
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                   strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 4
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    zero = complete(client, prompt="logprob test", max_tokens=3, seed=2, logprobs=0)["choices"][0]["logprobs"]
    assert all(len(top) == 1 for top in zero["top_logprobs"])


def test_streaming_matches_the_whole_response(client, tok):
    whole = complete(client, prompt="stream me", max_tokens=30, seed=9, n=3, return_token_ids=True)
    events = stream(client, prompt="stream me", max_tokens=30, seed=9, n=3, return_token_ids=True)
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert len({e["id"] for e in events}) == 1
    streamed = streamed_choices(events)
    assert sorted(streamed) == [0, 1, 2]
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got["text"] == choice["text"]  # each choice's chunks arrive in order
        assert got["token_ids"] == choice["token_ids"]
        assert got["finish_reason"] == choice["finish_reason"]
        assert got["chunks"] > 1
    firsts = {}
    for event in events:
        for c in event["choices"]:
            firsts.setdefault(c["index"], c)
    assert all(c["prompt_token_ids"] == tok.encode("stream me") for c in firsts.values())


def test_stream_include_usage(client):
    events = stream(client, prompt="usage please", max_tokens=5, stream_options={"include_usage": True})
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_stream_logprobs_concatenate(client):
    whole = complete(client, prompt="lp stream", max_tokens=8, seed=4, logprobs=2)["choices"][0]["logprobs"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in stream(client, prompt="lp stream", max_tokens=8, seed=4, logprobs=2):
        for choice in event["choices"]:
            for key in merged:
                merged[key] += (choice["logprobs"] or {}).get(key, [])
    assert merged == whole


def test_engine_failure_is_reported(client, engine):
    response = client.post("/v1/completions", json={"prompt": "[[engine-error]] go", "max_tokens": 10})
    assert response.status_code == 500
    error = response.json()["error"]
    assert "simulated engine failure" in error["message"] and error["code"] == "engine_error"
    events = sse(client.post("/v1/completions", json={"prompt": "[[engine-error]] go", "max_tokens": 10,
                                                      "stream": True}).text)
    assert events[-1] == "[DONE]" and "simulated engine failure" in events[-2]["error"]["message"]
    assert not engine.active


def test_unexpected_exception_is_a_generic_500(client, engine):
    for stream in (False, True):  # a failure before the first output is a plain 500 when streaming too
        response = client.post("/v1/completions", json={"prompt": "[[crash]]", "max_tokens": 3, "stream": stream})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "internal_server_error" and "secret" not in error["message"]
    assert not engine.active
