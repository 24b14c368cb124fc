"""Extreme but valid sampling values on the real tiny engine, with and without DSpark: every answer
is a 200 or a 400, and greedy requests running beside them get exactly the tokens they get alone."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import LiveServer
from paths import ROOT

from mstar.config import load_serve_config
from mstar.serve import build_engine, server_options
from mstar.server import build_app

MODEL = "kimi_k3_tiny"
TEMPERATURES = [1e-45, 3e-39, 1e-38, 9.99e-6, 1e-5, 1e-4, 0.3, 1.9, 100.0, 1e30]
TOP_PS = [1e-9, 0.5, 1.0]
TOP_KS = [0, 1, 2, 2**62, -1]
MIN_PS = [0.0, 1e-9, 0.5, 1.0]
SEEDS = [None, 0, 7, 2**63 - 1, -1]


@pytest.fixture(scope="module", params=["kimi_k3_tiny.yaml", "kimi_k3_tiny_dspark.yaml"], ids=["plain", "dspark"])
def live(request, tiny_dirs):
    target, draft = tiny_dirs
    overrides = [f"checkpoint={target}", "max_seq_len=128", "resources.mla_kv.max_num_pages=64",
                 "scheduler.max_num_batched_tokens=256", "scheduler.max_num_seqs=16"]
    if "dspark" in request.param:
        overrides += [f"model_kwargs.speculative_draft={draft}", "resources.dspark_kv.max_num_pages=64"]
    cfg = load_serve_config(ROOT / "configs" / request.param, overrides)
    engine = build_engine(cfg)
    server = LiveServer(build_app(engine, served_model_name=MODEL, options=server_options(cfg)))
    server.start()
    yield server
    server.stop()
    engine.shutdown()


def _extreme(rng: random.Random) -> dict:
    body = {"temperature": rng.choice(TEMPERATURES), "top_p": rng.choice(TOP_PS), "top_k": rng.choice(TOP_KS),
            "min_p": rng.choice(MIN_PS)}
    seed = rng.choice(SEEDS)
    if seed is not None:
        body["seed"] = seed
    return body


def _post(url: str, prompt: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, **fields}, timeout=120)


def _check(r: httpx.Response, body: dict) -> None:
    assert r.status_code in (200, 400), f"{body}: {r.status_code} {r.text[:300]}"
    if r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), f"{body}: {r.text[:300]}"


def test_extreme_values_alone_are_a_200_or_a_400(live):
    rng = random.Random()
    for _ in range(6):
        body = _extreme(rng)
        _check(_post(live.url, "x = ", **body), body)


def test_greedy_requests_beside_extreme_ones_are_untouched(live):
    rng = random.Random()
    prompts = [f"def f{i}(x): return" for i in range(4)]
    alone = [_post(live.url, p, temperature=0).json()["choices"][0]["text"] for p in prompts]
    extremes = [_extreme(rng) for _ in range(8)]
    with ThreadPoolExecutor(len(prompts) + len(extremes)) as pool:
        hostile = [pool.submit(_post, live.url, "x = ", **body) for body in extremes]
        greedy = [pool.submit(_post, live.url, p, temperature=0) for p in prompts]
        for future, body in zip(hostile, extremes, strict=True):
            _check(future.result(), body)
        for future, expected in zip(greedy, alone, strict=True):
            r = future.result()
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
