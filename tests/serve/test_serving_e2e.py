"""The real engine behind the real server on loopback: the `openai` client, 64 concurrent streams,
disconnects, and `mstar-serve` itself (SIGTERM drains and exits 0, answering clients whose bodies it is still
reading at once)."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import threading
import time

import httpx
from greedy_ties import assert_greedy_matches
from live_server import LiveServer, live_fixtures, start_mstar_serve, tiny_engine_fixture, wait_until
from paths import ROOT

from mstar.config import load_serve_config
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.serve import build_engine
from mstar.server import build_app

CONFIG = ROOT / "configs" / "kimi_k3_tiny.yaml"
MODEL = "kimi_k3_tiny"


engine = tiny_engine_fixture(max_seq_len=1024, kv_pages=512)
server, client = live_fixtures(MODEL, timeout=60)


def pools_empty(engine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.kv_pages_used == 0 and s.kda_slots_used == 0


def test_completions_greedy_equals_reference(client, engine, tiny_model):
    prompt = engine.tokenizer.encode("def fibonacci(n):\n")
    expect = greedy_generate(tiny_model, prompt, 12)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == expect
    assert r.choices[0].text == engine.tokenizer.decode(expect, skip_special=True)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 12


def test_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, prompt="import numpy as np\n", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole


def test_chat_stop_n_seed_logprobs(client, engine):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, n=3, temperature=0.9,
                                       seed=7, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, n=3, temperature=0.9,
                                           seed=7, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 3
    assert [c.message for c in r.choices] == [c.message for c in again.choices]
    for c in r.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    text = client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    if len(text) > 8:
        stop = text[4:7]
        cut = client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
        assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert wait_until(lambda: pools_empty(engine))


def test_64_concurrent_streams_equal_sequential(server, engine):
    prompts = [engine.tokenizer.encode(f"def f{i}(x):\n    return x * {i}\n") for i in range(64)]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        ids: list[int] = []
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        ids += choice.get("token_ids") or []
        return ids

    async def run_all(parallel: bool) -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as client:
            if parallel:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            return [await one(client, p) for p in prompts[:8]]

    concurrent = asyncio.run(run_all(True))
    sequential = asyncio.run(run_all(False))
    assert all(len(ids) == 8 for ids in concurrent)
    assert concurrent[:8] == sequential
    assert wait_until(lambda: pools_empty(engine))


def test_disconnect_mid_stream_frees_pages_and_slot(server, engine):
    body = {"model": MODEL, "prompt": "while True:\n", "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert engine.stats().running == 1 and engine.stats().kv_pages_used > 0
    assert wait_until(lambda: pools_empty(engine), timeout=10)


def test_bad_input_is_a_400(server):
    cases = [
        b"{not json",
        b'{"model": "kimi_k3_tiny", "prompt": "x", "max_tokens": "ten"}',
        b'{"model": "other-model", "prompt": "x"}',
        b'{"model": "kimi_k3_tiny", "prompt": "x", "temperature": -1}',
        b'{"model": "kimi_k3_tiny", "prompt": [99999999]}',
        b'{"model": "kimi_k3_tiny", "prompt": "x", "max_tokens": 5000}',
    ]
    for raw in cases:
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["message"]


class Trickler(threading.Thread):
    """A client that sends a request's head, then its body a byte per 0.1 s, until the server answers or
    closes the connection: what it answered, and when (monotonic)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.conn = socket.create_connection((host, int(port)), timeout=10)
        self.conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        self.answer = b""
        self.answered_at: float | None = None

    def run(self) -> None:
        with self.conn:
            while True:
                if select.select([self.conn], [], [], 0.1)[0]:
                    chunk = self.conn.recv(65536)
                    if not chunk:
                        break
                    self.answer += chunk
                    self.answered_at = self.answered_at or time.monotonic()
                elif not self.answer:
                    self.conn.sendall(b"x")
        self.answered_at = self.answered_at or time.monotonic()


def test_mstar_serve_drains_on_sigterm_without_waiting_for_unread_bodies(tiny_dir, tmp_path):
    """The real entry point: start it, stream a request, SIGTERM mid-request: it finishes and exits 0. A
    client still trickling its body (never admitted) is told the server is going away at once, and holds
    the exit for no longer than the admitted stream does, far less than the body deadline (60 s here)."""

    proc, url = start_mstar_serve(["--config", str(CONFIG), f"checkpoint={tiny_dir}", "max_seq_len=1024",
                                   "resources.mla_kv.max_num_pages=256", "server.body_timeout_s=60"])
    try:
        trickler = Trickler(url)
        trickler.start()
        body = {"model": MODEL, "prompt": "class A:\n", "max_tokens": 64, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        got = 0
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if got == 0 and line.startswith("data: {"):
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                if line.startswith("data: {"):
                    got += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
            streamed = time.monotonic()
        assert got == 64
        assert proc.wait(timeout=90) == 0
        exited = time.monotonic()
        trickler.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert trickler.answer.startswith(b"HTTP/1.1 503"), trickler.answer[:300]
    assert b'"code": "server_shutting_down"' in trickler.answer
    assert trickler.answered_at - signalled < 5, "the trickling client was answered only at its body deadline"
    assert exited - streamed < 10, f"the exit waited {exited - streamed:.1f} s after the last admitted request"


def test_dspark_config_serves_greedy_identical_to_reference(tiny_dirs, tiny_model):
    target_dir, draft_dir = tiny_dirs
    cfg = load_serve_config(CONFIG.with_name("kimi_k3_tiny_dspark.yaml"),
                            [f"checkpoint={target_dir}", f"model_kwargs.speculative_draft={draft_dir}",
                             "max_seq_len=1024", "resources.mla_kv.max_num_pages=512",
                             "resources.dspark_kv.max_num_pages=512", "scheduler.max_num_batched_tokens=512"])
    engine = build_engine(cfg)
    live = LiveServer(build_app(engine, served_model_name=MODEL))
    live.start()
    try:
        prompts = [engine.tokenizer.encode(f"for i in range({i}):\n    print(i)\n") for i in range(8)]

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            r = await client.post(live.url + "/v1/completions", json=body)
            return r.json()["choices"][0]["token_ids"]

        async def run_all():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        got = asyncio.run(run_all())
        assert_greedy_matches(tiny_model, [(p, 20, greedy_generate(tiny_model, p, 20)) for p in prompts], got,
                              max_tied=1)
        assert engine.core.spec.num_drafted > 0
        metrics = httpx.get(live.url + "/metrics").text
        assert 'mstar_spec_decode_num_accepted_tokens_total{model_name="kimi_k3_tiny"}' in metrics
        assert 'mstar_spec_decode_num_drafts_per_pos_total{model_name="kimi_k3_tiny",position="1"}' in metrics
        assert wait_until(lambda: pools_empty(engine))
    finally:
        live.stop()
        engine.shutdown()
