"""`mstar-soak`: drive a few hundred mixed requests at an mstar server on loopback and check every
answer: nothing lost, truncated, duplicated or crossed between clients.

    mstar-soak --config configs/kimi_k3_tiny.yaml --requests 400 --duration 300 --concurrency 24
    mstar-soak --url http://127.0.0.1:8000 --checkpoint checkpoints/kimi_k3_tiny [--api-key KEY]

With `--config` it serves the config itself (engine + HTTP server on 127.0.0.1, a free port, an API
key of its own) and stops it at the end; with `--url` it drives a server that runs already
(loopback addresses only). It stops by itself: no request is sent after `--requests` or
`--duration`, and each request has a timeout.

The mix (fixed by `--seed`): completions and chats, streamed and not, short and long prompts,
n > 1 greedy and seeded-sampled, stop strings, and clients that leave mid-stream or give up
waiting. Every request has a prompt of its own (a numbered header), asks for `return_token_ids`,
and is checked against what it must be:
- the server's `prompt_token_ids` are this client's prompt (nothing crossed between clients);
- greedy continuations (`temperature=0`, `ignore_eos`) equal the reference model's
  (`greedy_generate` on the same checkpoint), for every choice;
- lengths are exact (`max_tokens` tokens, finish_reason "length"), text is the tokens' text, a stop
  string cuts the reference's text at its first occurrence, usage adds up;
- a stream has each choice's finish_reason once, on its last chunk, no error event, and one
  `[DONE]` at the very end;
- n choices come back with indices 0..n-1, once each.
A 429 is retried after its Retry-After (for up to `--request-timeout`); the latency of a retried
request counts from its first attempt. At the end the engine's pools must be empty (no request
running or waiting, no KV page or KDA slot held) and nothing admitted in flight.

`--hostile` mixes in clients a careful server must answer without hurting the others: extreme but
valid sampling values (a 200 or a 400), tool-call arguments nested 5,000 deep (a 400), a 9 MiB body
(a 413), connections closed mid-body, and slow clients that send their headers or their body a byte
per 0.1 s (a 408 at the server's `server.header_timeout_s` or `server.body_timeout_s`; each holds a
soak client that long); the greedy checks of everyone else stay as they are.

Reported: requests issued, completed, aborted as planned, lost (any request that failed or whose
answer was wrong; must be 0), p50/p99 end-to-end latency and TTFT. Exit status 0 only when
nothing was lost and the pools emptied.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import secrets
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

KINDS = {  # kind: weight in the mix
    "complete": 20,
    "complete_stream": 18,
    "long": 8,
    "chat": 10,
    "chat_stream": 10,
    "n_greedy": 8,
    "n_sampled": 8,
    "stop": 8,
    "abort_stream": 5,
    "abort_wait": 5,
}
HOSTILE_KINDS = {  # --hostile adds these: clients that must get a careful answer and hurt nobody
    "extreme_sampling": 6,  # tiny/huge temperatures, top_p 1e-9, top_k 2**62, min_p 1: a 200 or a 400
    "nested_tools": 3,  # tool-call arguments nested 5,000 deep: a 400
    "huge_body": 2,  # a 9 MiB body: a 413
    "disconnect_body": 3,  # headers and part of a body, then the connection closes
    "slow_headers": 2,  # a request line and headers a byte per 0.1 s: a 408 at the header deadline
    "slow_body": 2,  # headers, then the body a byte per 0.1 s: a 408 at the body deadline
}
TRICKLE_S = 0.1  # slow_headers, slow_body: seconds between two bytes
EXTREME_TEMPERATURES = (1e-45, 3e-39, 1e-38, 9.99e-6, 1e-5, 1e-4, 100.0, 1e30)
GREEDY_KINDS = {"complete", "complete_stream", "long", "chat", "chat_stream", "n_greedy", "stop", "abort_stream"}
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "value", "token", "light", "seven", "forty",
         "import", "return", "yield", "lambda", "class", "object", "buffer", "socket", "thread", "queue"]
ABORT_REFERENCE_TOKENS = 8  # an abandoned stream is checked against this much of the reference


@dataclass(frozen=True)
class Job:
    """One planned request."""

    index: int
    kind: str
    text: str  # the prompt (completions) or the user message (chats)
    max_tokens: int
    stream: bool
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    abort_after_chunks: int = 0  # abort_stream: leave after this many chunks with tokens
    abort_after_s: float = 0.0  # abort_wait: give up waiting after this long

    @property
    def chat(self) -> bool:
        return self.kind in ("chat", "chat_stream")

    @property
    def greedy(self) -> bool:
        return self.kind in GREEDY_KINDS


@dataclass
class Expected:
    prompt_ids: list[int]
    reference: list[int] | None = None  # greedy continuation
    reference_text: str | None = None
    stop: str | None = None  # stop jobs: the stop string, chosen from the reference text


@dataclass
class Outcome:
    job: Job
    status: str  # "ok" | "aborted" | "lost"
    problems: list[str] = field(default_factory=list)
    latency_s: float | None = None
    ttft_s: float | None = None
    retries_429: int = 0


# ---- the plan ---------------------------------------------------------------------------------


def _prompt(rng: random.Random, index: int, long: bool) -> str:
    header = f"# soak request {index}: {rng.choice(WORDS)} {rng.choice(WORDS)}\n"
    lines = rng.randint(15, 45) if long else rng.randint(1, 3)  # long: ~170..500 tokens
    body = "".join(f"{rng.choice(WORDS)}_{index}_{i} = {rng.randint(0, 999)}\n" for i in range(lines))
    return header + body + f"def {rng.choice(WORDS)}_{index}("


def make_plan(count: int, seed: int | None, hostile: bool = False) -> list[Job]:
    rng = random.Random(seed)
    kinds, weights = zip(*({**KINDS, **HOSTILE_KINDS} if hostile else KINDS).items(), strict=True)
    jobs = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        stream = kind in ("complete_stream", "chat_stream", "abort_stream") or (kind == "long" and rng.random() < 0.5)
        job = Job(index=i, kind=kind, text=_prompt(rng, i, kind == "long"), max_tokens=rng.randint(4, 16),
                  stream=stream)
        if kind == "n_greedy":
            job = Job(**{**asdict(job), "n": rng.randint(2, 3), "stream": rng.random() < 0.5})
        elif kind == "n_sampled":
            job = Job(**{**asdict(job), "n": rng.randint(2, 4), "temperature": 0.8, "seed": rng.randint(0, 10**6),
                         "stream": rng.random() < 0.5})
        elif kind == "stop":
            job = Job(**{**asdict(job), "max_tokens": 24, "stream": rng.random() < 0.5})
        elif kind == "abort_stream":
            job = Job(**{**asdict(job), "max_tokens": 256, "abort_after_chunks": rng.randint(1, 4)})
        elif kind == "abort_wait":
            job = Job(**{**asdict(job), "max_tokens": 256, "abort_after_s": rng.uniform(0.2, 1.0)})
        jobs.append(job)
    return jobs


def chat_messages(job: Job) -> list[dict]:
    return [{"role": "user", "content": job.text}]


def expectations(jobs: list[Job], tokenizer, model, max_seq_len: int | None = None) -> dict[int, Expected]:
    """Prompt ids of every job, and the reference model's greedy continuation of the greedy ones."""
    from mstar.models.kimi_k3.chat import encode_chat
    from mstar.models.kimi_k3.generate import greedy_generate

    out = {}
    for job in jobs:
        if job.chat:
            ids = encode_chat(tokenizer, chat_messages(job), None, thinking=True)
        else:
            ids = tokenizer.encode(job.text)
        if max_seq_len is not None and len(ids) + job.max_tokens > max_seq_len:
            raise ValueError(f"request {job.index} ({len(ids)} prompt tokens + {job.max_tokens}) does not fit "
                             f"max_seq_len={max_seq_len}; serve a config with max_seq_len >= 1024")
        expected = Expected(prompt_ids=ids)
        if job.greedy:
            length = min(job.max_tokens, ABORT_REFERENCE_TOKENS) if job.kind == "abort_stream" else job.max_tokens
            expected.reference = greedy_generate(model, ids, length)
            expected.reference_text = tokenizer.decode(expected.reference, skip_special=True)
        if job.kind == "stop":
            expected.stop = _stop_string(expected.reference_text)
        out[job.index] = expected
    return out


