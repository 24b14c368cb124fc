"""A huge prompt is tokenized off the event loop: /health answers within 100 ms while it is."""

from __future__ import annotations

import threading
import time

import httpx
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer

from mstar.server import build_app
from mstar.server.options import ServerOptions

HEALTH_BUDGET_S = 0.1


def test_health_stays_fast_while_a_huge_prompt_is_tokenized_and_refused(tmp_path_factory):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=256)
    app = build_app(engine, served_model_name="fake-k3", options=ServerOptions(max_body_bytes=16 * 1024 * 1024))
    server = LiveServer(app)
    server.start()
    prompt = "def f(x): return x * 2  # a line of code\n" * 100_000  # 4 MB, about 1.2M tokens
    answer: dict = {}

    def post():
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
        answer["status"], answer["param"] = r.status_code, r.json()["error"]["param"]

    try:
        sender = threading.Thread(target=post)
        sender.start()
        worst = 0.0
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.get("/health")
            while sender.is_alive():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                worst = max(worst, time.perf_counter() - start)
                time.sleep(0.01)
        sender.join()
    finally:
        server.stop()
    assert answer == {"status": 400, "param": "prompt"}
    assert worst < HEALTH_BUDGET_S, f"/health took {worst * 1000:.0f} ms while a huge prompt was tokenized"
