"""Generated ids -> `Segment`s for the K3 output parsers, kept in step with the engine's text.

Structure must come from the ids (only a real special token is markup), but stop strings are
applied by the engine to its text, and the engine holds text back while it might still be the
start of a stop string. So text segments are released only as far as the engine's text has gone:
the engine's text is the generated text without special tokens, and its length so far is the
budget of ordinary characters that may be released; a special token is released once all text
before it has been. When a stop string ends the request, what lies past the engine's text is
dropped; otherwise everything is released at the end.

Ordinary tokens are decoded per run (a run ends at a special token) with an incremental UTF-8
decoder, as `KimiTokenizer.decode_segments` decodes each run: an incomplete character is held
until its bytes arrive, and one cut off by a special token becomes U+FFFD.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Sequence

from mstar.models.kimi_k3.tokenizer import KimiTokenizer, Segment


class AlignedSegmenter:
    def __init__(self, tokenizer: KimiTokenizer):
        self._tokenizer = tokenizer
        self._decoder = None  # incremental UTF-8 decoder of the current run of ordinary tokens
        self._pending: deque[Segment] = deque()
        self._budget = 0  # characters of engine text not yet matched by released text

    def push(self, token_ids: Sequence[int], engine_text: str) -> list[Segment]:
        """Add one delta (its ids and the engine's text for it); return the segments now released."""
        for token_id in token_ids:
            if self._tokenizer.is_special(token_id):
                self._end_run()
                self._pending.append(Segment(self._tokenizer.special_names[token_id], control=True))
            else:
                if self._decoder is None:
                    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                text = self._decoder.decode(self._tokenizer.token_bytes(token_id))
                if text:
                    self._pending.append(Segment(text))
        self._budget += len(engine_text)
        return self._release(everything=False)

    def finish(self, cut_by_stop_string: bool) -> list[Segment]:
        """The request ended: release the rest, or (cut by a stop string) only what the engine's text covers."""
        self._end_run()
        released = self._release(everything=not cut_by_stop_string)
        self._pending.clear()
        return released

    def _end_run(self) -> None:
        if self._decoder is not None:
            tail = self._decoder.decode(b"", final=True)
            if tail:
                self._pending.append(Segment(tail))
            self._decoder = None

    def _release(self, everything: bool) -> list[Segment]:
        out: list[Segment] = []
        while self._pending:
            segment = self._pending[0]
            if segment.control or everything:
                out.append(self._pending.popleft())
                continue
            if self._budget <= 0:
                break
            if len(segment.text) <= self._budget:
                self._budget -= len(segment.text)
                out.append(self._pending.popleft())
            else:
                out.append(Segment(segment.text[: self._budget]))
                self._pending[0] = Segment(segment.text[self._budget :])
                self._budget = 0
                break
        return out
