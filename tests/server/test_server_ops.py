"""GET /health, /v1/models, /metrics."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, shared_tokenizer
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mstar.engine.client import EngineStats
from mstar.server import ServerMetrics, build_app

MODEL = "kimi-k3-ops"
METRIC_NAMES = [
    "mstar_requests_running",
    "mstar_requests_waiting",
    "mstar_kv_pages_used",
    "mstar_kv_pages_total",
    "mstar_kv_pages_usage_ratio",
    "mstar_kda_slots_used",
    "mstar_kda_slots_total",
    "mstar_kda_slots_usage_ratio",
    "mstar_prompt_tokens_total",
    "mstar_generation_tokens_total",
    "mstar_request_success_total",
    "mstar_request_failure_total",
    "mstar_time_to_first_token_seconds_bucket",
    "mstar_inter_token_latency_seconds_bucket",
    "mstar_e2e_request_latency_seconds_bucket",
    "mstar_request_queue_time_seconds_bucket",
    "mstar_request_prefill_time_seconds_bucket",
    "mstar_request_decode_time_seconds_bucket",
    "mstar_request_inference_time_seconds_bucket",
    "mstar_request_prompt_tokens_bucket",
    "mstar_request_generation_tokens_bucket",
    "mstar_num_preemptions_total",
    "mstar_prefix_cache_queries_total",
    "mstar_prefix_cache_hits_total",
    "mstar_spec_decode_num_drafts_total",
    "mstar_spec_decode_num_draft_tokens_total",
    "mstar_spec_decode_num_accepted_tokens_total",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FakeEngine(shared_tokenizer(tmp_path_factory))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=MODEL)) as client:
        yield client


def metrics(client) -> dict[str, float]:
    """Every sample, parsed by prometheus_client, as `name{labels}` without the model_name label (which
    every sample must carry, with the served name)."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            shown = ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "le")
            if "le" in sample.labels:
                shown = ",".join(filter(None, [shown, f'le="{sample.labels["le"]}"']))
            values[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
    return values


def test_health(client, engine):
    assert client.get("/health").status_code == 200
    engine.is_healthy = False
    try:
        assert client.get("/health").status_code == 503
    finally:
        engine.is_healthy = True


def test_models(client, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "mstar"
    assert card["max_model_len"] == engine.max_seq_len and isinstance(card["created"], int)
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_metrics_names_and_engine_gauges(client):
    values = metrics(client)
    names = {name.split("{")[0] for name in values}
    assert set(METRIC_NAMES) <= names
    assert values["mstar_kv_pages_total"] == 64 and values["mstar_kda_slots_total"] == 16
    # every known label value is shown before its first use (a series that is missing cannot be graphed)
    for reason in ("stop", "length"):
        assert f'mstar_request_success_total{{finish_reason="{reason}"}}' in values, reason
    for reason in ("error", "abort", "cancelled", "invalid_request"):
        assert f'mstar_request_failure_total{{reason="{reason}"}}' in values, reason
    for reason in ("unauthorized", "too_large", "overloaded"):
        assert f'mstar_request_refused_total{{reason="{reason}"}}' in values, reason


def test_metrics_count_requests_and_latencies(client):
    before = metrics(client)
    prompt_tokens = client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 5, "n": 2}).json()[
        "usage"]["prompt_tokens"]
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
                                              "seed": 1})
    after = metrics(client)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("mstar_time_to_first_token_seconds_count") == 3
    assert grew("mstar_e2e_request_latency_seconds_count") == 3
    assert grew('mstar_request_success_total{finish_reason="length"}') == 2
    assert grew('mstar_request_success_total{finish_reason="stop"}') == 1
    generated = grew("mstar_generation_tokens_total")
    assert generated > 10
    assert grew("mstar_inter_token_latency_seconds_count") == generated - 3  # every token after each first
    assert grew("mstar_prompt_tokens_total") > 2 * prompt_tokens
    assert grew("mstar_request_prompt_tokens_count") == 3 and grew("mstar_request_generation_tokens_sum") == generated


def test_many_apps_have_their_own_registries(engine):
    apps = [build_app(engine, served_model_name=f"m{i}") for i in range(3)]
    shared = ServerMetrics("m", CollectorRegistry())
    apps.append(build_app(engine, served_model_name="m", metrics=shared))
    with TestClient(apps[-1]) as client:
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert shared.generation_tokens._value.get() == 2


def test_engine_stats_become_gauges_and_counters():
    metrics = ServerMetrics("m")
    stats = dict(running=3, waiting=2, kv_pages_used=10, kv_pages_total=40, kda_slots_used=1, kda_slots_total=4,
                 spec_verify_rows=5, spec_draft_tokens=12, spec_accepted_tokens=7, spec_drafted_by_position=(5, 4),
                 spec_accepted_by_position=(4, 3), num_preemptions=2, prefix_cache_queries=100,
                 prefix_cache_hits=64, model_steps=(("decode", "graph", 9), ("prefill", "eager", 2)))
    metrics.update_engine_stats(EngineStats(**stats))
    metrics.update_engine_stats(EngineStats(**{**stats, "spec_verify_rows": 6, "num_preemptions": 3,
                                               "prefix_cache_queries": 130,
                                               "model_steps": (("decode", "graph", 12), ("prefill", "eager", 2),
                                                               ("verify", "eager", 1))}))
    text = metrics.render().decode()
    for line in ('mstar_requests_running{model_name="m"} 3.0', 'mstar_requests_waiting{model_name="m"} 2.0',
                 'mstar_kv_pages_usage_ratio{model_name="m"} 0.25', 'mstar_kda_slots_usage_ratio{model_name="m"} 0.25',
                 # cumulative engine counts are counters that grow by what the engine's totals grew by
                 'mstar_spec_decode_num_drafts_total{model_name="m"} 6.0',
                 'mstar_spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'mstar_num_preemptions_total{model_name="m"} 3.0',
                 'mstar_prefix_cache_queries_total{model_name="m"} 130.0',
                 'mstar_prefix_cache_hits_total{model_name="m"} 64.0',
                 'mstar_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 3.0',
                 'mstar_model_steps_total{mode="graph",model_name="m",shape="decode"} 12.0',
                 'mstar_model_steps_total{mode="eager",model_name="m",shape="prefill"} 2.0',
                 'mstar_model_steps_total{mode="eager",model_name="m",shape="verify"} 1.0'):
        assert line in text, line
    kinds = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert kinds["mstar_spec_decode_num_drafts"] == kinds["mstar_num_preemptions"] == "counter"
