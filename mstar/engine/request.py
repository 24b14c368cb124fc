"""A request's life in the engine: its tokens, how many are cached, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from mstar.engine.output_text import OutputText
from mstar.engine.params import SamplingParams


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
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV / state are in the caches
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    aborted: bool = False
    prompt_reported: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def pending_tokens(self) -> int:
        """Tokens to feed before the next sample: the prompt (and, after preemption, outputs) or 1."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.pending_tokens() == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
