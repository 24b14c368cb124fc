"""A request's life in the engine: its tokens, how many are cached, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engine.output_text import OutputText
from mstar.engine.outputs import PromptLogprob
from mstar.engine.params import SamplingParams

# A token that a step still in flight samples (async scheduling): its value is not on the host yet,
# so the next step that feeds it takes it on the device from that step's sampled tokens.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order: FCFS and the choice of preemption victim use it
    stop_ids: frozenset[int]
    text: OutputText
    generator: torch.Generator | None = None
    matcher: Any = None  # the grammar's llguidance matcher, advanced with each appended token
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV / state are in the caches
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    page_keys: list[bytes] = field(default_factory=list)  # content keys of its full pages of known tokens
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    aborted: bool = False
    prompt_reported: bool = False
    # prompt_logprobs: the entries of prompt tokens 1.. that reached the host, and the prompt positions
    # (0..len(prompt) - 2, each row's logits scoring the next token) whose rows a launched step computes
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    prompt_rows_launched: int = 0
    # Tokens sampled by launched steps that have not reached the host yet (async scheduling: at most
    # the step in flight's, plus the next one's while it is being launched). They follow output_ids.
    num_inflight: int = 0
    # Drafts of its newest launched verify block whose verdict (how many it keeps) has not reached the host:
    # num_computed counts that block's anchor row only, and a step planned meanwhile has rows that sit up to
    # this many positions further on (SeqStep.lag). 0: num_computed is exact.
    unresolved: int = 0
    last_launch: int = -1  # the number of the newest launched step with a row of it (core.py)
    # time.perf_counter() at its milestones, for the server's queue/prefill/decode time metrics
    queued_at: float = 0.0
    scheduled_at: float | None = None
    first_token_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + self.num_generated

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, in flight included."""
        return len(self.output_ids) + self.num_inflight

    @property
    def sampling_done(self) -> bool:
        """max_tokens are sampled: the request ends when the last of them reaches the host."""
        return self.num_generated >= self.params.max_tokens

    def token_at(self, i: int) -> int:
        """Token i of prompt + outputs; PLACEHOLDER for one still in flight."""
        n, m = len(self.prompt_ids), len(self.output_ids)
        if i < n:
            return self.prompt_ids[i]
        if i - n < m:
            return self.output_ids[i - n]
        if i < self.num_tokens:
            return PLACEHOLDER
        raise IndexError(f"token {i} of a request with {self.num_tokens} tokens")

    def pending_tokens(self) -> int:
        """Tokens to feed before the next sample: the prompt (and, after preemption, outputs) or 1."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.pending_tokens() == 1 and self.num_generated > 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
