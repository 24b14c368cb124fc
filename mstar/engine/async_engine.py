"""The engine core on its own thread, behind an asyncio interface for the HTTP server.

The core is single-threaded: the event loop never touches it. `generate` hands a request to the
engine thread through a queue and receives its deltas through a per-request asyncio queue, so
each request's outputs arrive in the order the engine produced them (position order). A request
whose consumer goes away (client disconnect, cancelled task) is aborted and its pages and slot are
freed at the next step boundary.

Failures never leave a client waiting:
- a step that raises: every request in flight ends with finish_reason "error" (`core.fail_all`
  frees what they held) and the engine goes on with the next requests;
- `max_step_failures` failed steps in a row (a persistent fault), or the engine thread itself
  raising: the engine stops for good. Every request it knows of, queued or running, ends with an
  error; `generate` raises `EngineDeadError` from then on; `healthy` is False; `fatal_error` says
  why, and `on_fatal(message)` is called (mstar-serve then exits with status 3).
What a client is told names its request and what failed, never the exception's type or text (which
may quote internals, or another request's data): those go to the log, with the ids of the requests
that failed, and their tracebacks at most once per exception type a minute (mstar/tracebacks.py),
since a client may find a way to make steps fail on demand.
`faults` (a `FaultInjector`, tests only) injects such failures on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mstar.engine.client import EngineStats
from mstar.engine.core import EngineCore
from mstar.engine.errors import EngineDeadError
from mstar.engine.faults import FaultInjector
from mstar.engine.outputs import RequestOutput
from mstar.engine.params import ParamError, SamplingParams
from mstar.tracebacks import TracebackLimiter

log = logging.getLogger("mstar.engine")
STEP_FAILED = "internal error in the engine step (the details are in the server log)"
ADD_FAILED = "internal error adding the request (the details are in the server log)"


class EngineGaveUp(RuntimeError):
    """Too many engine steps failed in a row: the fault is not transient."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetPrefixCache:
    done: Callable[[], None]  # called on the engine thread once the cache is empty


class AsyncEngine:
    def __init__(self, core: EngineCore, model_name: str, *, max_step_failures: int = 3,
                 faults: FaultInjector | None = None, on_fatal: Callable[[str], None] | None = None):
        if max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {max_step_failures}")
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_name = model_name
        self.max_seq_len = core.config.max_seq_len
        self._inbox: queue.SimpleQueue[_Add | _Abort | _ResetPrefixCache] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = core.stats()
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="mstar-engine", daemon=True)
        self.steps = 0
        self.failed_steps = 0
        self.max_step_failures = max_step_failures
        self._failures_in_a_row = 0
        self.fatal_error: str | None = None  # set once, when the engine stops for good
        self.on_fatal = on_fatal
        self.faults = faults
        self._tracebacks = TracebackLimiter()
        if faults is not None:
            faults.install(core)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.fatal_error is None

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
            raise EngineDeadError(self.fatal_error or "the engine is shutting down or has stopped; retry on "
                                  "another server")
        self.core.validate(prompt_ids, params)
        with self._lock:
            if self.fatal_error is not None:  # checked under the lock that `_die` holds while failing outboxes
                raise EngineDeadError(self.fatal_error)
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

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache on the engine thread, between steps, and return when it is done."""
        if not self._thread.is_alive() or self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error or "the engine has stopped; retry on another server")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(_ResetPrefixCache(lambda: loop.call_soon_threadsafe(done.set_result, None)))
        if self.fatal_error is not None:  # it died meanwhile, perhaps after answering the queued resets
            return
        await done

    # --- the engine thread --------------------------------------------------------------------
    def _send(self, message: _Add | _Abort | _ResetPrefixCache) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine cannot go on: nobody may be left waiting
            if isinstance(e, EngineGaveUp):
                self._die(str(e))
            else:
                log.critical("the engine thread crashed\n%s", traceback.format_exc())
                self._die("the engine thread crashed (the traceback is in the server log)")

    def _loop(self) -> None:
        core = self.core
        while True:
            self._take_inbox()
            if self._stopping and (not core.has_work() or not self._outboxes):
                break
            if not core.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            if self.faults is not None:
                self.faults.before_step()  # outside the step's handling: an injected crash kills the thread
            try:
                outputs = core.step()
                self.steps += 1
                self._failures_in_a_row = 0
            except Exception as e:  # a failed step must not leave clients waiting forever
                self.failed_steps += 1
                self._failures_in_a_row += 1
                self._tracebacks.error(log, e, "engine step failed (%d in a row); failing the requests in flight: %s",
                                       self._failures_in_a_row, ", ".join(core.requests) or "none")
                core.fail_all(STEP_FAILED)
                outputs = core.drain_outputs()
                if self._failures_in_a_row >= self.max_step_failures:
                    self._stats = core.stats()
                    self._deliver(outputs)
                    steps = f"{self._failures_in_a_row} engine step{'s' if self._failures_in_a_row > 1 else ''}"
                    raise EngineGaveUp(f"{steps} failed in a row (the limit is "
                                       f"server.max_step_failures={self.max_step_failures}); their errors are "
                                       "in the server log") from e
            self._stats = core.stats()
            self._deliver(outputs)
        for request_id in list(core.requests):
            core.abort_request(request_id)
        self._deliver(core.drain_outputs())
        self._answer_resets()

    def _answer_resets(self) -> None:
        """The engine stops: answer the resets still queued (nothing is cached any more), so none waits forever."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _ResetPrefixCache):
                message.done()

    def _die(self, message: str) -> None:
        """Stop for good: fail every request anyone waits for, free what the core holds, tell the owner."""
        self._accepting = False
        with self._lock:
            self.fatal_error = message
            waiting = list(self._outboxes)
        log.critical("the engine has stopped: %s", message)
        error = [RequestOutput(request_id, [], "", finished=True, finish_reason="error", error=message)
                 for request_id in waiting]
        self._deliver(error)
        self._answer_resets()
        try:
            self.core.fail_all(message)
            self.core.drain_outputs()
            self._stats = self.core.stats()
        except Exception:
            log.exception("could not release the engine's requests after it stopped")
        if self.on_fatal is not None:
            try:
                self.on_fatal(message)
            except Exception:
                log.exception("the on_fatal callback failed")

    def _take_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Abort):
                self.core.abort_request(message.request_id)
                continue
            if isinstance(message, _ResetPrefixCache):
                self.core.reset_prefix_cache()
                message.done()
                continue
            try:
                self.core.add_request(message.request_id, message.prompt_ids, message.params)
            except Exception as e:  # refused (ParamError) or a bug: either way this request ends here
                refused = isinstance(e, ParamError)
                error = str(e) if refused else ADD_FAILED
                self._deliver([RequestOutput(message.request_id, [], "", finished=True, finish_reason="error",
                                             error=error)])
                if not refused:
                    self._tracebacks.error(log, e, "adding request %s failed", message.request_id)
                    self.core.abort_request(message.request_id)  # whatever of it got in; its consumer has its error
                    self._deliver(self.core.drain_outputs())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                target = self._outboxes.get(out.request_id)
                if target is not None:
                    loop, outbox = target
                    try:
                        loop.call_soon_threadsafe(outbox.put_nowait, out)
                    except RuntimeError:  # that consumer's event loop is closed: nobody is waiting
                        log.warning("dropped an output of request %s: its event loop is closed", out.request_id)