def _stop_string(text: str) -> str | None:
    """Three printable ASCII characters of the reference text, past its start, not all spaces."""
    for k in range(3, len(text) - 4):
        candidate = text[k : k + 3]
        if candidate.isascii() and candidate.isprintable() and candidate.strip():
            return candidate
    return None


# ---- requests ---------------------------------------------------------------------------------


def request_body(job: Job, expected: Expected, model_name: str) -> tuple[str, dict]:
    body: dict = {"model": model_name, "max_tokens": job.max_tokens, "temperature": job.temperature, "n": job.n,
                  "stream": job.stream, "ignore_eos": True, "return_token_ids": True}
    if job.seed is not None:
        body["seed"] = job.seed
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    if expected.stop is not None:
        body["stop"] = [expected.stop]
    if job.chat:
        return "/v1/chat/completions", {**body, "messages": chat_messages(job)}
    return "/v1/completions", {**body, "prompt": job.text}


async def _post_with_retries(client: httpx.AsyncClient, path: str, body: dict, outcome: Outcome,
                             deadline: float) -> httpx.Response | None:
    while True:
        response = await client.post(path, json=body)
        if response.status_code != 429 or time.monotonic() > deadline:
            return response
        outcome.retries_429 += 1
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))


def _nested_tool_messages(depth: int) -> list[dict]:
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


