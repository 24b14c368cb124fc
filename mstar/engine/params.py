"""Per-request generation parameters, validated once when a request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.engine.structured_output import Grammar

MAX_PENALTY = 2.0  # presence/frequency penalties: OpenAI's range is [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Temperatures below this are greedy (vLLM's epsilon): dividing logits by a smaller one only finds the
# argmax the hard way, and near fp32's smallest normals the quotient overflows.
GREEDY_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A request parameter out of range; the message names the parameter (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated. `temperature < GREEDY_TEMPERATURE` (0 included) means greedy
    (top-k/top-p/min-p ignored)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    min_p: float = 0.0
    seed: int | None = None  # same seed -> same tokens, whatever else shares the batch
    stop: tuple[str, ...] = ()  # stop strings: the text before the first one is returned
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids (the model's end-of-message id is always one)
    ignore_eos: bool = False  # do not stop on the model's stop ids (stop_token_ids still apply)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob plus the top k alternatives
    # None: none; k >= 0: each prompt token's logprob and rank given the tokens before it, plus the top k
    # alternatives there (the first token has none). Such a request bypasses the prefix cache (cached rows
    # have no logits).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Logits processing (engine/logits_processing.py), all off at these values. min_tokens: the stop ids
    # (and stop strings) do not end the request before it has this many tokens.
    min_tokens: int = 0
    presence_penalty: float = 0.0  # minus this on every token the output holds already
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or the output (vLLM's definition)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: Grammar | None = None  # structured outputs (engine/structured_output.py)
    # vLLM's cache_salt: cached prefixes are shared only among requests of the same salt (page_keys.root)
    cache_salt: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.top_k < 2**63, "top_k", "must be >= 0 (and fit in int64), or -1 for no limit"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be between 0 and 20"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "entries must be non-empty strings"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in 0..max_tokens ({self.max_tokens})"),
            (abs(self.presence_penalty) <= MAX_PENALTY, "presence_penalty",
             f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}]"),
            (abs(self.frequency_penalty) <= MAX_PENALTY, "frequency_penalty",
             f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}]"),
            (0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be > 0 (1: off)"),
            (all(abs(b) <= MAX_LOGIT_BIAS for _, b in self.logit_bias), "logit_bias",
             f"values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias", "names a token id twice"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ParamError(f"{name} {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def scores_prompt(self) -> bool:
        """The request asked for its prompt's logprobs: every prompt row's logits are computed (so no cached
        prefix can skip rows, and its chunks are capped: scheduler.PROMPT_SCORING_CHUNK)."""
        return self.prompt_logprobs is not None

    @property
    def processes_logits(self) -> bool:
        """The logits of this request's rows are changed before a token is chosen (greedy ones too)."""
        return self.min_tokens > 0 or self.penalized or bool(self.logit_bias)
