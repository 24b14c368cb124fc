"""How many drafts to verify per request at a given batch size (TensorRT-LLM `draft_len_schedule`).

A schedule maps batch-size bounds to draft lengths, e.g. {16: 7, 32: 4, 64: 0}: the smallest key >= the
batch size gives the drafts, so batches of 1..16 draft 7, 17..32 draft 4, 33..64 draft 0, and anything
above the largest key drafts 0 (speculation off). An empty schedule drafts `speculative_tokens` at every
size. Larger batches draft less because each extra verify row costs real compute once decode stops being
memory-bound (dspark.md §5).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _as_int(value: object, what: str) -> int:
    """An int, or a decimal string (JSON object keys are always strings); bools are rejected."""
    if isinstance(value, bool):
        raise ValueError(f"draft schedule: {what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"draft schedule: {what} must be an integer, got {value!r}")


@dataclass(frozen=True)
class DraftSchedule:
    speculative_tokens: int  # drafts per request with an empty schedule; the most any entry may ask for
    max_batch_sizes: tuple[int, ...]  # ascending keys: the largest batch size each entry covers
    drafts: tuple[int, ...]  # drafts for the batch sizes up to the matching key

    @classmethod
    def from_config(cls, speculative_tokens: int,
                    schedule: Mapping[int, int] | Sequence[tuple[int, int]] | None = None) -> DraftSchedule:
        """Validate `{max_batch_size: drafts}` (or a sequence of such pairs) against `speculative_tokens`."""
        speculative_tokens = _as_int(speculative_tokens, "speculative_tokens")
        if speculative_tokens < 0:
            raise ValueError(f"draft schedule: speculative_tokens must be >= 0, got {speculative_tokens}")
        pairs = list(schedule.items()) if isinstance(schedule, Mapping) else list(schedule or ())
        entries: dict[int, int] = {}
        for pair in pairs:
            if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
                raise ValueError(f"draft schedule: each entry must be a (max_batch_size, drafts) pair, got {pair!r}")
            key = _as_int(pair[0], "a batch-size key")
            drafts = _as_int(pair[1], f"the drafts for batch size {key}")
            if key < 1:
                raise ValueError(f"draft schedule: batch-size key {key} must be >= 1")
            if not 0 <= drafts <= speculative_tokens:
                raise ValueError(f"draft schedule: drafts for batch size {key} must be in 0..{speculative_tokens} "
                                 f"(speculative_tokens), got {drafts}; raise speculative_tokens or lower the entry")
            if key in entries:
                raise ValueError(f"draft schedule: batch-size key {key} appears twice")
            entries[key] = drafts
        keys = tuple(sorted(entries))
        return cls(speculative_tokens, keys, tuple(entries[k] for k in keys))

    def drafts_for(self, batch_size: int) -> int:
        """Drafts per request for a batch of `batch_size` requests (>= 1)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"drafts_for: batch_size must be an integer >= 1, got {batch_size!r}")
        if not self.max_batch_sizes:
            return self.speculative_tokens
        index = bisect.bisect_left(self.max_batch_sizes, batch_size)  # the smallest key >= batch_size
        return self.drafts[index] if index < len(self.drafts) else 0

    def capture_buckets(self) -> tuple[int, ...]:
        """The distinct draft lengths any batch size can get, ascending (each needs its own CUDA graphs).

        A non-empty schedule always includes 0: batches above the largest key do not speculate.
        """
        if not self.max_batch_sizes:
            return (self.speculative_tokens,)
        return tuple(sorted({*self.drafts, 0}))

    @property
    def max_drafts(self) -> int:
        """The most drafts any batch size gets (sizes the verify buffers)."""
        return max(self.capture_buckets())
