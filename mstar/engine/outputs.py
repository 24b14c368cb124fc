"""What the engine reports per request after each step: new tokens, text, logprobs, finish."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it (`SamplingParams.prompt_logprobs`)."""

    token_id: int
    logprob: float
    rank: int  # how many tokens of the vocabulary are at least as likely there, itself included (vLLM's rank)
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass(frozen=True)
class RequestTimes:
    """When the engine saw a request's milestones (time.perf_counter() of the engine's process)."""

    queued: float  # added to the engine
    scheduled: float | None  # first scheduled into a step (None: never)
    first_token: float | None  # its first output token reached the host
    finished: float

    @property
    def queue_s(self) -> float:
        return (self.scheduled if self.scheduled is not None else self.finished) - self.queued

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token (vLLM's prefill time)."""
        return None if self.first_token is None or self.scheduled is None else self.first_token - self.scheduled

    @property
    def decode_s(self) -> float | None:
        """First token to the end (vLLM's decode time)."""
        return None if self.first_token is None else self.finished - self.first_token

    @property
    def inference_s(self) -> float | None:
        return None if self.scheduled is None else self.finished - self.scheduled


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
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    error: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)  # on the first delta only
    # On the first delta of a request that asked (SamplingParams.prompt_logprobs): prompt tokens 1.. in order
    prompt_logprobs: list[PromptLogprob] | None = field(default=None, repr=False)
    times: RequestTimes | None = None  # on the finishing delta
