"""Tracebacks that a client can cause, logged at most once per exception type per minute.

A client that can make the server fail (a request that breaks an endpoint, or an engine step) must
not be able to flood the log with tracebacks on demand: the first failure of a type in an interval
logs its traceback, later ones one line with the exception's type and the start of its text. Both the
HTTP server (server/errors.py) and the engine thread (engine/async_engine.py) log through this, which
is why it sits above both.
"""

from __future__ import annotations

import logging
import time

TRACEBACK_INTERVAL_S = 60.0  # one traceback per exception type in this long; the others as one line
TEXT_CHARS = 200  # how much of a suppressed traceback's exception text its one line keeps


class TracebackLimiter:
    """Whether an exception's traceback goes to the log now: once per type per `interval_s`."""

    def __init__(self, interval_s: float = TRACEBACK_INTERVAL_S):
        self.interval_s = interval_s
        self._last: dict[type, float] = {}

    def allow(self, exc: BaseException) -> bool:
        now = time.monotonic()
        last = self._last.get(type(exc))
        if last is not None and now - last < self.interval_s:
            return False
        self._last[type(exc)] = now
        return True

    def error(self, logger: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
        """`message % args` at ERROR, with `exc`'s traceback if `allow`s it, else with its type and text."""
        if self.allow(exc):
            logger.error(message, *args, exc_info=exc, stacklevel=2)  # the record names the caller's line
        else:
            logger.error(f"{message}: %s: %s (traceback logged at most once a minute)", *args, type(exc).__name__,
                         str(exc)[:TEXT_CHARS], stacklevel=2)
