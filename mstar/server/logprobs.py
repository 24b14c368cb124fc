"""Engine logprobs (`TokenLogprob`, `PromptLogprob`) in OpenAI's two formats and vLLM's prompt_logprobs.

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict token -> logprob of
the top alternatives plus the chosen token, as vLLM does) and `text_offset` (each token's offset in
the generated text; special tokens, which the text leaves out, take no room). With `echo` the prompt's
tokens come first (`CompletionLogprobsBuilder.prompt`): the first has no logprob (`None` in
`token_logprobs` and `top_logprobs`), every one takes room in the echoed text, and the generated
tokens' offsets continue after that text.
Chat: `content` is one entry per generated token (thinking and markup tokens included) with the
token's UTF-8 `bytes` and its `top_logprobs` list.
`prompt_logprobs` (vLLM's extension, both endpoints): one entry per prompt token, None for the first,
else {token id: {logprob, rank, decoded_token}} of the prompt's token and the top alternatives.

A token that is part of a multi-byte character decodes to U+FFFD on its own; `bytes` keeps the
exact bytes. Logprobs are clamped to -9999.0 (OpenAI's floor) since JSON has no -Infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mstar.engine.outputs import PromptLogprob, TokenLogprob
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.server import responses

LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def _token_str(tokenizer: KimiTokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


class CompletionLogprobsBuilder:
    """Completions-format logprobs of successive deltas of one choice (keeps the running offset)."""

    def __init__(self, tokenizer: KimiTokenizer, num_top: int):
        self._tokenizer = tokenizer
        self._num_top = num_top  # the request's `logprobs`: alternatives per token
        self._offset = 0

    def _top(self, entry: TokenLogprob | PromptLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for token_id, logprob in entry.top[: self._num_top]:
            top.setdefault(_token_str(self._tokenizer, token_id), _clamp(logprob))
        top.setdefault(_token_str(self._tokenizer, entry.token_id), _clamp(entry.logprob))
        return top

    def prompt(self, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob], echoed: str
               ) -> responses.CompletionLogprobs:
        """The echoed prompt's part (first of a choice): `entries` score prompt tokens 1..; `echoed` is the
        prompt's text as the choice returns it, after which the generated tokens' offsets continue."""
        out = responses.CompletionLogprobs()
        for i, token_id in enumerate(prompt_ids):
            token = _token_str(self._tokenizer, token_id)
            entry = entries[i - 1] if i else None
            out.tokens.append(token)
            out.token_logprobs.append(_clamp(entry.logprob) if entry is not None else None)
            out.top_logprobs.append(self._top(entry) if entry is not None else None)
            out.text_offset.append(self._offset)
            self._offset += len(token)
        self._offset = len(echoed)
        return out

    def build(self, entries: Sequence[TokenLogprob]) -> responses.CompletionLogprobs:
        out = responses.CompletionLogprobs()
        for entry in entries:
            token = _token_str(self._tokenizer, entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_clamp(entry.logprob))
            out.top_logprobs.append(self._top(entry))
            out.text_offset.append(self._offset)
            if not self._tokenizer.is_special(entry.token_id):
                self._offset += len(token)
        return out


def prompt_logprobs(tokenizer: KimiTokenizer, entries: Sequence[PromptLogprob]) -> responses.PromptLogprobs:
    """vLLM's `prompt_logprobs` of a prompt whose tokens 1.. `entries` score (module doc)."""
    out: responses.PromptLogprobs = [None]
    for entry in entries:
        scored = {str(entry.token_id): responses.PromptTokenLogprob(
            logprob=_clamp(entry.logprob), rank=entry.rank, decoded_token=_token_str(tokenizer, entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            scored.setdefault(str(token_id), responses.PromptTokenLogprob(
                logprob=_clamp(logprob), rank=rank, decoded_token=_token_str(tokenizer, token_id)))
        out.append(scored)
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
