"""Server-sent events framing, and a streaming response that always closes its body generator.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. An error after the
stream has started is sent as one `data: {"error": {...}}` event before `[DONE]` (the status line
has already gone out), which OpenAI's clients raise as an APIError.

Starlette stops a streaming response on disconnect either by cancelling it mid-await or by failing
the next `send`; in the second case the body generator is left suspended at its `yield`, and its
cleanup (which aborts the engine requests) would wait for the garbage collector. `SSEResponse`
closes it in every case, shielded from the cancellation that is tearing the response down.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mstar.server.errors import APIError, internal_error, log_unexpected

logger = logging.getLogger("mstar.server")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict, *, exclude: set[str] | None = None) -> bytes:
    """One `data:` event. `exclude` drops top-level fields (e.g. `usage` when it was not asked for)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps({k: v for k, v in payload.items() if not exclude or k not in exclude}, ensure_ascii=False)
    return b"data: " + body.encode("utf-8") + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, media_type=self.media_type, headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


async def sse_body(events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """`events`, then `[DONE]`. A failure mid-stream becomes an error event (then `[DONE]`); however
    the stream ends, `events` is closed and then `close` runs (which stops the engine requests)."""
    try:
        async for event in events:
            yield event
        yield SSE_DONE
    except APIError as err:
        yield sse_event(err.body())
        yield SSE_DONE
    except Exception as exc:
        yield sse_event(internal_error(log_unexpected(exc, "a streamed response")).body())
        yield SSE_DONE
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        await close()
