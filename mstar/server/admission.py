"""How many engine requests the server lets in at once, so that a flood of clients meets a 429
instead of growing the engine's queue (and the server's memory) without bound.

Every choice of an HTTP request is one engine request. A request is admitted whole (all its
choices) or refused: beyond `limit` engine requests in flight it gets a 429 with `Retry-After`;
a request that could never fit (more choices than `limit`) is a 400. A slot is given back when
its choice's driver task ends, however it ends (finished, failed, client gone, cancelled before it
ran), so the count cannot leak. Everything here runs on the event loop: no lock.
"""

from __future__ import annotations

from mstar.server.errors import APIError
from mstar.server.metrics import ServerMetrics


class Admission:
    def __init__(self, limit: int | None, retry_after_s: int, metrics: ServerMetrics):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.in_flight = 0

    def reserve(self, count: int) -> None:
        """Take `count` slots, or raise the 429 (or 400) that refuses the request."""
        if self.limit is not None:
            if count > self.limit:
                raise APIError(f"The request asks for {count} generations at once; this server runs at most "
                               f"{self.limit} at a time. Lower n or send fewer prompts.", param="n",
                               code="invalid_value")
            if self.in_flight + count > self.limit:
                self.metrics.refused("overloaded")
                raise APIError(f"The server is at capacity ({self.in_flight} of {self.limit} generations in "
                               f"flight); retry after {self.retry_after_s} s",
                               status=429, code="rate_limit_exceeded",
                               headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += count
        self.metrics.in_flight.set(self.in_flight)

    def release(self, count: int = 1) -> None:
        self.in_flight -= count
        self.metrics.in_flight.set(self.in_flight)
