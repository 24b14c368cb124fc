"""Access and limits: API keys (401s, constant-time comparison, open or protected /health and
/metrics), body size (413), n and max_tokens bounds, the in-flight bound (429 with Retry-After),
prompts kept out of the logs unless --log-requests, the `server:` config section and the CLI's key
sources, and the OpenAPI document's limits. The fake engine keeps these quick; the real engine is
exercised by the fuzz, soak and fault tests."""

from __future__ import annotations

import asyncio
import hmac
import logging

import httpx
import pytest
from fake_engine import FakeEngine, shared_tokenizer
from fastapi.testclient import TestClient
from live_server import LiveServer, wait_until
from paths import ROOT

from mstar.config import Environment, ServeConfigError, load_serve_config, parse_serve_config
from mstar.engine.errors import EngineDeadError
from mstar.serve import api_keys, serve_main, server_options
from mstar.server import build_app
from mstar.server.access import AccessGuard
from mstar.server.options import ServerOptions

MODEL = "kimi-k3-guarded"
KEYS = ("sk-first-key", "sk-second-key")
CONFIG = ROOT / "configs" / "kimi_k3_tiny.yaml"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FakeEngine(shared_tokenizer(tmp_path_factory), max_seq_len=512)


def client_for(engine, **options) -> TestClient:
    return TestClient(build_app(engine, served_model_name=MODEL, options=ServerOptions(**options)))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 4, **fields}


def refused(metrics_text: str, reason: str) -> float:
    name = f'mstar_request_refused_total{{model_name="{MODEL}",reason="{reason}"}}'
    line = next(x for x in metrics_text.splitlines() if x.startswith(name))
    return float(line.rsplit(" ", 1)[1])


# ---- API keys ---------------------------------------------------------------------------------


def test_every_v1_route_needs_one_of_the_keys(engine):
    client = client_for(engine, api_keys=KEYS)
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", f"/v1/models/{MODEL}"), ("GET", "/v1/nowhere"), ("GET", "/elsewhere")]:
        r = client.request(method, path, json=completion())
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "didn't provide an API key" in error["message"]
    for bad in ("Bearer sk-wrong", "Bearer " + KEYS[0] + "x", "Bearer " + KEYS[0][:-1], f"Basic {KEYS[0]}", "Bearer"):
        r = client.post("/v1/completions", json=completion(), headers={"Authorization": bad})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert KEYS[0][:-1] not in r.text  # the key is never echoed
    for key in KEYS:
        assert client.post("/v1/completions", json=completion(), headers=auth(key)).status_code == 200
        assert client.get("/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/openapi.json").status_code == 200
    assert refused(client.get("/metrics").text, "unauthorized") >= 11


def test_health_and_metrics_open_or_protected(engine):
    open_client = client_for(engine, api_keys=KEYS)
    assert open_client.get("/health").status_code == 200 and open_client.get("/metrics").status_code == 200
    assert open_client.get("/ping").status_code == 200 and open_client.post("/ping").status_code == 200  # as vLLM
    assert client_for(engine, api_keys=KEYS, protect_metrics=True).get("/ping").status_code == 200
    closed = client_for(engine, api_keys=KEYS, protect_health=True, protect_metrics=True)
    for path in ("/health", "/ping", "/metrics"):
        assert closed.get(path).status_code == 401
        assert closed.get(path, headers=auth(KEYS[1])).status_code == 200
    no_keys = client_for(engine, protect_health=True, protect_metrics=True)  # nothing to protect with
    assert no_keys.get("/health").status_code == 200 and no_keys.post("/v1/completions", json=completion()).is_success


def test_key_comparison_checks_every_key_every_time(monkeypatch, engine):
    guard = AccessGuard(lambda *a: None, ServerOptions(api_keys=("a-key", "b-key", "c-key")), None)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda x, y: calls.append(1) or real(x, y))
    for token in (b"a-key", b"c-key", b"nope", b"a-ke"):
        calls.clear()
        assert guard.key_matches(token) == (token in (b"a-key", b"c-key"))
        assert len(calls) == 3  # no early exit on a match, nor on a length difference (digests are equal-length)


