"""A careless or hostile client gets a careful answer: deeply nested tool arguments, trailing-slash
paths, huge echoed values, internal errors (generic body with an error id, tracebacks rate-limited),
and a client gone while its body is read (INFO, no traceback)."""

from __future__ import annotations

import logging

import pytest
from fake_engine import FakeEngine, shared_tokenizer
from fastapi.testclient import TestClient

from mstar.server import build_app
from mstar.server.errors import ECHO_CHARS, TRACEBACKS

MODEL = "fake-k3"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=2048)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=MODEL), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("depth", [1_000, 5_000, 50_000])
def test_deeply_nested_tool_arguments_are_a_400_naming_messages(client, depth):
    arguments = "[" * depth + "]" * depth
    arguments = '{"a": ' + arguments + "}"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    if depth <= 1_000 and r.status_code == 200:  # shallow enough for Python's parser: served
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "nested too deeply" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/chat/completions/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(client, path):
    r = client.post(path, json={"prompt": "x", "max_tokens": 1}, headers={"Host": "evil.example"},
                    follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers


def test_a_huge_model_name_is_not_echoed_whole(client):
    name = "m" * 100_000
    r = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400
    assert len(r.json()["error"]["message"]) < ECHO_CHARS + 200 and "100002 characters" in r.text
    r = client.get("/v1/models/" + "m" * 5_000)  # a longer URL is a 414
    assert r.status_code == 404 and len(r.text) < ECHO_CHARS + 300 and "5002 characters" in r.text


def test_a_huge_invalid_value_is_not_echoed_whole(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": "9" * 50_000 + "x"})
    assert r.status_code == 400 and len(r.text) < 2 * ECHO_CHARS + 400


def test_internal_errors_answer_generically_with_an_error_id_and_log_one_traceback_a_minute(
        client, engine, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine, "generate", broken)
    monkeypatch.setattr(TRACEBACKS, "_last", {})
    caplog.set_level(logging.INFO, logger="mstar.server")
    ids = []
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert "secret" not in message and "Error id: " in message
        ids.append(message.split("Error id: ")[1].rstrip("."))
    records = [rec for rec in caplog.records if "unexpected error" in rec.getMessage()]
    assert len(records) == 3 and all(i in rec.getMessage() for i, rec in zip(ids, records, strict=True))
    assert sum(rec.exc_info is not None for rec in records) == 1  # one traceback, then one-liners


def test_a_client_gone_while_its_body_is_read_is_info_without_traceback(engine, caplog):
    app = build_app(engine, served_model_name=MODEL)
    caplog.set_level(logging.INFO, logger="mstar.server")
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "root_path": ""}
    import asyncio

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert any("disconnected" in rec.getMessage() and rec.levelno == logging.INFO for rec in caplog.records)


def test_too_many_headers_is_a_431_and_a_long_url_a_414(client):
    headers = {f"x-h{i}": "v" for i in range(150)}
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    r = client.get("/v1/models/" + "m" * 9_000)
    assert r.status_code == 414 and r.json()["error"]["code"] == "uri_too_long"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={f"x-h{i}": "v" for i in range(50)}).status_code == 200
