"""Stop waiting for the engine when the HTTP client goes away.

A non-streaming request (and a streaming one before its first byte) waits for the engine without
sending anything, so a disconnect would go unnoticed until the end. `until_disconnected` races the
work against the ASGI `http.disconnect` message and cancels the work if the client leaves first;
cancelling it closes the engine streams, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read in full, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:  # cannot watch: just wait
            await asyncio.wait({task})
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let it clean up (abort its engine requests) before answering
    raise ClientDisconnected()
