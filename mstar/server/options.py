"""What an operator sets about the HTTP front end: who may call it and how much one request may ask.

`mstar-serve` fills these from the config's `server:` section, `--api-key`/`MSTAR_API_KEY` and
`--log-requests`; `build_app` without options gets the defaults below (no keys, the same limits
as the config's defaults, no bound on requests in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.server.protocol import MAX_N


@dataclass(frozen=True)
class ServerOptions:
    api_keys: tuple[str, ...] = ()  # any one is accepted as `Authorization: Bearer <key>`; empty: open
    protect_health: bool = False  # /health needs a key as well (only when api_keys is set)
    protect_metrics: bool = False  # /metrics needs a key as well (only when api_keys is set)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies: 413
    max_n: int = 16  # choices per prompt
    max_tokens: int = 0  # cap on a request's max_tokens (and on the omitted default); 0: the context
    # Engine requests (one per choice) admitted at once; beyond: 429 with Retry-After. None: no bound.
    # mstar-serve sets it to scheduler.max_num_seqs + scheduler.max_waiting.
    max_in_flight: int | None = None
    retry_after_s: int = 1
    max_headers: int = 100  # more request headers: 431 (Apache's LimitRequestFields)
    max_url_bytes: int = 8 * 1024  # a longer path plus query: 414 (nginx's 8 KiB header buffer)
    body_timeout_s: float = 30.0  # the whole body must arrive within this long after the headers: else 408
    log_requests: bool = False  # log prompts and parameters of each request (never logged otherwise)

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in 1..{MAX_N}, got {self.max_n}")
        if self.max_tokens < 0 or self.max_body_bytes < 1 or self.retry_after_s < 1:
            raise ValueError("max_tokens must be >= 0, max_body_bytes and retry_after_s >= 1")
        if self.max_headers < 1 or self.max_url_bytes < 1:
            raise ValueError("max_headers and max_url_bytes must be >= 1")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {self.max_in_flight}")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys holds an empty key")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def cap_max_tokens(self, limit: int) -> int:
        """`limit` (the room the context leaves) under the operator's cap."""
        return min(limit, self.max_tokens) if self.max_tokens else limit
