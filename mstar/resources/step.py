"""One engine step as the scheduler declares it: which requests run and which tokens each feeds.

declare -> admit -> plan -> forward -> commit: the scheduler builds a `StepDecl`; every resource
admits it atomically or refuses (nothing is half-claimed); resources plan the step's addressing
(page tables, slot ids); the model runs; commit records only what ran.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class SeqStep:
    """One request's rows in a step: `token_ids` continue after `num_computed` cached tokens.

    A verify row (speculative decoding) feeds its anchor token followed by `num_drafts` drafted
    tokens, which the proposer fills in after admission; only the first `accepted` rows survive
    verification, and commit records just those.

    `lag` > 0: the request's verify block in the step still in flight (async scheduling) drafted
    `lag` tokens, of which it keeps a number 0..lag known only on the device, so these rows sit that
    many positions after `num_computed` (which counts the block's anchor row, always kept). The plan
    takes the shift on the device (`BatchPlan.advance`); admission reserves room for the most.
    """

    request_id: str
    num_computed: int
    token_ids: tuple[int, ...]
    sample: bool  # the last row's logits pick the next token (end of prompt, or decode)
    verify: bool = False  # a speculative decode row: rows stay pending until verification
    num_drafts: int = 0
    accepted: int | None = None  # rows kept after verification (None: all)
    # Content keys of cached pages a new request maps before its rows (prefix caching: its tokens start
    # with them, and num_computed == len(prefix) * page_size); the KDA state resumes from the snapshot
    # under the last key.
    prefix: tuple[bytes, ...] = ()
    lag: int = 0  # rows the step in flight may still add before these (see above)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_drafts

    @property
    def end(self) -> int:
        """Position after the last row this step feeds, at most (what the caches must have room for)."""
        return self.num_computed + self.lag + self.num_tokens

    @property
    def committed(self) -> int:
        return self.num_tokens if self.accepted is None else self.accepted

    @property
    def committed_end(self) -> int:
        return self.num_computed + self.committed


@dataclass(frozen=True)
class StepDecl:
    seqs: tuple[SeqStep, ...]

    @cached_property
    def seq_starts(self) -> tuple[int, ...]:
        """The row where each sequence's tokens start in the step's input, then the step's row count."""
        return tuple(itertools.accumulate((s.num_tokens for s in self.seqs), initial=0))

    @cached_property
    def rows_each(self) -> int | None:
        """The rows every sequence feeds when all feed the same number (equal verify blocks, or decode rows), else
        None: the step's rows are then [sequences, rows_each], and per-sequence gathers of them are views."""
        counts = {s.num_tokens for s in self.seqs}
        return counts.pop() if len(counts) == 1 else None

    @cached_property
    def block_drafts(self) -> int | None:
        """k when every sequence is a verify block of the same k >= 1 drafts (rows_each = 1 + k), else None: the
        steady speculative step, whose per-block gathers are views of its [B, 1 + k] rows."""
        ks = {s.num_drafts if s.verify else 0 for s in self.seqs}
        k = ks.pop() if len(ks) == 1 else 0
        return k if k and self.rows_each == 1 + k else None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.seqs if s.num_computed > 0 and (s.verify or s.num_tokens == 1))
