"""Extreme but valid sampling values on the real tiny engine, with and without DSpark, at batch 1 and at
batch 64: every answer is a 200 or a 400, and greedy requests running beside them get exactly the tokens
they get alone (issue 22: no property of one request can fail the step for others). A 200 holds as many
tokens of the vocabulary as were asked for (ignore_eos), and a request that is greedy by its values
(temperature below 1e-5, or top_k 1, without penalties or biases) the reference's greedy tokens: a
temperature that overflows the scaled logits returns garbage with a 200.

The values are drawn at random from a seed printed by each test (pytest shows it with a failure);
MSTAR_SWEEP_SEED=<seed> draws the same ones again.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest
from greedy_ties import Job, assert_greedy_matches
from live_server import LiveServer
from paths import ROOT

from mstar.config import load_serve_config
from mstar.engine.params import GREEDY_TEMPERATURE
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.serve import build_engine, server_options
from mstar.server import build_app

MODEL = "kimi_k3_tiny"
SEED = int(os.environ.get("MSTAR_SWEEP_SEED") or random.randrange(2**32))
BATCH = 64  # scheduler.max_num_seqs: the rows of one step
INNOCENT = 8  # greedy requests among them
# Extreme requests beyond the batch, so that it stays full although some of them are refused (a 400):
# the scheduler runs BATCH at once and queues the others.
EXTRA = 32
TEMPERATURES = [1e-45, 3e-39, 1e-38, 9.99e-6, 1e-5, 1e-4, 0.3, 1.9, 100.0, 1e30]
TOP_PS = [1e-9, 0.5, 1.0]
TOP_KS = [0, 1, 2, 2**62, -1]
MIN_PS = [0.0, 1e-9, 0.5, 1.0]
SEEDS = [None, 0, 7, 2**63 - 129, 2**63 - 1, -1]  # the largest accepted seed (n <= 128), and one past it
# Penalties at the ends of their ranges: repetition_penalty is any positive number (below fp32's
# smallest it rounds to 0 on the device, above its largest to inf), presence/frequency in [-2, 2].
REPETITION = [5e-324, 1e-45, 1e-38, 1e-30, 0.01, 1.0, 1.5, 1e30, 3e38, 1.7e308]
PRESENCE_FREQUENCY = [-2.0, -1e-9, 0.0, 1e-9, 2.0]
BIASES = [-100.0, -1e-9, 0.0, 1e-9, 100.0]  # logit_bias values: [-100, 100]


@pytest.fixture(scope="module", params=["kimi_k3_tiny.yaml", "kimi_k3_tiny_dspark.yaml"], ids=["plain", "dspark"])
def live(request, tiny_dirs):
    target, draft = tiny_dirs
    # BATCH requests prefilled in one step: short prompts, a step budget and prefill count that take them all
    overrides = [f"checkpoint={target}", "max_seq_len=64", "resources.mla_kv.max_num_pages=160",
                 "scheduler.max_num_batched_tokens=1024", f"scheduler.max_num_seqs={BATCH}",
                 f"scheduler.max_prefill_seqs={BATCH}", f"resources.kda_state.max_slots={BATCH + 1}"]
    if "dspark" in request.param:
        overrides += [f"model_kwargs.speculative_draft={draft}", "resources.dspark_kv.max_num_pages=160"]
    cfg = load_serve_config(ROOT / "configs" / request.param, overrides)
    engine = build_engine(cfg)
    server = LiveServer(build_app(engine, served_model_name=MODEL, options=server_options(cfg)))
    server.start()
    yield engine, server
    server.stop()
    engine.shutdown()


def _seeded(what: str) -> random.Random:
    print(f"{what}: sweep seed {SEED} (MSTAR_SWEEP_SEED={SEED} draws the same values)")
    return random.Random(SEED)


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab - 256) for _ in range(rng.randint(2, 6))]  # ordinary ids, below the specials


def _extreme(rng: random.Random, vocab: int) -> dict:
    body = {"temperature": rng.choice(TEMPERATURES), "top_p": rng.choice(TOP_PS), "top_k": rng.choice(TOP_KS),
            "min_p": rng.choice(MIN_PS), "max_tokens": rng.randint(1, 5), "ignore_eos": True}
    seed = rng.choice(SEEDS)
    if seed is not None:
        body["seed"] = seed
    if rng.random() < 0.5:
        body["repetition_penalty"] = rng.choice(REPETITION)
        body["presence_penalty"] = rng.choice(PRESENCE_FREQUENCY)
        body["frequency_penalty"] = rng.choice(PRESENCE_FREQUENCY)
    if rng.random() < 0.5:  # a few tokens, or hundreds, at the ends of the range; the vocabulary's last id too
        tokens = rng.sample(range(vocab), rng.choice([1, 3, 300])) + [vocab - 1]
        body["logit_bias"] = {str(t): rng.choice(BIASES) for t in tokens}
    return body


async def _post(client: httpx.AsyncClient, url: str, prompt: list[int], body: dict) -> httpx.Response:
    return await client.post(url + "/v1/completions", json={"prompt": prompt, "return_token_ids": True, **body})


def _greedy_by_values(body: dict) -> bool:
    """The request's token is the argmax of the raw logits (its values leave no other choice)."""
    processed = (body.get("repetition_penalty", 1) != 1 or body.get("presence_penalty", 0) != 0
                 or body.get("frequency_penalty", 0) != 0 or any(body.get("logit_bias", {}).values()))
    return not processed and (body["temperature"] < GREEDY_TEMPERATURE or body["top_k"] == 1)


