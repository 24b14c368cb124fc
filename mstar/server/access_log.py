"""uvicorn's access log without query strings: a client may put a secret there (`?api_key=...`),
and the README promises keys are never logged. The path is logged, the query replaced by `?...`."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"


class DropQueryStrings(logging.Filter):
    """uvicorn logs `(client, method, path with query, http version, status)`; cut the path's query."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?...", *args[3:])
        return True


def install() -> None:
    """Add the filter to uvicorn's access logger (once, however often it is called)."""
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryStrings) for f in access.filters):
        access.addFilter(DropQueryStrings())
