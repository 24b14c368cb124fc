"""The event loop never does heavy work: a maximal body whose prompt cannot fit is refused on its length
in characters, without tokenizing it, while /health answers within 100 ms and another client's stream
keeps its chunks under 200 ms apart (each measured against its own latency just before)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer

from mstar.server import build_app
from mstar.server.options import ServerOptions

HEALTH_BUDGET_S = 0.1
STREAM_GAP_BUDGET_S = 0.2
MAX_SEQ_LEN = 256


@pytest.fixture
def served(tmp_path_factory):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=MAX_SEQ_LEN)
    options = ServerOptions()  # the default body limit, 8 MiB
    server = LiveServer(build_app(engine, served_model_name="fake-k3", options=options))
    server.start()
    yield engine, server, options
    server.stop()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _while_posting(server: LiveServer, body: dict) -> tuple[httpx.Response, float, float]:
    """POST `body` to /v1/completions while polling /health and reading another client's stream:
    (the answer, the slowest /health and the longest gap between the stream's chunks while it was
    sent, each less its median before it was: what the request added, not what a loaded machine does
    anyway). The clients share the server's process, and so its GIL: the body is serialized first."""
    content = json.dumps(body).encode()
    answer: list[httpx.Response] = []
    chunks: list[float] = []  # when each of the stream's chunks arrived
    window: list[float] = []  # when the request was sent, and when it was answered
    streaming = threading.Event()

    def stream():
        slow = {"prompt": "[[slow]] go", "max_tokens": 240, "stream": True, "ignore_eos": True}  # 10 ms a token
        with httpx.stream("POST", server.url + "/v1/completions", json=slow, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(time.perf_counter())
                    streaming.set()
                if window[1:]:
                    break

    def post():
        window.append(time.perf_counter())
        answer.append(httpx.post(server.url + "/v1/completions", content=content,
                                 headers={"content-type": "application/json"}, timeout=120))
        window.append(time.perf_counter())

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert streaming.wait(10)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        def health() -> float:
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            return time.perf_counter() - start

        idle = _median([health() for _ in range(20)])
        sender = threading.Thread(target=post)
        sender.start()
        worst = 0.0
        while sender.is_alive():
            worst = max(worst, health())
            time.sleep(0.01)
    sender.join()
    streamer.join()
    gaps = [(b, b - a) for a, b in zip(chunks, chunks[1:], strict=False)]
    before = [gap for at, gap in gaps if at < window[0]]
    during = [gap for at, gap in gaps if window[0] <= at <= window[1] + STREAM_GAP_BUDGET_S]
    assert before and during, "the stream ended before the request was answered"
    return answer[0], worst - idle, max(during) - _median(before)


def test_a_maximal_body_is_refused_on_its_length_without_tokenizing(served, monkeypatch):
    engine, server, options = served
    encoded: list[int] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    prompt = "x = [1, 2, 3]; " * ((options.max_body_bytes - 100) // 15)  # about the largest body the server reads
    assert len(json.dumps({"prompt": prompt})) <= options.max_body_bytes
    r, health, gap = _while_posting(server, {"prompt": prompt})
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
