"""Per-request generation parameters, validated once when a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    include_stop_str_in_output: bool = False
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
            (all(isinstance(s, str) and s for s in self.stop), "stop", "entries must be non-empty strings"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ParamError(f"{name} {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
