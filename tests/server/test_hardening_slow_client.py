"""A client that trickles its body gets a 408 within the body deadline, and others are served meanwhile."""

from __future__ import annotations

import socket
import time

import httpx
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer

from mstar.server import build_app
from mstar.server.options import ServerOptions

DEADLINE_S = 0.5


def test_a_trickled_body_is_a_408_at_the_deadline(tmp_path_factory):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=256)
    app = build_app(engine, served_model_name="fake-k3", options=ServerOptions(body_timeout_s=DEADLINE_S))
    server = LiveServer(app)
    server.start()
    host, port = server.url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\"")
            start = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer:
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # others go on
                conn.settimeout(0.05)
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    conn.sendall(b" ")  # one byte at a time: never a whole body
                    continue
                assert chunk, "the server closed the connection without an answer"
                answer += chunk
            waited = time.monotonic() - start
    finally:
        server.stop()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert DEADLINE_S * 0.8 <= waited < DEADLINE_S + 2