async def _disconnect_mid_body(client: httpx.AsyncClient) -> None:
    """Send the headers and a tenth of the declared body on a connection of its own, then close it."""
    url = client.base_url
    headers = "".join(f"{k}: {v}\r\n" for k, v in client.headers.items() if k.lower() == "authorization")
    _, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
                 f"{headers}Content-Length: 1000\r\n\r\n{{\"prompt\": \"x".encode() + b"x" * 90)
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    await writer.wait_closed()


async def _trickle(client: httpx.AsyncClient, head: bytes, trickled: bytes, deadline: float) -> bytes:
    """On a connection of its own, send `head` at once, then `trickled` a byte per TRICKLE_S, until the
    server answers (its status line and headers), closes the connection, or `deadline`; what it sent."""
    url = client.base_url
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(head)
    answer, sent = b"", 0
    try:
        while time.monotonic() < deadline:
            if sent < len(trickled):
                writer.write(trickled[sent:sent + 1])
                sent += 1
            try:
                chunk = await asyncio.wait_for(reader.read(65536), TRICKLE_S)
            except TimeoutError:
                continue
            answer += chunk
            if not chunk or b"\r\n\r\n" in answer:
                break
    except ConnectionError:  # the server closed the connection while a byte was on its way
        answer += await reader.read()
    finally:
        writer.close()
    return answer


