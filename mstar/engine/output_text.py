"""A request's output text: incremental detokenization and stop strings.

Text is released only in whole UTF-8 characters, and never past a point where a stop string could
still begin: the last `len(longest stop) - 1` characters are held back until the next token shows
they are not a stop string's prefix (or the request ends). A stop string cuts the output before it.
"""

from __future__ import annotations

from mstar.models.kimi_k3.tokenizer import IncrementalDetokenizer, KimiTokenizer


class OutputText:
    def __init__(self, tokenizer: KimiTokenizer, stop: tuple[str, ...] = (), include_stop: bool = False):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._include_stop = include_stop
        self.text = ""
        self._sent = 0
        self.stopped_by: str | None = None

    def push(self, token_id: int, check_stops: bool = True) -> str:
        """Add a token; return the newly releasable text. Sets `stopped_by` when a stop string hits;
        with `check_stops` False (before min_tokens) a stop string passes as text."""
        self.text += self._detok.push(token_id)
        if self._stop and check_stops:
            hit = self._first_stop()
            if hit is not None:
                at, stop = hit
                self.stopped_by = stop
                self.text = self.text[: at + (len(stop) if self._include_stop else 0)]
                return self._release(len(self.text))
        return self._release(len(self.text) - self._hold)

    def finish(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        if self.stopped_by is None:
            self.text += self._detok.finish()
        return self._release(len(self.text))

    def _first_stop(self) -> tuple[int, str] | None:
        start = max(0, self._sent - self._hold)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
