"""Prefix caching through HTTP with the tiny engine: usage.prompt_tokens_details.cached_tokens (completions,
chat, streaming), the vLLM-named counters, POST /reset_prefix_cache (behind the API key), the same tokens
with the cache on and off, and at TP2 (two gloo ranks) the same tokens and cached counts as at TP1."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

from mstar.config import EngineConfig
from mstar.distributed.worker import Timeouts, TPEngine, start_ranks
from mstar.engine.async_engine import AsyncEngine
from mstar.engine.core import EngineCore
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.server import build_app
from mstar.server.options import ServerOptions

MODEL = "kimi-k3-prefix"
INTERVAL = 16
KEY = "sk-prefix-test"


def engine_config(enabled: bool) -> EngineConfig:
    return EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 8, "max_num_pages": 96},
                                                    "kda_state": {"max_slots": 5}},
                        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64},
                        prefix_cache={"enabled": enabled, "kda_snapshot_interval": INTERVAL})


def start_engine(model, tokenizer, enabled):
    return AsyncEngine(EngineCore(model, tokenizer, engine_config(enabled)), MODEL).start()


@pytest.fixture(scope="module")
def engines(tiny_model, tokenizer):
    on, off = start_engine(tiny_model, tokenizer, True), start_engine(tiny_model, tokenizer, False)
    yield on, off
    on.shutdown()
    off.shutdown()


@pytest.fixture(scope="module")
def clients(engines):
    on, off = engines
    with (TestClient(build_app(on, served_model_name=MODEL, options=ServerOptions(api_keys=(KEY,)))) as a,
          TestClient(build_app(off, served_model_name=MODEL)) as b):
        a.headers["Authorization"] = f"Bearer {KEY}"
        yield a, b


def complete(client, prompt, n, **extra):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                    "temperature": 0, "ignore_eos": True,
                                                    "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def words(model, n):
    return [random.randrange(model.config.vocab_size - 256) for _ in range(n)]


def counter(client, name):
    text = client.get("/metrics").text
    [line] = [line for line in text.splitlines() if line.startswith(f'{name}{{model_name="{MODEL}"}}')]
    return float(line.split()[-1])


def test_completions_report_cached_tokens_and_match_the_cache_off(clients, tiny_model, engines):
    on, off = clients
    prompt = words(tiny_model, 2 * INTERVAL + 5)
    for turn in range(3):
        first, second = complete(on, prompt, 6), complete(off, prompt, 6)
        [choice], [choice_off] = first["choices"], second["choices"]
        assert choice["token_ids"] == choice_off["token_ids"] == greedy_generate(tiny_model, prompt, 6), turn
        cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert (cached > 0) == (turn > 0) and cached % INTERVAL == 0 and cached < len(prompt), turn
        prompt = prompt + choice["token_ids"] + words(tiny_model, 7)
    assert counter(on, "mstar_prefix_cache_hits_total") > 0
    assert counter(on, "mstar_prefix_cache_queries_total") > counter(on, "mstar_prefix_cache_hits_total")
    assert counter(off, "mstar_prefix_cache_hits_total") == 0


def test_chat_and_streaming_usage_carry_cached_tokens(clients):
    on, _ = clients
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": "Be terse. " * 3}, {"role": "user", "content": "Count."}]}
    first = on.post("/v1/chat/completions", json=body).json()
    again = on.post("/v1/chat/completions", json=body).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > INTERVAL
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // INTERVAL * INTERVAL
    with on.stream("POST", "/v1/chat/completions",
                   json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_route_empties_the_cache_and_needs_the_key(clients, tiny_model, engines):
    on, _ = clients
    prompt = words(tiny_model, 2 * INTERVAL + 3)
    complete(on, prompt, 2)
    assert complete(on, prompt, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * INTERVAL
    refused = on.post("/reset_prefix_cache", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401
    assert on.post("/reset_prefix_cache").status_code == 200
    core = engines[0].core
    assert core.kv.allocator.num_cached == 0 and core.pool.num_snapshots == 0
    assert complete(on, prompt, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.fixture
def tp2_client(tiny_dir, tokenizer):
    """The cache-on engine at tp_size 2: rank 0 in this process, its follower spawned, gloo between them."""
    core, ranks = start_ranks(tiny_dir, tokenizer, engine_config(True), tp_size=2,
                              timeouts=Timeouts(startup_s=120, control_s=20, collective_s=60, stop_s=10))
    engine = TPEngine(core, MODEL, ranks).start()
    try:
        with TestClient(build_app(engine, served_model_name=MODEL)) as client:
            yield client
        assert ranks.failed is None
    finally:
        engine.shutdown()
    assert [p.exitcode for p in ranks.processes] == [0]  # STOP ended the follower cleanly


def test_tp2_multi_turn_hits_equal_tp1_and_the_reference(tp2_client, clients, tiny_model):
    """Two conversations on one system prompt, their turns interleaved: from its second turn each one resumes
    from a cached prefix (its own earlier turns; the first turn of the second, from the system prompt), at TP2
    as at TP1, with the reference's tokens."""
    tp1, _ = clients
    tp1.post("/reset_prefix_cache")  # what earlier tests cached would count at TP1 alone
    system = words(tiny_model, INTERVAL + 3)
    chats = [system + words(tiny_model, 9), system + words(tiny_model, 4)]
    hits = 0
    for turn in range(3):
        for c, prompt in enumerate(chats):
            at_tp2, at_tp1 = complete(tp2_client, prompt, 5), complete(tp1, prompt, 5)
            [choice] = at_tp2["choices"]
            assert choice["token_ids"] == at_tp1["choices"][0]["token_ids"] == greedy_generate(tiny_model, prompt, 5)
            cached = at_tp2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == at_tp1["usage"]["prompt_tokens_details"]["cached_tokens"], (turn, c)
            assert (cached > 0) == (turn > 0 or c > 0) and cached % INTERVAL == 0, (turn, c, cached)
            hits += cached
            chats[c] = prompt + choice["token_ids"] + words(tiny_model, 6)
    assert counter(tp2_client, "mstar_prefix_cache_hits_total") == hits
