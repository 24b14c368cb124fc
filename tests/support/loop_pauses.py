"""What one request adds to other clients' latency: POST it while polling /health and reading another
client's stream, each measured against its own latency just before (a loaded machine's noise is not the
request's doing). The budgets are issue 22's: /health within 100 ms, stream chunks within 200 ms."""

from __future__ import annotations

import threading
import time

import httpx
from live_server import LiveServer

HEALTH_BUDGET_S = 0.1
STREAM_GAP_BUDGET_S = 0.2


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def while_posting(server: LiveServer, path: str, content: bytes, stream_tokens: int, settle_chunks: int = 1
                  ) -> tuple[httpx.Response, float, float]:
    """POST `content` (JSON bytes: the clients share the server's process and GIL, so it is serialized
    before) to `path` while a stream of `stream_tokens` tokens runs (the fake engine's "[[slow]]" prompt, 10
    ms a token) past its first `settle_chunks` chunks: (the answer, the slowest /health less its idle median,
    the longest gap between the stream's chunks while it was sent and answered less the median before)."""
    answer: list[httpx.Response] = []
    chunks: list[float] = []  # when each of the stream's chunks arrived
    window: list[float] = []  # when the request was sent, and when it was answered
    streaming = threading.Event()

    def stream():
        body = {"prompt": "[[slow]] go", "max_tokens": stream_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(time.perf_counter())
                    if len(chunks) >= settle_chunks:
                        streaming.set()
                if window[1:]:
                    break

    def post():
        window.append(time.perf_counter())
        answer.append(httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                                 timeout=120))
        window.append(time.perf_counter())

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert streaming.wait(60), "the stream did not start"
    with httpx.Client(base_url=server.url, timeout=10) as client:
        def health() -> float:
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            return time.perf_counter() - start

        idle = median([health() for _ in range(20)])
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
    return answer[0], worst - idle, max(during) - median(before)