async def _slow_client(client: httpx.AsyncClient, kind: str, deadline: float) -> list[str]:
    """A request line and headers (slow_headers) or a body (slow_body) sent a byte per TRICKLE_S, far
    slower than any deadline of the server's allows: the answer must be a 408, never a served request."""
    host = client.base_url.host
    auth = "".join(f"{k}: {v}\r\n" for k, v in client.headers.items() if k.lower() == "authorization")
    if kind == "slow_headers":
        head, trickled = b"", f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: {'s' * 4000}\r\n\r\n".encode()
    else:
        body = json.dumps({"prompt": "x" * 4000, "max_tokens": 1}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        trickled = body
    answer = await _trickle(client, head, trickled, deadline)
    return [] if answer.startswith(b"HTTP/1.1 408") else [f"{kind}: no 408 but {answer[:120]!r}"]


async def run_hostile(client: httpx.AsyncClient, job: Job, model_name: str, outcome: Outcome,
                      deadline: float) -> list[str]:
    """A hostile job's problems: the answers a careful server gives (none for a client that leaves)."""
    rng = random.Random(job.index)
    if job.kind in ("slow_headers", "slow_body"):
        return await _slow_client(client, job.kind, deadline)
    if job.kind == "disconnect_body":
        await _disconnect_mid_body(client)
        outcome.status = "aborted"
        return []
    if job.kind == "extreme_sampling":
        body = {"model": model_name, "prompt": job.text, "max_tokens": job.max_tokens,
                "temperature": rng.choice(EXTREME_TEMPERATURES), "top_p": rng.choice([1e-9, 0.5, 1.0]),
                "top_k": rng.choice([0, 1, 2**62]), "min_p": rng.choice([0.0, 1e-9, 1.0]),
                "seed": rng.choice([0, 7, 2**63 - 1])}
        r = await _post_with_retries(client, "/v1/completions", body, outcome, deadline)
        if r.status_code == 400 or (r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in
                                    ("length", "stop")):
            return []
        return [f"extreme sampling {body}: {r.status_code} {r.text[:200]}"]
    if job.kind == "nested_tools":
        body = {"model": model_name, "messages": _nested_tool_messages(5_000), "max_tokens": 2}
        r = await _post_with_retries(client, "/v1/chat/completions", body, outcome, deadline)
        return [] if r.status_code == 400 else [f"nested tool arguments: {r.status_code} {r.text[:200]}"]
    r = await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}',
                          headers={"Content-Type": "application/json"})
    return [] if r.status_code == 413 else [f"a 9 MiB body: {r.status_code} {r.text[:200]}"]


async def run_job(client: httpx.AsyncClient, job: Job, expected: Expected, model_name: str, tokenizer,
                  deadline: float) -> Outcome:
    outcome = Outcome(job, "lost")
    path, body = request_body(job, expected, model_name)
    start = time.perf_counter()
    try:
        if job.kind in HOSTILE_KINDS:
            outcome.problems += await run_hostile(client, job, model_name, outcome, deadline)
            if outcome.status == "aborted":
                return outcome
        elif job.kind == "abort_wait":
            while True:
                try:
                    response = await asyncio.wait_for(client.post(path, json=body), job.abort_after_s)
                except TimeoutError:
                    outcome.status = "aborted"
                    return outcome
                if response.status_code != 429 or time.monotonic() > deadline:
                    break
                outcome.retries_429 += 1
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
            outcome.problems += check_whole(job, expected, response, tokenizer)
        elif job.stream:
            while True:
                events, status, ttft, retry_after = await _read_stream(client, path, body, job, start)
                if status != 429 or time.monotonic() > deadline:
                    break
                outcome.retries_429 += 1
                await asyncio.sleep(retry_after)
                start = time.perf_counter()
            outcome.ttft_s = ttft
            if job.kind == "abort_stream":
                outcome.problems += check_abandoned(job, expected, events, status)
                outcome.status = "aborted" if not outcome.problems else "lost"
                return outcome
            outcome.problems += check_stream(job, expected, events, status, tokenizer)
        else:
            response = await _post_with_retries(client, path, body, outcome, deadline)
            outcome.problems += check_whole(job, expected, response, tokenizer)
    except (httpx.HTTPError, OSError) as err:
        outcome.problems.append(f"transport error: {type(err).__name__}: {err}")
    if not outcome.problems:
        outcome.status = "ok"
        outcome.latency_s = time.perf_counter() - start
    return outcome


