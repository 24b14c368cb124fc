"""The access log of a live server never carries a query string (an API key may be in it)."""

from __future__ import annotations

import logging

import httpx
from fake_engine import FakeEngine, shared_tokenizer
from live_server import LiveServer

from mstar.server import access_log, build_app
from mstar.server.options import ServerOptions


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_query_strings_never_reach_the_access_log(tmp_path_factory):
    engine = FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=256)
    app = build_app(engine, served_model_name="fake-k3", options=ServerOptions(api_keys=("right-key-123",)))
    access_log.install()
    server = LiveServer(app)
    server.start()
    logger = logging.getLogger(access_log.ACCESS_LOGGER)  # uvicorn's: it does not propagate to the root
    handler = Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        r = httpx.post(server.url + "/v1/completions?api_key=SECRETKEY1&x=2", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401
    finally:
        server.stop()
        logger.removeHandler(handler)
    lines = handler.lines
    assert any("/v1/completions?..." in line and "401" in line for line in lines), lines
    assert not any("SECRETKEY1" in line for line in lines)
