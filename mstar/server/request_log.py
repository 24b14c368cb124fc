"""The per-request log line, written only when the operator asks for it (`--log-requests`).

Prompts are what clients most expect to stay private, so nothing else in the server logs them:
errors log tracebacks, never request bodies. With `log_requests`, each generation request logs its
id, endpoint, choices, sampling parameters and prompt (cut to `MAX_LOGGED_CHARS`) at INFO on the
`mstar.requests` logger.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("mstar.requests")
MAX_LOGGED_CHARS = 2000


def _cut(text: str) -> str:
    return text if len(text) <= MAX_LOGGED_CHARS else text[:MAX_LOGGED_CHARS] + f"... ({len(text)} chars)"


def log_request(enabled: bool, endpoint: str, request_id: str, prompt: Any, params: Any, n: int) -> None:
    if enabled:
        logger.info("%s %s: n=%d params=%s prompt=%s", endpoint, request_id, n, params, _cut(repr(prompt)))