async def _read_stream(client: httpx.AsyncClient, path: str, body: dict, job: Job, start: float
                       ) -> tuple[list, int, float | None, float]:
    """(events, status, ttft, retry_after): events are parsed JSON chunks, "[DONE]", or raw lines
    that are neither. An abort_stream job leaves after its share of chunks with tokens."""
    events: list = []
    ttft = None
    with_tokens = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            retry_after = float(response.headers.get("retry-after", "1"))
            return [response.text], response.status_code, None, retry_after
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                events.append(("bad line", line))
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                events.append("[DONE]")
                continue
            chunk = json.loads(data)
            events.append(chunk)
            if any(c.get("token_ids") for c in chunk.get("choices", ())):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                with_tokens += 1
                if job.abort_after_chunks and with_tokens >= job.abort_after_chunks:
                    break  # leaving the block closes the connection: the server must abort the request
    return events, 200, ttft, 0.0


# ---- checks -----------------------------------------------------------------------------------


def _check_choice(job: Job, expected: Expected, index: int, ids: list[int], text: str | None,
                  finish_reason: str | None, tokenizer) -> list[str]:
    where = f"choice {index}"
    problems = []
    if expected.stop is not None:
        cut = expected.reference_text.index(expected.stop)
        if finish_reason != "stop":
            problems.append(f"{where}: finish_reason {finish_reason!r}, expected 'stop' at {expected.stop!r}")
        if text is not None and text != expected.reference_text[:cut]:
            problems.append(f"{where}: stop-cut text {text!r} != reference {expected.reference_text[:cut]!r}")
        if ids != expected.reference[: len(ids)]:
            problems.append(f"{where}: tokens are not a prefix of the reference")
        return problems
    if finish_reason != "length":
        problems.append(f"{where}: finish_reason {finish_reason!r}, expected 'length'")
    if len(ids) != job.max_tokens:
        problems.append(f"{where}: {len(ids)} tokens, expected max_tokens={job.max_tokens} (truncated or duplicated)")
    if expected.reference is not None and ids != expected.reference:
        problems.append(f"{where}: tokens differ from the greedy reference of this prompt")
    if text is not None and text != tokenizer.decode(ids, skip_special=True):
        problems.append(f"{where}: text is not the text of its tokens")
    return problems


def _check_usage(usage: dict | None, expected: Expected, total_tokens: int) -> list[str]:
    if usage is None:
        return ["no usage"]
    if usage.get("prompt_tokens") != len(expected.prompt_ids) or usage.get("completion_tokens") != total_tokens:
        return [f"usage {usage} != prompt {len(expected.prompt_ids)} + completion {total_tokens}"]
    return []


def check_whole(job: Job, expected: Expected, response: httpx.Response, tokenizer) -> list[str]:
    if response.status_code != 200:
        return [f"HTTP {response.status_code}: {response.text[:200]}"]
    body = response.json()
    choices = body.get("choices", [])
    problems = []
    if sorted(c["index"] for c in choices) != list(range(job.n)):
        problems.append(f"choice indices {[c['index'] for c in choices]}, expected 0..{job.n - 1}")
    if job.chat and body.get("prompt_token_ids") != expected.prompt_ids:
        problems.append("prompt_token_ids are not this client's prompt")
    total = 0
    for c in choices:
        ids = c.get("token_ids") or []
        total += len(ids)
        if not job.chat and c.get("prompt_token_ids") != expected.prompt_ids:
            problems.append(f"choice {c['index']}: prompt_token_ids are not this client's prompt")
        text = None if job.chat else c.get("text")
        problems += _check_choice(job, expected, c["index"], ids, text, c.get("finish_reason"), tokenizer)
    return problems + _check_usage(body.get("usage"), expected, total)


