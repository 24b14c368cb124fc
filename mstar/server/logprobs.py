"""Engine logprobs (`TokenLogprob`) in OpenAI's two formats.

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict token -> logprob of
the top alternatives plus the chosen token, as vLLM does) and `text_offset` (each token's offset in
the generated text; special tokens, which the text leaves out, take no room).
Chat: `content` is one entry per generated token (thinking and markup tokens included) with the
token's UTF-8 `bytes` and its `top_logprobs` list.

A token that is part of a multi-byte character decodes to U+FFFD on its own; `bytes` keeps the
exact bytes. Logprobs are clamped to -9999.0 (OpenAI's floor) since JSON has no -Infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mstar.engine.outputs import TokenLogprob
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.server import responses

LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def _token_str(tokenizer: KimiTokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


class CompletionLogprobsBuilder:
    """Completions-format logprobs of successive deltas of one choice (keeps the running offset)."""

    def __init__(self, tokenizer: KimiTokenizer):
        self._tokenizer = tokenizer
        self._offset = 0

    def build(self, entries: Sequence[TokenLogprob]) -> responses.CompletionLogprobs:
        out = responses.CompletionLogprobs()
        for entry in entries:
            token = _token_str(self._tokenizer, entry.token_id)
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:
                top.setdefault(_token_str(self._tokenizer, token_id), _clamp(logprob))
            top.setdefault(token, _clamp(entry.logprob))
            out.tokens.append(token)
            out.token_logprobs.append(_clamp(entry.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self._offset)
            if not self._tokenizer.is_special(entry.token_id):
                self._offset += len(token)
        return out


def chat_logprobs(tokenizer: KimiTokenizer, entries: Sequence[TokenLogprob]) -> responses.ChatLogprobs:
    content = []
    for entry in entries:
        raw = tokenizer.token_bytes(entry.token_id)
        top = [
            responses.TopLogprob(token=_token_str(tokenizer, token_id), logprob=_clamp(logprob),
                                 bytes=list(tokenizer.token_bytes(token_id)))
            for token_id, logprob in entry.top
        ]
        content.append(
            responses.TokenLogprob(
                token=raw.decode("utf-8", errors="replace"),
                logprob=_clamp(entry.logprob),
                bytes=list(raw),
                top_logprobs=top,
            )
        )
    return responses.ChatLogprobs(content=content)