def _check(r: httpx.Response, prompt: list[int], body: dict, vocab: int) -> Job | None:
    """A 200 or a 400; a 200 with `max_tokens` tokens of the vocabulary. The (prompt, max_tokens, tokens)
    of a request that is greedy by its values, for `_check_greedy`."""
    shown = {k: (f"{len(v)} entries" if k == "logit_bias" else v) for k, v in body.items()}
    assert r.status_code in (200, 400), f"seed {SEED}, {shown}: {r.status_code} {r.text[:300]}"
    if r.status_code == 400:
        return None
    choice = r.json()["choices"][0]
    tokens = choice["token_ids"]
    assert choice["finish_reason"] == "length" and len(tokens) == body["max_tokens"], f"seed {SEED}, {shown}: {choice}"
    assert all(0 <= t < vocab for t in tokens), f"seed {SEED}, {shown}: {tokens}"
    return (prompt, body["max_tokens"], tokens) if _greedy_by_values(body) else None


def _check_greedy(model, jobs: list[Job]) -> None:
    """Each job's tokens are the reference's greedy ones (a near tie may excuse a few: greedy_ties.py)."""
    reference = [(prompt, n, greedy_generate(model, prompt, n)) for prompt, n, _ in jobs]
    assert_greedy_matches(model, reference, [tokens for _, _, tokens in jobs], max_tied=max(2, len(jobs) // 8))


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def test_extreme_values_alone_are_a_200_or_a_400(live, tiny_model):
    engine, server = live
    rng = _seeded("batch 1")
    vocab = engine.tokenizer.vocab_size

    async def sweep() -> list[Job]:
        greedy = []
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(12):
                prompt, body = _prompt(rng, vocab), _extreme(rng, vocab)
                job = _check(await _post(client, server.url, prompt, body), prompt, body, vocab)
                greedy += [job] if job else []
        return greedy

    _check_greedy(tiny_model, asyncio.run(sweep()))
    assert engine.healthy and engine.failed_steps == 0


def test_greedy_requests_in_a_batch_of_64_extreme_ones_are_untouched(live, tiny_model, monkeypatch):
    engine, server = live
    rng = _seeded(f"batch {BATCH}")
    vocab = engine.tokenizer.vocab_size
    innocents = [(_prompt(rng, vocab), rng.randint(4, 8)) for _ in range(INNOCENT)]
    hostile = [(_prompt(rng, vocab), _extreme(rng, vocab)) for _ in range(BATCH - INNOCENT + EXTRA)]

    # The engine's first step waits (30 s at most) until every request is in, or answered with a 400, so
    # that they run in the same steps: BATCH rows (fewer only if more than EXTRA were refused).
    core, step, schedule = engine.core, engine.core.step, engine.core.scheduler.schedule
    refused = 0
    peak = 0  # the most requests one step ran
    gathered = False

    def gathered_step():
        nonlocal gathered
        gathered = gathered or len(core.requests) + refused >= len(hostile) + INNOCENT or time.monotonic() > deadline
        if not gathered:
            time.sleep(0.002)
            return []  # nothing ran: the engine loop takes its inbox and comes back
        return step()

    def counted_schedule():
        nonlocal peak
        declared = schedule()
        if declared is not None:
            peak = max(peak, len({s.request_id for s in declared.seqs}))
        return declared

    async def scenario():
        nonlocal refused, deadline
        # a connection each: a request queued in the client for one would never reach the waiting engine
        limits = httpx.Limits(max_connections=len(hostile) + INNOCENT)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            alone = [await _post(client, server.url, p, _greedy(n)) for p, n in innocents]
            monkeypatch.setattr(core, "step", gathered_step)
            monkeypatch.setattr(core.scheduler, "schedule", counted_schedule)
            deadline = time.monotonic() + 30

            async def hostile_one(prompt, body):
                nonlocal refused
                r = await _post(client, server.url, prompt, body)
                refused += r.status_code == 400
                return r

            together = await asyncio.gather(*(hostile_one(p, b) for p, b in hostile),
                                            *(_post(client, server.url, p, _greedy(n)) for p, n in innocents))
            return alone, together

    deadline = 0.0
    alone, together = asyncio.run(scenario())
    greedy = [_check(r, prompt, body, vocab) for r, (prompt, body) in zip(together, hostile, strict=False)]
    _check_greedy(tiny_model, [job for job in greedy if job])
    served = sum(r.status_code == 200 for r in together)
    assert peak == min(BATCH, served), f"seed {SEED}: {served} served, at most {peak} in one step"
    print(f"{served} served ({refused} refused), {peak} in one step")
    solo = [r.json()["choices"][0]["token_ids"] for r in alone]
    beside = []
    for r in together[len(hostile):]:
        assert r.status_code == 200, f"seed {SEED}: {r.text[:300]}"
        beside.append(r.json()["choices"][0]["token_ids"])
    # Equal to their solo outputs; a batch of 64 sums in another order than a batch of 1, so a greedy
    # choice within fp32 noise of a tie may flip (greedy_ties.py says when that excuses a difference).
    assert_greedy_matches(tiny_model, [(p, n, s) for (p, n), s in zip(innocents, solo, strict=True)], beside)
    assert engine.healthy and engine.failed_steps == 0
