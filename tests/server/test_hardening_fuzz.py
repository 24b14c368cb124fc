"""Schemathesis against the real tiny engine behind the real server on loopback: the OpenAPI
document at /openapi.json must describe what the server does.

Every generated request (valid ones and deliberately invalid ones, with and without the API key)
must get: no 5xx, a status the document lists for that operation, a body and content type that
match the document, the headers it promises (Retry-After, WWW-Authenticate), invalid bodies
refused, a refusal without the key, and an answer within the request timeout (no hang). The
server runs with small limits (max_seq_len 256, max_tokens 4, n <= 2) so that each case is quick;
the number of cases is bounded by MAX_EXAMPLES per operation and mode (MSTAR_FUZZ_EXAMPLES=400 for a
longer run).
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.configuration import set_hypothesis_home_dir
from live_server import LiveServer, wait_until
from paths import ROOT
from schemathesis import GenerationMode
from schemathesis.checks import max_response_time, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mstar.config import load_serve_config
from mstar.serve import build_engine, server_options
from mstar.server import build_app

CONFIG = ROOT / "configs" / "kimi_k3_tiny.yaml"
MODEL = "kimi_k3_tiny"
API_KEY = "fuzz-test-key"
MAX_EXAMPLES = int(os.environ.get("MSTAR_FUZZ_EXAMPLES", "40"))  # per operation and mode; raise it for a long run
REQUEST_TIMEOUT_S = 30.0  # a response slower than this is a hang
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth, max_response_time]
CASES: Counter = Counter()
STATUSES: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def hypothesis_home(tmp_path_factory):
    """Hypothesis keeps a cache under ./.hypothesis; keep it out of the repository."""
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    set_hypothesis_home_dir(None)


@pytest.fixture(scope="module")
def live(tiny_dir):
    cfg = load_serve_config(CONFIG, [f"checkpoint={tiny_dir}", "max_seq_len=256", "resources.mla_kv.max_num_pages=64",
                                     "scheduler.max_num_batched_tokens=256", "server.max_tokens=4",
                                     "server.max_n=2", "server.max_body_bytes=65536"])
    engine = build_engine(cfg)
    app = build_app(engine, served_model_name=MODEL, options=server_options(cfg, [API_KEY]))
    server = LiveServer(app)
    server.start()
    yield server, engine
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(live):
    server, _ = live
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_server_conforms_to_its_openapi_document(api_schema, mode):
    ops = operations(api_schema)
    assert len(ops) == 13
    if mode == GenerationMode.NEGATIVE:  # only a body can be invalid: the other operations take nothing
        ops = [op for op in ops if op.method == "post" and op.path not in ("/ping", "/reset_prefix_cache")]
    for operation in ops:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])
        def run(case):
            CASES[f"{mode} {case.method} {case.path}"] += 1
            response = case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS,
                                              timeout=REQUEST_TIMEOUT_S)
            STATUSES[f"{mode} {case.method} {case.path} {response.status_code}"] += 1
            if os.environ.get("FUZZ_DEBUG") and (response.status_code != 200) == (mode == GenerationMode.POSITIVE):
                print("DEBUG", mode, case.path, response.status_code, response.text[:300], str(case.body)[:300])

        run()


def test_found_by_fuzzing_a_huge_top_k_is_a_400_not_a_failed_step(live):
    """top_k >= 2**63 used to reach the sampler, fail its int64 tensor and so the whole engine step,
    taking every other request in flight down with it."""
    server, engine = live
    failed_before = engine.failed_steps
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as client:
        r = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2, "top_k": 2**63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
        ok = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2, "top_k": 2**63 - 1})
        assert ok.status_code == 200
    assert engine.failed_steps == failed_before


def test_fuzzing_ran_and_left_the_engine_clean(live, capsys):
    _, engine = live
    assert sum(CASES.values()) > 0 and len(CASES) == 18, CASES

    def idle() -> bool:
        s = engine.stats()
        return s.running == s.waiting == s.kv_pages_used == s.kda_slots_used == 0

    assert wait_until(idle, timeout=10)
    assert engine.healthy and engine.failed_steps == 0
    with capsys.disabled():
        print(f"\nfuzz: {sum(CASES.values())} cases: {dict(CASES)}\nstatuses: {dict(STATUSES)}")
