"""A client that trickles its body, or its request line and headers, or sends nothing at all, gets a 408
within its deadline and its connection closed, while others are served meanwhile; a kept-alive
connection idle between requests is not cut by the header deadline."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer
from paths import ROOT

from mstar.config import load_serve_config
from mstar.serve import connection_settings
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


def _answer_while_trickling(conn: socket.socket, server: LiveServer, trickle: bytes) -> tuple[bytes, float]:
    """Send `trickle` a byte per 50 ms (others' /health checked meanwhile) until the server answers;
    (the answer, seconds waited)."""
    start = time.monotonic()
    answer = b""
    sent = 0
    while True:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # others go on
        assert time.monotonic() - start < DEADLINE_S + 5, "the server never answered"
        conn.settimeout(0.05)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            if sent < len(trickle):
                conn.sendall(trickle[sent:sent + 1])
                sent += 1
            continue
        if not chunk:
            return answer, time.monotonic() - start
        answer += chunk


def _read_response(conn: socket.socket) -> bytes:
    """One whole response (its head, then `content-length` bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def test_slow_or_silent_headers_are_a_408_at_the_header_deadline(tmp_path_factory, tiny_dir):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=256)
    cfg = load_serve_config(ROOT / "configs" / "kimi_k3_tiny.yaml", [f"checkpoint={tiny_dir}",
                                                                     f"server.header_timeout_s={DEADLINE_S}"])
    # uvicorn as mstar-serve configures it
    server = LiveServer(build_app(engine, served_model_name="fake-k3"), **connection_settings(cfg))
    server.start()
    host, port = server.url.removeprefix("http://").split(":")
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"slow" * 40 + b"\r\n\r\n"
    try:
        for trickle in (b"", head):  # silent, then a byte per 50 ms (the whole head would take 8 s)
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                answer, waited = _answer_while_trickling(conn, server, trickle)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"code": "request_timeout"' in answer and b"connection: close" in answer.lower()
            assert DEADLINE_S * 0.8 <= waited < DEADLINE_S + 2  # then the server closed the connection
        with socket.create_connection((host, int(port)), timeout=5) as conn:  # one kept-alive connection
            for _ in range(2):
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = _read_response(conn)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
                time.sleep(DEADLINE_S * 2)  # idle between requests: the keep-alive timeout's business (5 s)
    finally:
        server.stop()


def test_a_head_over_max_header_bytes_is_a_431(tmp_path_factory, tiny_dir):
    limit = 4096
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=256)
    cfg = load_serve_config(ROOT / "configs" / "kimi_k3_tiny.yaml", [f"checkpoint={tiny_dir}",
                                                                     f"server.max_header_bytes={limit}"])
    max_body = 8 * limit
    app = build_app(engine, served_model_name="fake-k3", options=ServerOptions(max_body_bytes=max_body))
    server = LiveServer(app, **connection_settings(cfg))
    server.start()
    host, port = server.url.removeprefix("http://").split(":")

    def answer(header_bytes: int, body: bytes = b"", pieces: int = 1) -> bytes:
        """The response to a request with an `X-Big` header of `header_bytes` bytes, sent in `pieces` writes
        about 20 ms apart (until the server answers)."""
        method = b"POST /v1/completions" if body else b"GET /health"
        request = (method + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\nX-Big: " + b"a" * header_bytes + b"\r\n\r\n" + body)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            step = -(-len(request) // pieces)
            for start in range(0, len(request), step):
                if select.select([conn], [], [], 0.02)[0]:  # answered early: stop before the server's close
                    break
                conn.sendall(request[start:start + step])
            return _read_response(conn)

    try:
        assert answer(limit // 2).startswith(b"HTTP/1.1 200")
        # Only the head counts: a body past the limit, in the same read, reaches the endpoint (which finds
        # the prompt too long for the fake engine's context).
        big_body = json.dumps({"prompt": "x " * limit, "max_tokens": 1}).encode()
        assert b"context_length_exceeded" in answer(limit // 2, big_body)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            # A body refused by its declared length (413) still arrives after the answer; it is no head, and
            # the connection stays open for the next request.
            declared = 4 * max_body
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(declared).encode()
                         + b"\r\n\r\n")
            assert _read_response(conn).startswith(b"HTTP/1.1 413")
            conn.sendall(b"x" * declared)
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(conn).startswith(b"HTTP/1.1 200")
        for size, pieces in ((limit + 1, 1), (4 * limit, 1), (4 * limit, 8)):  # in one read, and in several
            too_large = answer(size, pieces=pieces)
            assert too_large.startswith(b"HTTP/1.1 431"), (size, pieces, too_large[:200])
            assert b'"code": "request_header_fields_too_large"' in too_large and f"{limit} bytes".encode() in too_large
            assert b"connection: close" in too_large.lower()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # the others go on
    finally:
        server.stop()
