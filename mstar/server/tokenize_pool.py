"""Tokenization (and parsing) that cannot stall the event loop: small inputs in a thread, large ones in
worker processes.

tiktoken releases the GIL while it merges, but not while it builds the Python list of ids, and the
server's own work around an encode (splitting long runs, slicing millions of ids) holds it too: a
thread that tokenizes megabytes pauses the event loop (and with it /health and every stream) for
tens to hundreds of milliseconds. A worker process holds its own GIL. It receives the text, encodes
it with its own copy of the tokenizer (loaded from the model folder once, when it starts), cuts the
ids to what the server can use (`keep`: truncate_prompt_tokens; `limit`: more ids than the context
holds are refused, and only their count comes back, as `TooManyTokens`) and sends back at most
`limit` ids, so the server process never holds millions of them.

Parsing a body of megabytes holds the GIL for one long call as well, so `parse` validates bodies of
`PARSE_MIN_BYTES` or more in a worker; long strings travel both ways as UTF-8 chunks (`_Pickler`).

A process round trip costs more than encoding a short text, so inputs under `INLINE_MAX_CHARS`
characters are encoded in a thread as before (benchmarks/tokenize_pool.md has the measurement).
A worker that dies fails the requests it held (the server answers them 500) and the pool is
replaced at once, so the next request is served.

This module runs in the workers too: it imports nothing of the server at its top (mstar.server's
package imports it lazily), only the tokenizer and K3's chat format; a worker that parses imports the
request schemas (pydantic, no engine) on first use.
"""

from __future__ import annotations

import array
import asyncio
import io
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

from mstar.models.kimi_k3.chat import encode_chat
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.process_name import set_process_name

logger = logging.getLogger("mstar.server.tokenize_pool")
Body = TypeVar("Body")

# Measured on the 2-core CI machine (benchmarks/tokenize_pool.md): up to 16K characters a thread pauses the
# event loop no more than the machine's own noise and is no slower than a worker's round trip; at 64K it
# pauses it ~13 ms, at 256K ~50 ms, while a worker takes no longer than the thread from 64K on.
INLINE_MAX_CHARS = 64 * 1024
PARSE_MIN_BYTES = 1 << 20  # request bodies this large are parsed in a worker too (`parse`)
WORKER_NICENESS = 10
WORKER_NAME = "mstar-tokenize"  # the workers' process name (at most 15 characters: Linux's comm)
START_TIMEOUT_S = 120.0  # a worker imports the tokenizer and reads the model folder's tiktoken.model
# Text whose ids the workers must give exactly as the server's tokenizer does (checked when they start).
_PROBE = "def f(x):\n    return x  # café 日本語 😀 <|open|> [EOS]" + " " * 40 + "z" * 300


class TooManyTokens(Exception):
    """Prompt `index` encodes to `count` ids (after `keep`), more than `limit`: refused without them."""

    def __init__(self, count: int, index: int = 0):
        super().__init__(count, index)  # the args rebuild it when it comes back from a worker
        self.count = count
        self.index = index


def _fit(ids: list[int], keep: int | None, limit: int | None, index: int) -> list[int]:
    if keep is not None:
        ids = ids[-keep:]  # vLLM's truncate_prompt_tokens, as server/sampling.py's truncate_prompt
    if limit is not None and len(ids) > limit:
        raise TooManyTokens(len(ids), index)
    return ids


def encode_texts(tokenizer: KimiTokenizer, texts: Sequence[str], keep: int | None, limit: int | None
                 ) -> list[list[int]]:
    return [_fit(tokenizer.encode(text), keep, limit, i) for i, text in enumerate(texts)]


def encode_conversation(tokenizer: KimiTokenizer, messages: list[dict[str, Any]], tools: list | None,
                        options: dict[str, Any], keep: int | None, limit: int | None) -> list[int]:
    return _fit(encode_chat(tokenizer, messages, tools, **options), keep, limit, 0)


# ---- what travels to a worker -------------------------------------------------------------------

LONG_STRING_CHARS = 64 * 1024
STRING_CHUNK_CHARS = 1 << 20
LONG_LIST_INTS = 64 * 1024
INT_CHUNK = 1 << 16


