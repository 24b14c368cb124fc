"""The event loop never does heavy work: a maximal body whose prompt cannot fit is refused on its length
in characters, without tokenizing it, while /health answers within 100 ms and another client's stream
keeps its chunks under 200 ms apart (each measured against its own latency just before)."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer
from loop_pauses import HEALTH_BUDGET_S, STREAM_GAP_BUDGET_S, while_posting

from mstar.server import build_app
from mstar.server.options import ServerOptions

MAX_SEQ_LEN = 256


@pytest.fixture
def served(tmp_path_factory):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=MAX_SEQ_LEN)
    options = ServerOptions()  # the default body limit, 8 MiB
    server = LiveServer(build_app(engine, served_model_name="fake-k3", options=options))
    server.start()
    yield engine, server, options
    server.stop()


def test_a_maximal_body_is_refused_on_its_length_without_tokenizing(served, monkeypatch):
    engine, server, options = served
    encoded: list[int] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    prompt = "x = [1, 2, 3]; " * ((options.max_body_bytes - 100) // 15)  # about the largest body the server reads
    assert len(json.dumps({"prompt": prompt})) <= options.max_body_bytes
    r, health, gap = while_posting(server, "/v1/completions", json.dumps({"prompt": prompt}).encode(), 240)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and "characters" in r.json()["error"]["message"]
    assert max(encoded) < 1000, "the refused prompt was tokenized"
    assert health < HEALTH_BUDGET_S, f"/health took {health * 1000:.0f} ms longer while a maximal body arrived"
    assert gap < STREAM_GAP_BUDGET_S, f"a stream paused {gap * 1000:.0f} ms longer while a maximal body arrived"
    # the shortest text that cannot fit is refused too, and the longest that may fit is tokenized
    least = MAX_SEQ_LEN * engine.tokenizer.max_token_bytes
    for length, refused in ((least, True), (least - engine.tokenizer.max_token_bytes, False)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * length, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert ("characters" in r.json()["error"]["message"]) == refused, r.text
