"""The engine core on its own thread, behind an asyncio interface for the HTTP server.

The core is single-threaded: the event loop never touches it. `generate` hands a request to the
engine thread through a queue and receives its deltas through a per-request asyncio queue, so
each request's outputs arrive in the order the engine produced them (position order). A request
whose consumer goes away (client disconnect, cancelled task) is aborted and its pages and slot are
freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mstar.engine.client import EngineStats
from mstar.engine.core import EngineCore
from mstar.engine.outputs import RequestOutput
from mstar.engine.params import ParamError, SamplingParams

log = logging.getLogger("mstar.engine")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, core: EngineCore, model_name: str):
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_name = model_name
        self.max_seq_len = core.config.max_seq_len
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = core.stats()
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="mstar-engine", daemon=True)
        self.steps = 0

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stop_accepting(self) -> None:
        """Drain: requests already in flight finish; new ones are refused."""
        self._accepting = False

    def shutdown(self, timeout: float = 30.0) -> None:
        self._accepting = False
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- EngineClient -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self._accepting or not self._thread.is_alive():
            raise EngineDeadError("the engine is shutting down or has stopped; retry on another server")
        self.core.validate(prompt_ids, params)
        with self._lock:
            if request_id in self._outboxes:
                raise ParamError(f"request id {request_id!r} is already in use")
            outbox: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._outboxes[request_id] = (asyncio.get_running_loop(), outbox)
        self._send(_Add(request_id, list(prompt_ids), params))
        finished = False
        try:
            while True:
                out = await outbox.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._outboxes.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    # --- the engine thread --------------------------------------------------------------------
    def _send(self, message: _Add | _Abort) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        while True:
            self._take_inbox()
            if self._stopping and (not core.has_work() or not self._outboxes):
                break
            if not core.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
                self.steps += 1
            except Exception as e:  # a failed step must not leave clients waiting forever
                log.error("engine step failed; failing in-flight requests\n%s", traceback.format_exc())
                core.fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
                outputs = core.drain_outputs()
            self._stats = core.stats()
            self._deliver(outputs)
        for request_id in list(core.requests):
            core.abort_request(request_id)
        self._deliver(core.drain_outputs())

    def _take_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Abort):
                self.core.abort_request(message.request_id)
                continue
            try:
                self.core.add_request(message.request_id, message.prompt_ids, message.params)
            except ParamError as e:
                self._deliver([RequestOutput(message.request_id, [], "", finished=True, finish_reason="error",
                                             error=str(e))])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                target = self._outboxes.get(out.request_id)
                if target is not None:
                    loop, outbox = target
                    loop.call_soon_threadsafe(outbox.put_nowait, out)
