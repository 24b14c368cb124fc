"""Live HTTP tests: the tiny engine and the server on loopback as fixtures, and `mstar-serve` as a process."""

from __future__ import annotations

import socket
import time

import openai
import pytest
from paths import ROOT

from mstar.config import load_serve_config
from mstar.serve import build_engine
from mstar.server import build_app
from mstar.tools.live_server import LiveServer

__all__ = ["LiveServer", "live_fixtures", "start_mstar_serve", "tiny_engine_fixture", "wait_until"]


def tiny_engine_fixture(max_seq_len: int, kv_pages: int):
    """A module-scoped `engine` fixture: the tiny checkpoint served as configs/kimi_k3_tiny.yaml says, with
    `max_seq_len`, `kv_pages` latent KV pages and a 256-token step budget; shut down after the module."""

    @pytest.fixture(scope="module")
    def engine(tiny_dir):
        cfg = load_serve_config(ROOT / "configs" / "kimi_k3_tiny.yaml", [
            f"checkpoint={tiny_dir}", f"max_seq_len={max_seq_len}", f"resources.mla_kv.max_num_pages={kv_pages}",
            "scheduler.max_num_batched_tokens=256"])
        engine = build_engine(cfg)
        yield engine
        engine.shutdown()

    return engine


def live_fixtures(model: str, timeout: float):
    """Module-scoped `server` (a LiveServer over the module's `engine` fixture, served as `model`) and
    `client` (an `openai.OpenAI` on it, no retries, `timeout` seconds a request) fixtures:
    `server, client = live_fixtures(MODEL, 60)` at module level."""

    @pytest.fixture(scope="module")
    def server(engine):
        with LiveServer(build_app(engine, served_model_name=model)) as live:
            yield live

    @pytest.fixture(scope="module")
    def client(server):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout) as c:
            yield c

    return server, client


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def start_mstar_serve(args: list[str], extra_env: dict[str, str] | None = None, timeout: float = 120.0):
    """`python -m mstar.serve ARGS --port <free port>` in a subprocess, waited on until /health is 200.
    Returns (process, base url); the caller ends the process."""
    import os
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "mstar.serve", *args, "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"mstar-serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("mstar-serve did not come up")
        time.sleep(0.2)
