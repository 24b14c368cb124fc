"""Fault injection through HTTP, on the real tiny engine behind the real server (loopback).

What is promised (README, "Operating the server"):
- a step that raises ends every request in flight with an error response (a 500 `engine_error`, or
  an error event then [DONE] in a stream), never a hang; the pools are freed and the next requests
  are served, greedy-exact. The client is told its request id and that the step failed, never the
  exception (that goes to the log, with the ids, its traceback at most once per type a minute);
- non-finite logits (NaN or inf) end only the affected request, with an error; the others are
  unaffected and no garbage token is sent;
- `server.max_step_failures` failed steps in a row, or a crash of the engine thread, stop the engine:
  requests in flight get errors, /health and new requests answer 503, and mstar-serve exits 3
  with a message that says why.
mstar-serve runs tp_size 1 only so far, so there is no rank to kill here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter

import httpx
import pytest
from live_server import LiveServer, start_mstar_serve, wait_until
from paths import ROOT

from mstar.config import Environment, load_serve_config
from mstar.engine.faults import FaultInjector, FaultPlan, FaultSpecError, parse_fault_spec
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.serve import EXIT_ENGINE_FAILED, build_engine
from mstar.server import build_app

CONFIG = ROOT / "configs" / "kimi_k3_tiny.yaml"
MODEL = "kimi_k3_tiny"
POISON = "POISONED-LOGITS"
INF = "INFINITE-LOGITS"
SMALL = ["max_seq_len=512", "resources.mla_kv.max_num_pages=128", "scheduler.max_num_batched_tokens=256"]
OUTCOMES: Counter = Counter()  # "fault -> outcome", printed at the end


def serve(tiny_dir, faults: FaultInjector, *overrides: str):
    cfg = load_serve_config(CONFIG, [f"checkpoint={tiny_dir}", *SMALL, *overrides])
    engine = build_engine(cfg, faults=faults)
    server = LiveServer(build_app(engine, served_model_name=MODEL))
    server.start()
    return engine, server


def pools_empty(engine) -> bool:
    s = engine.stats()
    return s.running == s.waiting == s.kv_pages_used == s.kda_slots_used == 0


def body(prompt, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, "return_token_ids": True}


async def post(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[int, dict | list]:
    """(status, JSON body) or, for a stream, (status, [events]) with "[DONE]" kept as a string."""
    if not payload.get("stream"):
        r = await client.post(url + "/v1/completions", json=payload)
        return r.status_code, r.json()
    events: list = []
    async with client.stream("POST", url + "/v1/completions", json=payload) as r:
        if r.status_code != 200:  # failed before the first byte: a plain error response
            await r.aread()
            return r.status_code, r.json()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return r.status_code, events


def stream_tokens(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", ()) for t in c.get("token_ids") or []]


def stream_error(events: list) -> dict | None:
    return next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)


def step_failure_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mstar.engine" and "engine step failed" in r.getMessage()]


@pytest.fixture(scope="module")
def live(tiny_dir):
    faults = FaultInjector(FaultPlan(poison=((POISON, float("nan")), (INF, float("inf")))))
    engine, server = serve(tiny_dir, faults)
    yield engine, server, faults
    server.stop()
    engine.shutdown()


def test_fault_spec_parses_and_refuses_nonsense():
    plan = parse_fault_spec("step:3, step:9,crash:20,nan:XYZ,inf:ABC")
    assert plan.failing_steps == {3, 9} and plan.crash_at == 20 and plan.failing_from is None
    assert plan.poison[0][0] == "XYZ" and plan.poison[1] == ("ABC", float("inf"))
    assert parse_fault_spec("step:5+").failing_from == 5
    for bad in ("step", "step:0", "step:x", "boom:3", "crash:2+", "nan:"):
        with pytest.raises(FaultSpecError, match="fault entry"):
            parse_fault_spec(bad)
    assert Environment.read({}).fault_inject is None
    spec = Environment.read({"MSTAR_FAULT_INJECT": "step:2"}).fault_inject
    assert FaultInjector.from_spec(spec).plan.failing_steps == {2}


def test_failed_step_fails_requests_in_flight_then_serving_goes_on(live, tiny_model, caplog):
    engine, server, faults = live
    caplog.set_level(logging.INFO, logger="mstar.engine")
    prompts = [engine.tokenizer.encode(f"def step_fault_{i}(x):\n") for i in range(3)]

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            running = [asyncio.create_task(post(client, server.url, body(p, 300, stream=i > 0)))
                       for i, p in enumerate(prompts)]
            assert await asyncio.to_thread(wait_until, lambda: engine.stats().running == 3, 30)
            await asyncio.sleep(0.2)  # a few decode steps
            faults.arm(step_failures=1)
            failed = await asyncio.wait_for(asyncio.gather(*running), 60)  # no hang
            after = await asyncio.gather(*(post(client, server.url, body(p, 10, stream=i == 1))
                                           for i, p in enumerate(prompts)))
            return failed, after

    failed, after = asyncio.run(scenario())
    status, whole = failed[0]
    assert status == 500 and whole["error"]["code"] == "engine_error", whole
    # The client learns which request failed and that the step did, not the exception (nor its type):
    # it could quote internals, or other requests' data.
    messages = [whole["error"]["message"]] + [stream_error(events)["message"] for _, events in failed[1:]]
    ids = [re.search(r"request (cmpl-[0-9a-f]+-0)", m).group(1) for m in messages]
    assert all("internal error in the engine step" in m and "server log" in m for m in messages), messages
    assert not any("injected fault" in m.lower() or "InjectedFault" in m for m in messages), messages
    for status, events in failed[1:]:  # streams: the status went out before the fault
        assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert stream_error(events)["code"] == "engine_error"
        assert 0 < len(stream_tokens(events)) < 300
    assert [events[0]["id"] + "-0" for _, events in failed[1:]] == ids[1:]  # the id the stream's chunks carry
    [logged] = step_failure_logs(caplog)  # the detail, and the ids a client may quote, are in the log
    assert "injected fault in engine step" in str(logged.exc_info[1]) and all(i in logged.getMessage() for i in ids)
    OUTCOMES["step fault -> 3 in-flight requests got errors"] += 1
    assert wait_until(lambda: pools_empty(engine), 10)
    assert engine.healthy and engine.failed_steps == 1
    expect = [greedy_generate(tiny_model, p, 10) for p in prompts]
    assert after[0][1]["choices"][0]["token_ids"] == expect[0]
    assert stream_tokens(after[1][1]) == expect[1] and after[2][1]["choices"][0]["token_ids"] == expect[2]
    OUTCOMES["step fault -> later requests served greedy-exact"] += 1


@pytest.mark.parametrize("marker", [POISON, INF])
def test_non_finite_logits_end_only_that_request(live, tiny_model, marker):
    engine, server, faults = live
    tok = engine.tokenizer
    clean = [tok.encode(f"class Clean{i}:\n    pass\n") for i in range(3)]
    poisoned_before = faults.injected["poisoned_rows"]

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                post(client, server.url, body(f"# {marker}\nimport os\n", 12)),
                post(client, server.url, body(f"# {marker}\nimport sys\n", 12, stream=True)),
                *(post(client, server.url, body(p, 12, stream=i == 0)) for i, p in enumerate(clean)))

    bad_whole, bad_stream, *good = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert bad_whole[0] == 500 and "non-finite logits" in bad_whole[1]["error"]["message"]
    # The first sampled row is poisoned: the stream fails before its first byte, so with a 500 too
    # (a poisoned row later in a stream would end it with an error event instead); no token went out.
    assert bad_stream[0] == 500 and "non-finite logits" in bad_stream[1]["error"]["message"]
    assert faults.injected["poisoned_rows"] > poisoned_before
    expect = [greedy_generate(tiny_model, p, 12) for p in clean]
    assert stream_tokens(good[0][1]) == expect[0]
    assert [g[1]["choices"][0]["token_ids"] for g in good[1:]] == expect[1:]
    assert wait_until(lambda: pools_empty(engine), 10) and engine.healthy
    OUTCOMES[f"{marker} -> that request got an error, 3 others exact"] += 1


def test_a_request_that_breaks_admission_fails_alone(live, monkeypatch):
    engine, server, _ = live
    real_add = engine.core.add_request

    def add(request_id, prompt_ids, params):
        if params.max_tokens == 7:  # this one request hits a bug inside the engine
            raise RuntimeError("simulated bug in add_request")
        return real_add(request_id, prompt_ids, params)

    monkeypatch.setattr(engine.core, "add_request", add)
    r = httpx.post(server.url + "/v1/completions", json=body("import re\n", 7), timeout=30)
    assert r.status_code == 500 and "internal error adding the request" in r.json()["error"]["message"]
    assert "simulated" not in r.text and "RuntimeError" not in r.text  # the detail is the log's
    ok = httpx.post(server.url + "/v1/completions", json=body("import re\n", 6), timeout=30)
    assert ok.status_code == 200 and engine.healthy and wait_until(lambda: pools_empty(engine), 10)
    OUTCOMES["bug while adding a request -> that request got an error, the next served"] += 1


def test_persistent_step_failures_stop_the_engine(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="mstar.engine")
    faults = FaultInjector.from_spec("step:1+")
    engine, server = serve(tiny_dir, faults, "server.max_step_failures=2")
    stopped = []
    engine.on_fatal = stopped.append
    try:
        prompt = engine.tokenizer.encode("while True:\n")
        with httpx.Client(timeout=30) as client:
            first = client.post(server.url + "/v1/completions", json=body(prompt, 8))
            assert first.status_code == 500 and engine.healthy  # one failure: the engine goes on
            second = client.post(server.url + "/v1/completions", json=body(prompt, 8))
            assert second.status_code == 500
            assert wait_until(lambda: not engine.healthy, 10)
            assert "2 engine steps failed in a row" in engine.fatal_error and stopped == [engine.fatal_error]
            assert client.get(server.url + "/health").status_code == 503
            third = client.post(server.url + "/v1/completions", json=body(prompt, 8))
            assert third.status_code == 503 and third.json()["error"]["type"] == "service_unavailable_error"
        for r in (first, second, third):
            assert "injected" not in r.json()["error"]["message"].lower(), r.text
        assert faults.injected["step"] == 2 and pools_empty(engine)
        # Both failures are logged with their exception; a client that makes steps fail on demand gets one
        # traceback a minute into the log, the rest one line each.
        logged = step_failure_logs(caplog)
        assert len(logged) == 2 and all("injected fault" in r.getMessage() or r.exc_info for r in logged)
        assert [r.exc_info is not None for r in logged] == [True, False]
        OUTCOMES["persistent step fault -> engine stopped, 503s"] += 1
    finally:
        server.stop()
        engine.shutdown()


def test_engine_thread_crash_fails_everyone_waiting(tiny_dir, caplog):
    faults = FaultInjector(FaultPlan())
    engine, server = serve(tiny_dir, faults)
    try:
        prompts = [engine.tokenizer.encode(f"x_{i} = {i}\n") for i in range(3)]

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                running = [asyncio.create_task(post(client, server.url, body(p, 300, stream=i == 0)))
                           for i, p in enumerate(prompts)]
                assert await asyncio.to_thread(wait_until, lambda: engine.stats().running == 3, 30)
                faults.arm(crash=True)
                return await asyncio.wait_for(asyncio.gather(*running), 60)

        results = asyncio.run(scenario())
        assert "engine thread crashed" in stream_error(results[0][1])["message"]
        assert all(status == 500 and "engine thread crashed" in b["error"]["message"] for status, b in results[1:])
        assert not any("InjectedFault" in m for m in [stream_error(results[0][1])["message"]] + [
            b["error"]["message"] for _, b in results[1:]])  # the exception goes to the log, not to clients
        assert not engine.healthy and "engine thread crashed" in engine.fatal_error
        assert any("InjectedFault" in r.getMessage() for r in caplog.records if r.name == "mstar.engine")
        r = httpx.post(server.url + "/v1/completions", json=body(prompts[0], 4), timeout=10)
        assert r.status_code == 503
        OUTCOMES["engine thread crash -> 3 in-flight errors, then 503"] += 1
    finally:
        server.stop()
        engine.shutdown()


def test_mstar_serve_exits_3_with_a_message_when_the_engine_stops(tiny_dir):
    proc, url = start_mstar_serve(["--config", str(CONFIG), f"checkpoint={tiny_dir}", *SMALL,
                                   "server.max_step_failures=1"], {"MSTAR_FAULT_INJECT": "step:1+"})
    try:
        r = httpx.post(url + "/v1/completions", json=body("def f():\n", 8), timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert proc.wait(timeout=60) == EXIT_ENGINE_FAILED
        out = proc.stdout.read()
        assert "fault injection is ON" in out
        assert "mstar-serve: the engine stopped: 1 engine step failed in a row" in out
        assert f"Exiting with status {EXIT_ENGINE_FAILED}" in out
        OUTCOMES["mstar-serve with a persistent fault -> exit 3 with a message"] += 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fault_summary(live, capsys):
    _, _, faults = live
    assert len(OUTCOMES) >= 7, OUTCOMES
    with capsys.disabled():
        print(f"\nfaults: {dict(faults.injected)} in the shared engine; outcomes: {dict(OUTCOMES)}")
