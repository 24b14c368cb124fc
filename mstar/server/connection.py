"""What one HTTP connection may do: uvicorn's h11 protocol with a deadline and a size limit for a
request's line and headers, and a graceful shutdown that does not wait for bodies still arriving.

uvicorn times out a connection only while it idles between requests (keep-alive): a client that opens
a connection and sends nothing, or sends its request line and headers a byte at a time, holds the
connection (and a file descriptor) for as long as it likes. Here the request line and headers must
arrive whole within `header_timeout_s` of the connection opening, or of the first byte of the next
request on a kept-alive connection (nginx's `client_header_timeout`, Apache's `RequestReadTimeout
header=`); otherwise the client gets a 408 in OpenAI's error shape and the connection is closed. The
body has its own deadline (access.py).

Size: a request line and headers longer than `h11_max_incomplete_event_size` bytes (mstar-serve sets
it from `server.max_header_bytes`) are a 431 in the same shape, and the connection is closed. h11's own
check of that limit is not enough: it applies only while a head is incomplete, so a head that arrives
in one read is parsed whatever its size, and uvicorn answers what it does refuse with a plain-text 400.

Shutdown: uvicorn's graceful shutdown (SIGTERM) waits for every request the app holds, and the app
holds a request from its head on, while it reads the body. A request whose body is still arriving has
not been admitted to the engine, and a client trickling it would hold the exit until the body deadline
(`server.body_timeout_s`); so such a request gets a 503 `server_shutting_down` at once and its
connection is closed (the endpoint then sees a disconnect). Requests whose bodies arrived drain.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _closing_response(status: str, message: str, code: str) -> bytes:
    """A whole response in OpenAI's error shape, written straight to the transport, which is then closed."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


SHUTTING_DOWN = _closing_response("503 Service Unavailable", "The server is shutting down and did not read "
                                  "this request's body; retry on another server", "server_shutting_down")


def connection_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the header deadline, the size limit and the shutdown (pass it as
    `uvicorn.Config(http=...)`, with the limit as `h11_max_incomplete_event_size`)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    timeout_response = _closing_response("408 Request Timeout", f"The request line and headers did not arrive "
                                         f"within {header_timeout_s:g} s; send them at once", "request_timeout")

    class ConnectionProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # received since the awaited head began: an upper bound on its size

        def _awaiting_head(self) -> bool:
            # h11 leaves IDLE once a request's head is parsed, and comes back only once both that request and
            # its response are done: bytes of a body that arrive after an early answer (a 413) are no head
            return self.conn.their_state is h11.IDLE

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            self._head_bytes = 0
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _head_too_large(self, data: bytes, limit: int) -> bool:
            self._head_bytes += len(data)
            if self._head_bytes <= limit:  # the common case, decided without copying h11's buffer
                return False
            pending = self.conn.trailing_data[0] + data  # from the head's first byte (a body may follow it)
            end = pending.find(b"\r\n\r\n")
            return (end if end >= 0 else len(pending)) > limit

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head():  # a head, perhaps a kept-alive connection's next one
                self._arm()
                limit = self.config.h11_max_incomplete_event_size
                if self._head_too_large(data, limit):
                    self._refuse(_closing_response("431 Request Header Fields Too Large", "The request line and "
                                                   f"headers are longer than this server's limit of {limit} bytes",
                                                   "request_header_fields_too_large"))
                    return
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _expired(self) -> None:
            self._header_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                self._refuse(timeout_response)

        def shutdown(self) -> None:
            cycle = self.cycle  # uvicorn's request: whether its body is complete, and its response begun
            if cycle is not None and cycle.more_body and not cycle.response_started and not cycle.disconnected:
                self._refuse(SHUTTING_DOWN)
                return
            super().shutdown()

        def _refuse(self, response: bytes) -> None:
            self._disarm()
            self.transport.write(response)
            self.transport.close()

    return ConnectionProtocol
