"""Rank processes behind the HTTP server (tests/support/tp_server.py, serve.py's TP path) on
configs/kimi_k3_tiny_tp2.yaml: greedy over HTTP equals the reference, SIGTERM drains every rank, and a dead or
hung rank 0 ends its followers in seconds (a dead follower ending rank 0: test_distributed_dspark.py, on
mstar-serve itself)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from paths import ROOT, SUPPORT
from processes import gone as _gone
from processes import is_spawned_rank

from mstar.distributed.worker import EXIT_RANK_FAILED
from mstar.models.kimi_k3.generate import greedy_generate

CONFIG = ROOT / "configs" / "kimi_k3_tiny_tp2.yaml"
EP2_CONFIG = ROOT / "configs" / "kimi_k3_tiny_ep2.yaml"  # the same two ranks, routed experts split by expert
SCRIPT = SUPPORT / "tp_server.py"
MODEL = "kimi_k3_tiny"


def _children(pid: int) -> list[int]:
    """Follower ranks: processes started by `pid` through multiprocessing's spawn."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and is_spawned_rank(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class TPServer:
    def __init__(self, tiny_dir: Path, log_path: Path, control_s: float = 10, config: Path = CONFIG):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TP_SERVER_CONTROL_S": str(control_s)}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(config), str(self.port), f"checkpoint={tiny_dir}", "max_seq_len=512",
                 "resources.mla_kv.max_num_pages=64", "scheduler.max_num_batched_tokens=128"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.followers: list[int] = []

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up:\n{self.log()}"
            time.sleep(0.2)
        self.followers = _children(self.proc.pid)
        assert len(self.followers) == 1, self.followers

    def close(self) -> None:
        for pid in [self.proc.pid, *self.followers]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def server(tiny_dir, tmp_path, request):
    s = TPServer(tiny_dir, tmp_path / "server.log", **getattr(request, "param", {}))
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


class Stream(threading.Thread):
    """A streamed greedy completion in the background: token ids as they arrive, how it ended."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "ignore_eos": True, "return_token_ids": True}
        self.url = url
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60) as client, \
                    client.stream("POST", self.url + "/v1/completions", json=self.body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = str(chunk["error"])
                        for choice in chunk.get("choices", []):
                            self.token_ids += choice.get("token_ids") or []
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        self.first.set()
        except httpx.HTTPError as e:  # the server went away mid-stream
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.first.set()


def test_greedy_over_http_then_sigterm_drains_all_ranks(server, tiny_model):
    prompt = list(range(5, 45))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["token_ids"] == greedy_generate(tiny_model, prompt, 12)

    stream = Stream(server.url, prompt, max_tokens=48)
    stream.start()
    assert stream.first.wait(60) and stream.error is None
    server.proc.send_signal(signal.SIGTERM)  # mid-request: the request finishes, then every rank stops
    stream.join(60)
    assert stream.error is None and stream.finish_reason == "length"
    assert stream.token_ids == greedy_generate(tiny_model, prompt, 48)
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert all(_gone(pid) for pid in server.followers)
    assert "rank 1 stopped" in server.log()


@pytest.mark.parametrize("server", [{"config": EP2_CONFIG}], indirect=True, ids=["ep2"])
def test_expert_parallel_ranks_serve_greedy_identical_then_killing_rank0_ends_the_followers(server, tiny_model):
    """kimi_k3_tiny_ep2.yaml: each rank holds half of the routed experts whole; the output is unchanged. Then
    rank 0 dies (on this server rather than one of its own: a server start is most of a test's time)."""
    assert "ep_size=2" in server.log()
    prompt = list(range(7, 40))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["token_ids"] == greedy_generate(tiny_model, prompt, 10)

    [follower] = server.followers
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    assert _wait(lambda: _gone(follower), 15), "a follower outlived rank 0"
    assert _wait(lambda: "rank 1 lost rank 0" in server.log(), 5), server.log()


@pytest.mark.parametrize("server", [{"control_s": 3}], indirect=True)
def test_heartbeats_keep_idle_followers_and_a_hung_rank0_ends_them(server, tiny_model):
    time.sleep(5)  # idle longer than the followers' control timeout: heartbeats keep them waiting
    prompt = [7, 8, 9]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["token_ids"] == greedy_generate(tiny_model, prompt, 4)

    [follower] = server.followers
    os.kill(server.proc.pid, signal.SIGSTOP)  # rank 0 hangs: alive, connections open, silent
    try:
        assert _wait(lambda: _gone(follower), 15), "a follower waited forever on a silent rank 0"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert server.proc.wait(timeout=15) == EXIT_RANK_FAILED, server.log()  # and rank 0 then sees it gone
