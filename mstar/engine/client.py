"""What the HTTP server may ask of the engine: the whole interface between the two.

The engine core runs in its own thread; `generate` is an async iterator of `RequestOutput`
deltas, in position order. Leaving the iterator early (client gone, task cancelled) aborts the
request and frees everything it held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mstar.engine.outputs import RequestOutput
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    kda_slots_used: int
    kda_slots_total: int
    # Speculative decoding, cumulative since start (all zero without a draft).
    spec_verify_rows: int = 0  # verify rows run (each emits accepted drafts + 1 token)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_by_position: tuple[int, ...] = ()  # [i]: verify rows that proposed draft i+1
    spec_accepted_by_position: tuple[int, ...] = ()  # [i]: rows whose draft i+1 was accepted
    num_preemptions: int = 0  # requests preempted (their caches freed, to be recomputed), cumulative
    # Prefix caching, cumulative: tokens of admitted requests, and of those the tokens found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Model steps run on rank 0, cumulative: (shape, "graph" or "eager", steps), runner/model_runner.py step_shape
    model_steps: tuple[tuple[str, str, int], ...] = ()

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verify row (accepted drafts plus the correction or bonus token)."""
        if not self.spec_verify_rows:
            return 0.0
        return (self.spec_accepted_tokens + self.spec_verify_rows) / self.spec_verify_rows


class EngineClient(Protocol):
    tokenizer: KimiTokenizer
    model_name: str
    max_seq_len: int

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Validate (ParamError on bad input: prompt empty or longer than max_seq_len, ids outside
        the vocabulary, max_tokens past max_seq_len), enqueue, then yield deltas until finished."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (POST /reset_prefix_cache); requests running keep their pages."""
        ...

    @property
    def healthy(self) -> bool: ...