# ---- limits -----------------------------------------------------------------------------------


def test_body_size_limit_is_a_413(engine):
    client = client_for(engine, max_body_bytes=2048)
    big = completion(prompt="x" * 4000)
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it is read
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 100
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.post("/v1/completions", json=completion()).status_code == 200
    assert refused(client.get("/metrics").text, "too_large") == 2


def test_n_and_max_tokens_bounds(engine):
    client = client_for(engine, max_n=2, max_tokens=5)
    r = client.post("/v1/completions", json=completion(n=3))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "less than or equal to 2" in r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert len(client.post("/v1/completions", json=completion(n=2)).json()["choices"]) == 2
    r = client.post("/v1/completions", json=completion(max_tokens=6))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "limit of 5" in r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    omitted = {"model": MODEL, "prompt": "go on", "ignore_eos": True}
    assert client.post("/v1/completions", json=omitted).json()["usage"]["completion_tokens"] == 5
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "ignore_eos": True})
    assert chat.json()["usage"]["completion_tokens"] == 5
    assert client.post("/v1/completions", json=completion(n=2.0, max_tokens=5.0)).status_code == 200  # JSON ints


def test_beyond_the_in_flight_bound_a_429_with_retry_after(engine):
    app = build_app(engine, served_model_name=MODEL, options=ServerOptions(max_in_flight=3, retry_after_s=7))
    admission = app.state.ctx.admission
    server = LiveServer(app)
    server.start()
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                late = [asyncio.create_task(client.post("/v1/completions", json=completion(prompt="[[late]] a"))),
                        asyncio.create_task(client.post("/v1/completions",
                                                        json=completion(prompt="[[late]] b", n=2, stream=True)))]
                assert await asyncio.to_thread(wait_until, lambda: admission.in_flight == 3, 10)
                full = await client.post("/v1/completions", json=completion())
                never = await client.post("/v1/completions", json=completion(n=4))
                for task in late:
                    task.cancel()  # the clients leave: their slots come back
                await asyncio.gather(*late, return_exceptions=True)
                assert await asyncio.to_thread(wait_until, lambda: admission.in_flight == 0, 10)
                after = await client.post("/v1/completions", json=completion())
                return full, never, after

        full, never, after = asyncio.run(scenario())
        assert full.status_code == 429 and full.headers["retry-after"] == "7"
        error = full.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        assert after.status_code == 200
        assert refused(httpx.get(server.url + "/metrics").text, "overloaded") == 1
    finally:
        server.stop()


def test_an_engine_that_stopped_mid_request_is_a_503(tmp_path_factory):
    class StoppedEngine(FakeEngine):
        async def generate(self, request_id, prompt_ids, params):
            raise EngineDeadError("the engine thread crashed: RuntimeError: boom")
            yield  # an async generator, like the real one

    client = client_for(StoppedEngine(shared_tokenizer(tmp_path_factory), max_seq_len=512))
    for stream in (False, True):
        r = client.post("/v1/completions", json=completion(stream=stream))
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "engine thread crashed" in r.json()["error"]["message"]


# ---- logs -------------------------------------------------------------------------------------


def test_prompts_stay_out_of_the_logs_unless_asked(engine, caplog):
    secret = "the-secret-prompt-4711"
    caplog.set_level(logging.DEBUG)
    quiet = client_for(engine)
    quiet.post("/v1/completions", json=completion(prompt=f"{secret} please"))
    quiet.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}], "max_tokens": 3})
    quiet.post("/v1/completions", json=completion(prompt=f"[[crash]] {secret}"))  # a logged 500
    quiet.post("/v1/completions", json=completion(prompt=f"{secret}", temperature=-1))  # a 400
    assert any("unexpected error" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if secret in r.getMessage() or secret in (r.exc_text or "")]
    caplog.clear()
    loud = client_for(engine, log_requests=True)
    loud.post("/v1/completions", json=completion(prompt=f"{secret} please"))
    loud.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}], "max_tokens": 3})
    logged = [r for r in caplog.records if r.name == "mstar.requests" and secret in r.getMessage()]
    assert len(logged) == 2 and "/v1/chat/completions" in logged[1].getMessage()