def _stream_shape(events: list) -> list[str]:
    problems = []
    if not events or events[-1] != "[DONE]":
        problems.append("the stream does not end with [DONE]")
    if events.count("[DONE]") != 1:
        problems.append(f"{events.count('[DONE]')} [DONE] events")
    for e in events:
        if isinstance(e, tuple):
            problems.append(f"not an SSE data line: {e[1][:100]!r}")
        elif isinstance(e, dict) and "error" in e:
            problems.append(f"error event: {e['error'].get('message', '')[:200]}")
    return problems


def check_stream(job: Job, expected: Expected, events: list, status: int, tokenizer) -> list[str]:
    if status != 200:
        return [f"HTTP {status}: {str(events[:1])[:200]}"]
    problems = _stream_shape(events)
    chunks = [e for e in events if isinstance(e, dict) and "error" not in e]
    ids: dict[int, list[int]] = {}
    texts: dict[int, list[str]] = {}
    finishes: dict[int, list[tuple[int, str]]] = {}
    last_chunk_of: dict[int, int] = {}
    prompt_ids_seen = []
    usage = None
    for k, chunk in enumerate(chunks):
        if chunk.get("prompt_token_ids") is not None:
            prompt_ids_seen.append(chunk["prompt_token_ids"])
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices", ()):
            i = c["index"]
            last_chunk_of[i] = k
            ids.setdefault(i, []).extend(c.get("token_ids") or [])
            if not job.chat:
                texts.setdefault(i, []).append(c.get("text", ""))
                if c.get("prompt_token_ids") is not None:
                    prompt_ids_seen.append(c["prompt_token_ids"])
            if c.get("finish_reason") is not None:
                finishes.setdefault(i, []).append((k, c["finish_reason"]))
    if sorted(ids) != list(range(job.n)):
        problems.append(f"streamed choice indices {sorted(ids)}, expected 0..{job.n - 1}")
    expected_prompts = job.n if not job.chat else 1
    if len(prompt_ids_seen) != expected_prompts or any(p != expected.prompt_ids for p in prompt_ids_seen):
        problems.append("prompt_token_ids are missing, repeated or not this client's prompt")
    for i in sorted(ids):
        done = finishes.get(i, [])
        if len(done) != 1 or done[0][0] != last_chunk_of[i]:
            problems.append(f"choice {i}: finish_reason {len(done)} times, or not on its last chunk")
            continue
        text = "".join(texts[i]) if not job.chat else None
        problems += _check_choice(job, expected, i, ids[i], text, done[0][1], tokenizer)
    return problems + _check_usage(usage, expected, sum(len(v) for v in ids.values()))


def check_abandoned(job: Job, expected: Expected, events: list, status: int) -> list[str]:
    """A stream the client left early: what came before must be this prompt's greedy tokens."""
    if status != 200:
        return [f"HTTP {status}: {str(events[:1])[:200]}"]
    got = [t for e in events if isinstance(e, dict) for c in e.get("choices", ()) for t in c.get("token_ids") or []]
    problems = [f"error event: {e['error'].get('message', '')[:200]}" for e in events
                if isinstance(e, dict) and "error" in e]
    if not got:
        problems.append("no token arrived before the client left")
    reference = expected.reference
    if got[: len(reference)] != reference[: len(got)]:
        problems.append("tokens before the abort differ from the greedy reference")
    return problems


# ---- driving ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


