"""The engine requests behind one HTTP request: start them, merge their outputs, close them.

Each choice is its own engine request with its own id, driven by its own task that moves the
engine's deltas into one queue: a choice's deltas stay in the engine's (position) order, choices
interleave as they come. `start` waits until every choice has produced its first output, so a
`ParamError` the engine raises when it validates the request still becomes a 400 before any byte of
a streamed response is sent.

`start` first reserves one admission slot per choice (a 429 when the server is at capacity); each
driver task gives its slot back when it ends, by a done callback, which runs even for a task
cancelled before it started.

Closing (client gone, error, or done) cancels the driver tasks; a task cancelled inside the engine
iterator ends that iterator, and the iterator is closed explicitly otherwise, so every engine
request is aborted and freed. The drivers are plain asyncio tasks, outside the cancel scope of the
HTTP response, so their cleanup is not itself cancelled again when Starlette tears a response down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mstar.engine.client import EngineClient
from mstar.engine.outputs import RequestOutput
from mstar.engine.params import ParamError, SamplingParams
from mstar.server.admission import Admission
from mstar.server.errors import APIError
from mstar.server.metrics import ServerMetrics

_END = object()
FAILED_REASONS = ("error", "abort")


@dataclass(frozen=True)
class ChoiceSpec:
    index: int  # the choice's index in the response
    request_id: str  # the engine request id
    prompt_ids: list[int]
    params: SamplingParams


class EngineFailure(APIError):
    """A choice's engine request ended with finish_reason error or abort (or without finishing)."""

    def __init__(self, request_id: str, reason: str, detail: str | None):
        if reason == "abort":
            message = f"The engine aborted request {request_id}" + (f": {detail}" if detail else "")
            super().__init__(message, status=503, code="engine_aborted")
        else:
            message = f"The engine failed request {request_id}: {detail or 'no detail given'}"
            super().__init__(message, status=500, type="server_error", code="engine_error")


async def _close_iterator(iterator: AsyncIterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class GenerationRun:
    def __init__(self, engine: EngineClient, choices: list[ChoiceSpec], metrics: ServerMetrics, arrival: float,
                 admission: Admission | None = None):
        self._engine = engine
        self._admission = admission
        self._choices = choices
        self._metrics = metrics
        self._arrival = arrival
        self._queue: asyncio.Queue = asyncio.Queue()  # unbounded: the engine's output is bounded by max_tokens
        self._tasks: list[asyncio.Task] = []
        self._primed: list[asyncio.Future] = []
        self._cached_tokens: dict[int, int] = {}  # by choice index: its prompt tokens the prefix cache served

    async def start(self) -> None:
        """Submit every choice and wait for each one's first output. Raises the engine's
        `ParamError` (or any other failure to start) after closing everything; the admission's
        429 before anything started."""
        loop = asyncio.get_running_loop()
        if self._admission is not None:
            self._admission.reserve(len(self._choices))
        for choice in self._choices:
            primed = loop.create_future()
            self._primed.append(primed)
            task = asyncio.create_task(self._drive(choice, primed), name=choice.request_id)
            if self._admission is not None:
                task.add_done_callback(self._release)
            self._tasks.append(task)
        try:
            await asyncio.gather(*self._primed)
        except BaseException:
            await self.close()
            raise

    def _release(self, _task: asyncio.Task) -> None:
        self._admission.release(1)

    async def _drive(self, choice: ChoiceSpec, primed: asyncio.Future) -> None:
        tracker = self._metrics.track(self._arrival, len(choice.prompt_ids))
        stream: AsyncIterator[RequestOutput] | None = None
        try:
            stream = self._engine.generate(choice.request_id, choice.prompt_ids, choice.params)
            async for output in stream:
                tracker.on_output(output, time.perf_counter())
                self._cached_tokens[choice.index] = output.num_cached_tokens
                if output.finished and output.finish_reason in FAILED_REASONS:
                    raise EngineFailure(choice.request_id, output.finish_reason, output.error)
                if not primed.done():
                    primed.set_result(None)
                self._queue.put_nowait((choice.index, output))
                if output.finished:
                    break
            if not tracker.done:
                raise EngineFailure(choice.request_id, "error", "its output stream ended before it finished")
        except asyncio.CancelledError:
            tracker.fail("cancelled")
            raise
        except Exception as err:
            if isinstance(err, ParamError):
                tracker.discard()
            else:
                tracker.fail("error")  # no-op if its finishing output was counted already
            if not primed.done():
                primed.set_exception(err)
            else:
                self._queue.put_nowait((choice.index, err))
        finally:
            if stream is not None:
                await _close_iterator(stream)
            if not primed.done():
                primed.cancel()
            self._queue.put_nowait((choice.index, _END))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) pairs, each choice's in order, until every choice has finished.
        A choice that failed raises its error here."""
        remaining = len(self._choices)
        try:
            while remaining:
                index, item = await self._queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await self.close()

    def num_cached_tokens(self, index: int) -> int:
        """Prompt tokens of choice `index` that the engine's prefix cache served (0 before its first output)."""
        return self._cached_tokens.get(index, 0)

    async def close(self) -> None:
        """Cancel whatever still runs and wait for it to clean up (idempotent)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for primed in self._primed:  # mark errors as seen: gather reports only the first one
            if primed.done() and not primed.cancelled():
                with contextlib.suppress(BaseException):
                    primed.exception()