# ---- config and command line ------------------------------------------------------------------


def test_server_section_parses_and_errors_name_the_key():
    cfg = parse_serve_config({"model": "kimi_k3", "checkpoint": "c", "server": {
        "api_keys": ["k1", "k2"], "protect_metrics": True, "max_n": 4, "max_tokens": 256, "log_requests": True}})
    assert cfg.server.api_keys == ("k1", "k2") and cfg.server.max_n == 4 and cfg.server.protect_metrics
    assert parse_serve_config(cfg.to_dict()) == cfg
    cases = [({"max_n": 0}, "'server.max_n' must be >= 1"), ({"max_n": 129}, "'server.max_n' must be <= 128"),
             ({"api_keys": [""]}, "'server.api_keys[0]' is empty"),
             ({"api_keys": ["a b"]}, "'server.api_keys[0]' holds whitespace"),
             ({"api_keys": 5}, "'server.api_keys' must be a list"),
             ({"max_body_bytes": 10}, "'server.max_body_bytes' must be >= 1024"),
             ({"max_step_failures": 0}, "'server.max_step_failures' must be >= 1"),
             ({"api_key": ["x"]}, "unknown key 'server.api_key'")]
    for section, message in cases:
        with pytest.raises(ServeConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_serve_config({"model": "kimi_k3", "checkpoint": "c", "server": section})


def test_keys_come_from_config_cli_and_environment(tmp_path):
    cfg = load_serve_config(CONFIG, [f"checkpoint={tmp_path}", "server.api_keys=[from-config]",
                                     "scheduler.max_num_seqs=8", "scheduler.max_waiting=5"])
    keys = api_keys(cfg, ["from-cli", "from-config"], Environment.read({"MSTAR_API_KEY": " env-1, env-2 ,"}))
    assert keys == ("from-config", "from-cli", "env-1", "env-2")
    with pytest.raises(ServeConfigError, match="MSTAR_API_KEY entry 2 holds whitespace") as err:
        Environment.read({"MSTAR_API_KEY": "good,bad key"})
    assert "bad key" not in str(err.value)
    options = server_options(cfg, ["from-cli"], log_requests=True)
    assert options.max_in_flight == 8 + 5 and options.log_requests and options.api_keys == ("from-config", "from-cli")


def test_mstar_serve_refuses_a_bad_key_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--config", str(CONFIG), "--api-key", "has space", f"checkpoint={tmp_path}/none"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key #1 holds whitespace" in err and "has space" not in err


# ---- the OpenAPI document ---------------------------------------------------------------------


def test_openapi_states_this_servers_limits(engine):
    doc = client_for(engine, api_keys=KEYS, max_n=3, max_tokens=64, max_body_bytes=4096).get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 3 and props["max_tokens"]["anyOf"][0]["maximum"] == 64
    assert props["model"]["anyOf"][0]["enum"] == [MODEL]
    assert props["prompt"]["anyOf"][1]["items"]["maximum"] == engine.tokenizer.vocab_size - 1
    assert schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] == 64
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"bearerAuth": []}]
    assert completions["responses"]["429"]["headers"]["Retry-After"]["required"]
    assert {"200", "400", "401", "413", "414", "429", "431", "500", "503"} <= set(completions["responses"])
    assert all({"414", "431"} <= set(op["responses"]) for item in doc["paths"].values() for op in item.values())
    assert "security" not in doc["paths"]["/health"]["get"] and "security" not in doc["paths"]["/ping"]["post"]
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