class _Pickler(pickle.Pickler):
    """Pickles a long string as UTF-8 chunks and a long list of ints (a prompt of token ids) as 8-byte
    words: pickle encodes a str that is not ASCII several times slower than `str.encode` does (25-51 ms
    for 8 MB) and reads back millions of ints ~70 ms, each in one call that holds the GIL. In chunks (in a
    thread) the event loop runs in between. `surrogatepass`: JSON may carry lone surrogates."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is str and len(obj) >= LONG_STRING_CHARS:
            return "str", [obj[i : i + STRING_CHUNK_CHARS].encode("utf-8", "surrogatepass")
                           for i in range(0, len(obj), STRING_CHUNK_CHARS)]
        if type(obj) is list and len(obj) >= LONG_LIST_INTS and all(type(item) is int for item in obj):
            try:
                return "ints", array.array("q", obj).tobytes()
            except OverflowError:  # an id beyond 64 bits: pickled as it is (the server refuses it)
                return None
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple[str, Any]) -> Any:
        kind, data = pid
        if kind == "str":
            return "".join([chunk.decode("utf-8", "surrogatepass") for chunk in data])
        words = memoryview(data).cast("q")
        ints: list[int] = []
        for start in range(0, len(words), INT_CHUNK):
            ints.extend(words[start : start + INT_CHUNK].tolist())
        return ints


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


# ---- the worker process ------------------------------------------------------------------------

_worker_tokenizer: KimiTokenizer | None = None


def _start_worker(directory: str) -> None:
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group: the server drains and then closes the pool, so the worker
    # must not die of it first (its queued requests would fail).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Tokenizing a huge prompt is throughput work; the server's event loop and engine thread are latency work:
    # where cores are few, they get the CPU first.
    os.nice(WORKER_NICENESS)
    set_process_name(WORKER_NAME)
    # A worker holds its own copy of the task queue's write end, so it would not see the queue close if the
    # server were killed (SIGKILL, OOM): it watches the server process instead.
    threading.Thread(target=_exit_with, args=(multiprocessing.parent_process(),), daemon=True).start()
    _worker_tokenizer = KimiTokenizer.from_dir(directory)


def _exit_with(server: multiprocessing.process.BaseProcess) -> None:
    server.join()  # returns once the server process is gone, however it ended
    os._exit(0)


def _in_worker(op: Callable[..., Any], args: bytes) -> Any:
    return op(_worker_tokenizer, *_loads(args))


def _parse_in_worker(raw: bytes, model: type) -> bytes:
    from mstar.server.protocol import parse_request  # what a worker that parses needs (pydantic, no engine)

    return _dumps(parse_request(raw, model))


# ---- the server side ---------------------------------------------------------------------------


class TokenizePool:
    """Runs the tokenizer off the event loop: `workers` processes (spawned) loading the tokenizer from
    `directory` for inputs of `inline_max_chars` characters or more, a thread for the rest (and for
    everything when `workers` is 0). `start` brings the workers up and checks that they encode as
    `tokenizer` does; `close` (or leaving `with`) stops them."""

    def __init__(self, tokenizer: KimiTokenizer, directory: str | Path | None = None, workers: int = 0,
                 inline_max_chars: int = INLINE_MAX_CHARS):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if workers and directory is None:
            raise ValueError("a tokenizer pool with workers needs the directory the workers load the tokenizer from")
        self.tokenizer = tokenizer
        self.workers = workers
        self.inline_max_chars = inline_max_chars
        self._directory = str(directory) if directory is not None else None
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # replacing a broken executor vs closing
        self._closed = False

    # ---- lifecycle ----

    def start(self) -> None:
        """Spawn the workers and wait until each has loaded the tokenizer and encodes the probe text as the
        server does (a ValueError says what differs: the server would otherwise give other ids)."""
        if not self.workers:
            return
        self._executor = self._new_executor()
        # one probe per worker: with no idle worker yet, each submit spawns one
        args = _dumps(([_PROBE], None, None))
        probes = [self._executor.submit(_in_worker, encode_texts, args) for _ in range(self.workers)]
        expected = encode_texts(self.tokenizer, [_PROBE], None, None)
        for probe in probes:
            try:
                got = probe.result(timeout=START_TIMEOUT_S)
            except Exception as err:
                self.close()
                raise ValueError(f"a tokenizer worker could not start from {self._directory} ({err}); check "
                                 "that it holds tiktoken.model and tokenizer_config.json, or set "
                                 "server.tokenize_workers=0") from err
            if got != expected:
                self.close()
                raise ValueError(f"the tokenizer in {self._directory} encodes differently from the server's; "
                                 "the workers must load the served checkpoint's tokenizer")

    def close(self) -> None:
        """Stop the workers (a request still waiting on one fails); idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids (the log names them; a test kills one)."""
        executor = self._executor
        return sorted(executor._processes) if executor is not None else []  # the executor keeps no public list

    def __enter__(self) -> TokenizePool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn: a forked worker would inherit the server's threads (engine, uvicorn) in whatever state they were
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self._directory,))

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._closed or self._executor is not broken:
                return  # closed, or another request already replaced it
            self._executor = self._new_executor()
        logger.warning("a tokenizer worker died; the requests it held failed and new workers were started")
        broken.shutdown(wait=False, cancel_futures=True)

    # ---- tokenizing ----

    async def encode(self, texts: Sequence[str], *, keep: int | None = None, limit: int | None = None
                     ) -> list[list[int]]:
        """Each text's ids (`KimiTokenizer.encode`), its last `keep` when `keep` is set; `TooManyTokens`
        when one holds more than `limit`."""
        return await self._run(sum(map(len, texts)), encode_texts, list(texts), keep, limit)

    async def encode_chat(self, num_chars: int, messages: list[dict[str, Any]], tools: list | None,
                          options: dict[str, Any], *, keep: int | None = None, limit: int | None = None
                          ) -> list[int]:
        """`encode_chat(tokenizer, messages, tools, **options)`, cut as `encode` cuts; `num_chars` (the
        conversation's text) chooses where it runs. Rendering errors (ValueError, TypeError, KeyError)
        are raised as they are."""
        return await self._run(num_chars, encode_conversation, messages, tools, options, keep, limit)

    async def parse(self, raw: bytes, model: type[Body]) -> Body:
        """`parse_request(raw, model)`, in a worker when `raw` holds `PARSE_MIN_BYTES` or more: validating a
        maximal body holds the GIL for one call of 25 ms (ASCII) to 75 ms (other scripts) on a CI core."""
        executor = self._executor
        if executor is None or len(raw) < PARSE_MIN_BYTES:
            from mstar.server.protocol import parse_request

            return parse_request(raw, model)
        return await asyncio.to_thread(_loads, await self._submit(executor, _parse_in_worker, raw, model))

    async def _run(self, num_chars: int, op: Callable[..., Any], *args: Any) -> Any:
        executor = self._executor
        if executor is None or num_chars < self.inline_max_chars:
            return await asyncio.to_thread(op, self.tokenizer, *args)
        return await self._submit(executor, _in_worker, op, await asyncio.to_thread(_dumps, args))

    async def _submit(self, executor: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wrap_future(executor.submit(fn, *args))
        except BrokenProcessPool as err:
            self._replace(executor)
            raise RuntimeError("a tokenizer worker process died while it held this request") from err
