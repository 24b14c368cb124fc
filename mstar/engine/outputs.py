"""What the engine reports per request after each step: new tokens, text, logprobs, finish."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass
class RequestOutput:
    """The delta for one request since its last output. Deltas arrive in position order."""

    request_id: str
    new_token_ids: list[int]
    text: str  # newly decoded text (whole UTF-8 characters only; stop strings cut it)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    error: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)  # on the first delta only
