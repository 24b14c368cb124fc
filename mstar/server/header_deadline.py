"""A deadline for a request's line and headers: uvicorn's h11 protocol with one more timer.

uvicorn times out a connection only while it idles between requests (keep-alive): a client that opens
a connection and sends nothing, or sends its request line and headers a byte at a time, holds the
connection (and a file descriptor) for as long as it likes. Here the request line and headers must
arrive whole within `header_timeout_s` of the connection opening, or of the first byte of the next
request on a kept-alive connection (nginx's `client_header_timeout`, Apache's `RequestReadTimeout
header=`); otherwise the client gets a 408 in OpenAI's error shape and the connection is closed. The
body has its own deadline (access.py). Using this class also pins uvicorn to h11, whose header size
limit (`h11_max_incomplete_event_size`) the server relies on.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps({"error": {"message": f"The request line and headers did not arrive within {timeout_s:g} s; "
                                            "send them at once", "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the header deadline (pass it as `uvicorn.Config(http=...)`)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    response = _timeout_response(header_timeout_s)

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head():  # the first bytes of a kept-alive connection's next request
                self._arm()
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _expired(self) -> None:
            self._header_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    return HeaderDeadlineProtocol
