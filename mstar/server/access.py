"""Who may call the server, and how large a request body may be: an ASGI middleware in front of
every route.

API keys: with keys configured, every route except `/openapi.json`, `/health`, `/ping` and `/metrics`
needs `Authorization: Bearer <key>` with one of them (so `/v1/*`, and unknown paths too, which then do
not reveal what exists); the health probes `/health` and `/ping` (open in vLLM too) and `/metrics`
need it as well when the operator protects them (`protect_health`, `protect_metrics`).
The given key is hashed and compared with every configured key's hash by `hmac.compare_digest`,
all of them each time, so the answer's timing says nothing about how much of a key was right, nor
which key matched. A refusal is a 401 in OpenAI's error shape; the key is never echoed or logged.

Body size: a declared `Content-Length` over the limit is refused (413) before anything is read; a
body sent without one (chunked) is counted as it is read, and reading past the limit raises the
same 413 inside the endpoint.

Request shape: more than `max_headers` headers is a 431, a path plus query longer than
`max_url_bytes` a 414, both before anything else (nginx and Apache refuse such requests too).

Body deadline: the whole body must arrive within `body_timeout_s` of the request reaching the app;
a client that trickles it (or stops sending) gets a 408 and its connection back, so it cannot hold
a connection for longer. (The header deadline, the header size limit, and a shutdown that answers
bodies still arriving at once are connection.py's.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mstar.server.errors import APIError, error_response
from mstar.server.metrics import ServerMetrics
from mstar.server.options import ServerOptions

OPEN_PATHS = frozenset({"/openapi.json"})


class BodyTimeout(APIError):
    def __init__(self, limit_s: float):
        super().__init__(f"The request body did not arrive within {limit_s:g} s; send it at once",
                         status=408, code="request_timeout")


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than this server's limit of {limit} bytes",
                         status=413, code="request_too_large")


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class AccessGuard:
    def __init__(self, app: ASGIApp, options: ServerOptions, metrics: ServerMetrics):
        self.app = app
        self.max_body_bytes = options.max_body_bytes
        self.body_timeout_s = options.body_timeout_s
        self.max_headers = options.max_headers
        self.max_url_bytes = options.max_url_bytes
        self.metrics = metrics
        self._digests = [_digest(key) for key in options.api_keys]
        open_paths = set(OPEN_PATHS)
        if not options.protect_health:
            open_paths |= {"/health", "/ping"}
        if not options.protect_metrics:
            open_paths.add("/metrics")
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check_shape(scope) or self._check_key(scope) or self._check_length(scope)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def key_matches(self, token: bytes) -> bool:
        given = _digest(token)
        matched = False
        for digest in self._digests:  # every key, every time: no early exit
            matched |= hmac.compare_digest(digest, given)
        return matched

    def _check_key(self, scope: Scope) -> APIError | None:
        if not self._digests or scope["path"] in self._open_paths:
            return None
        token = bearer_token(scope)
        if token is not None and self.key_matches(token):
            return None
        self.metrics.refused("unauthorized")
        if token is None:
            message = "You didn't provide an API key. Send it as an 'Authorization: Bearer <key>' header."
        else:
            message = "Incorrect API key provided."
        return APIError(message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_shape(self, scope: Scope) -> APIError | None:
        if len(scope.get("headers", ())) > self.max_headers:
            self.metrics.refused("too_many_headers")
            return APIError(f"The request has more than {self.max_headers} headers", status=431,
                            code="request_header_fields_too_large")
        url_bytes = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b""))
        if url_bytes > self.max_url_bytes:
            self.metrics.refused("uri_too_long")
            return APIError(f"The request's path and query are longer than {self.max_url_bytes} bytes", status=414,
                            code="uri_too_long")
        return None

    def _check_length(self, scope: Scope) -> APIError | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                self.metrics.refused("too_large")
                return BodyTooLarge(self.max_body_bytes)
        return None

    def _counted(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        body_done = False

        async def counted() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body only a disconnect can come: waiting for it is no body read
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                self.metrics.refused("body_timeout")
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > limit:
                    self.metrics.refused("too_large")
                    raise BodyTooLarge(limit)
            return message

        return counted