async def drive(url: str, jobs: list[Job], expected: dict[int, Expected], model_name: str, tokenizer, *,
                concurrency: int, duration_s: float, request_timeout_s: float, api_key: str | None
                ) -> tuple[list[Outcome], int]:
    """Closed loop: `concurrency` clients take the next job until the plan or the time runs out.
    Returns the outcomes and how many jobs were never sent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    queue = list(reversed(jobs))
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + duration_s

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.monotonic() < stop_at:
            job = queue.pop()
            retry_until = time.monotonic() + request_timeout_s  # 429s are retried this long
            outcomes.append(await run_job(client, job, expected[job.index], model_name, tokenizer, retry_until))

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return outcomes, len(queue)


def summarize(outcomes: list[Outcome], not_sent: int, wall_s: float, pools: dict) -> dict:
    status = Counter(o.status for o in outcomes)
    latencies = [o.latency_s for o in outcomes if o.latency_s is not None]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.status == "ok"]
    lost = [o for o in outcomes if o.status == "lost"]
    return {
        "issued": len(outcomes),
        "completed": status["ok"],
        "aborted_as_planned": status["aborted"],
        "lost": len(lost),
        "not_sent": not_sent,
        "retries_429": sum(o.retries_429 for o in outcomes),
        "by_kind": dict(Counter(o.job.kind for o in outcomes)),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "wall_s": wall_s,
        "pools_empty": pools.get("empty", False),
        "pools": pools,
        "problems": [f"request {o.job.index} ({o.job.kind}): {p}" for o in lost for p in o.problems][:50],
    }


def is_loopback_url(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def metrics_pools(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    names = ("mstar_requests_running", "mstar_requests_waiting", "mstar_kv_pages_used", "mstar_kda_slots_used",
             "mstar_requests_in_flight")
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    values["empty"] = len(values) == len(names) and not any(values.values())
    return values


def wait_for_pools(read, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        pools = read()
        if pools.get("empty") or time.monotonic() > deadline:
            return pools
        time.sleep(0.1)


# ---- serving the config itself ----------------------------------------------------------------


def _engine_pools(engine, in_flight: int) -> dict:
    """The engine's queues and pools, and the server's admitted generations: all zero when idle."""
    s = engine.stats()
    pools = {"running": s.running, "waiting": s.waiting, "kv_pages_used": s.kv_pages_used,
             "kda_slots_used": s.kda_slots_used, "in_flight": in_flight}
    pools["empty"] = not any(pools.values())
    return pools


def soak_config(config: str | Path, overrides: list[str] = (), *, requests: int = 300, duration_s: float = 240.0,
                concurrency: int = 16, seed: int | None = 0, request_timeout_s: float = 300.0, hostile: bool = False,
                log=print) -> dict:
    """Serve `config` on loopback, soak it, stop it; the summary (see `summarize`). `seed` None: a
    fresh plan (its seed is in the summary)."""
    import torch

    from mstar.config import load_serve_config, torch_dtype
    from mstar.models.kimi_k3.weights import load_model
    from mstar.serve import build_engine, connection_settings, server_options
    from mstar.server import build_app
    from mstar.tools.live_server import LiveServer

    cfg = load_serve_config(config, overrides)
    api_key = secrets.token_urlsafe(16)
    engine = build_engine(cfg)
    try:
        options = server_options(cfg, [api_key])
        app = build_app(engine, served_model_name=cfg.served_model_name, options=options)
        model = load_model(cfg.checkpoint, dtype=torch_dtype(cfg.dtype), device="cpu")
        seed = random.randrange(2**31) if seed is None else seed
        jobs = make_plan(requests, seed, hostile)
        started = time.perf_counter()
        with torch.inference_mode():
            expected = expectations(jobs, engine.tokenizer, model, cfg.max_seq_len)
        log(f"soak: {len(jobs)} requests planned; references computed in {time.perf_counter() - started:.1f} s")
        with LiveServer(app, graceful_shutdown_s=5, **connection_settings(cfg)) as server:  # as mstar-serve
            started = time.perf_counter()
            outcomes, not_sent = asyncio.run(drive(server.url, jobs, expected, cfg.served_model_name,
                                                   engine.tokenizer, concurrency=concurrency, duration_s=duration_s,
                                                   request_timeout_s=request_timeout_s, api_key=api_key))
            wall = time.perf_counter() - started
            pools = wait_for_pools(lambda: _engine_pools(engine, app.state.ctx.admission.in_flight))
        return {**summarize(outcomes, not_sent, wall, pools), "seed": seed}
    finally:
        engine.shutdown()


def soak_url(url: str, checkpoint: str | Path, *, model_name: str | None = None, dtype: str = "float32",
             requests: int = 300, duration_s: float = 240.0, concurrency: int = 16, seed: int | None = 0,
             request_timeout_s: float = 300.0, api_key: str | None = None, hostile: bool = False,
             log=print) -> dict:
    import torch

    from mstar.config import torch_dtype
    from mstar.models.kimi_k3.tokenizer import KimiTokenizer
    from mstar.models.kimi_k3.weights import load_model

    if not is_loopback_url(url):
        raise SystemExit(f"mstar-soak: {url} is not a loopback address; the soak test drives local servers only")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model_name = model_name or httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    tokenizer = KimiTokenizer.from_dir(checkpoint)
    model = load_model(checkpoint, dtype=torch_dtype(dtype), device="cpu")
    seed = random.randrange(2**31) if seed is None else seed
    jobs = make_plan(requests, seed, hostile)
    with torch.inference_mode():
        expected = expectations(jobs, tokenizer, model)
    log(f"soak: {len(jobs)} requests planned against {url}")
    started = time.perf_counter()
    outcomes, not_sent = asyncio.run(drive(url, jobs, expected, model_name, tokenizer, concurrency=concurrency,
                                           duration_s=duration_s, request_timeout_s=request_timeout_s,
                                           api_key=api_key))
    wall = time.perf_counter() - started
    return {**summarize(outcomes, not_sent, wall, wait_for_pools(lambda: metrics_pools(url, api_key))), "seed": seed}


def format_summary(s: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    lines = [
        f"requests: {s['issued']} issued, {s['completed']} completed, {s['aborted_as_planned']} aborted as planned, "
        f"{s['lost']} lost, {s['not_sent']} not sent (time bound); {s['retries_429']} retries after 429",
        f"latency: p50 {ms(s['latency_p50_s'])}, p99 {ms(s['latency_p99_s'])}; "
        f"TTFT (streams): p50 {ms(s['ttft_p50_s'])}, p99 {ms(s['ttft_p99_s'])}; wall {s['wall_s']:.1f} s",
        f"mix (seed {s.get('seed')}): {s['by_kind']}",
        f"pools empty at the end: {s['pools_empty']} {s['pools']}",
    ]
    lines += [f"  LOST {p}" for p in s["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="serve this config on loopback for the soak")
    where.add_argument("--url", help="soak a running server (loopback only)")
    p.add_argument("--checkpoint", type=Path, help="with --url: the server's checkpoint, for the greedy reference")
    p.add_argument("--dtype", default="float32", help="with --url: the reference model's dtype (the server's)")
    p.add_argument("--api-key", help="with --url: the server's API key")
    p.add_argument("--requests", type=int, default=300, help="requests to send at most")
    p.add_argument("--duration", type=float, default=240.0, help="seconds after which no new request is sent")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once")
    p.add_argument("--seed", type=int, default=0, help="the plan's seed (mix, prompts, lengths)")
    p.add_argument("--hostile", action="store_true",
                   help="mix in hostile clients: extreme sampling values, nested tool arguments, huge bodies, "
                        "disconnects mid-body")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, help="write the summary as JSON here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --config: config overrides")
    args = p.parse_args(argv)
    common = dict(requests=args.requests, duration_s=args.duration, concurrency=args.concurrency, seed=args.seed,
                  request_timeout_s=args.request_timeout, hostile=args.hostile)
    if args.config is not None:
        summary = soak_config(args.config, args.overrides, **common)
    else:
        if args.checkpoint is None:
            p.error("--url needs --checkpoint (the greedy reference runs the same checkpoint)")
        summary = soak_url(args.url, args.checkpoint, dtype=args.dtype, api_key=args.api_key, **common)
    print(format_summary(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    sys.exit(0 if summary["lost"] == 0 and summary["pools_empty"] else 1)


if __name__ == "__main__":
    main()
