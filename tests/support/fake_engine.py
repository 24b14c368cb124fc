"""A deterministic stand-in for the engine (`EngineClient`), for the HTTP server's tests.

It "generates" a continuation that is a function of the prompt ids and the seed (seed 0 when greedy,
a random one when unseeded), on top of the real (tiny, trained) K3 tokenizer, emitting
`tokens_per_delta` ids per delta after an `asyncio.sleep`. It honours max_tokens, stop ids (the
tokenizer's, unless ignore_eos, and stop_token_ids), stop strings (held back and cut as the engine
does, on text decoded with `IncrementalDetokenizer(skip_special=True)`), and logprobs.

What it generates depends on the prompt:
- a chat prompt (ending in K3's generation prompt) gets a K3 assistant turn: reasoning, the think
  close, a response, and per directive in the last user message a tools section:
  `[[tool]]` two valid calls, `[[badtool]]` a malformed section, `[[spelled]]` a response that spells
  markup as plain text, `[[stray]]` text between the channels;
- any other prompt gets words, then `<|end_of_msg|>`;
- after the script, with ignore_eos, words forever (until max_tokens);
- `[[slow]]` anywhere in the prompt: 10 ms per token; `[[late]]`: 5 s before the first token (a long
  queue); `[[engine-error]]`: the request fails
  (finish_reason "error") at its fifth token; `[[crash]]`: `generate` raises a RuntimeError (a bug).

`active` holds the ids of requests being generated: leaving the iterator early (or `abort`) ends the
request and records it in `aborted`, as the real `EngineClient.generate` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from mstar.engine.client import EngineStats
from mstar.engine.outputs import RequestOutput, TokenLogprob
from mstar.engine.params import ParamError, SamplingParams
from mstar.models.kimi_k3.chat import generation_prompt
from mstar.models.kimi_k3.tokenizer import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    IncrementalDetokenizer,
    KimiTokenizer,
    Segment,
)
from mstar.tools.train_bpe import train_tiny_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "naïve", "café", "日本語", "😀", "data", "value",
         "return", "import", "light", "seven", "forty", "über", "token"]
SLOW_DELAY = 0.01
LATE_DELAY = 5.0

_TOKENIZERS: dict[str, KimiTokenizer] = {}


def shared_tokenizer(tmp_path_factory) -> KimiTokenizer:
    """The tiny trained K3 tokenizer, trained once per test session."""
    if "tiny" not in _TOKENIZERS:
        directory = train_tiny_tokenizer(Path(tmp_path_factory.mktemp("server_tok")), num_ranks=1024)
        _TOKENIZERS["tiny"] = KimiTokenizer.from_dir(directory)
    return _TOKENIZERS["tiny"]


@dataclass(frozen=True)
class FakeCall:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def _open(tag: str) -> list[Segment]:
    return [Segment(OPEN, control=True), Segment(tag), Segment(SEP, control=True)]


def _close(tag: str) -> list[Segment]:
    return [Segment(CLOSE, control=True), Segment(tag), Segment(SEP, control=True)]


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


VALID_TOOLS = (
    _open("tools")
    + _open('call tool="get_weather" index="1"')
    + _open('argument key="city" type="string"') + [Segment("Paris")] + _close("argument")
    + _open('argument key="days" type="number"') + [Segment("3")] + _close("argument")
    + _close("call")
    + _open('call tool="get_time" index="2"')
    + _open('argument key="tz" type="string"') + [Segment("UTC")] + _close("argument")
    + _close("call")
    + _close("tools")
)
MALFORMED_TOOLS = _open("tools") + _open('call index="1"') + [Segment("oops")] + _close("call") + _close("tools")
EXPECTED_TOOL_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]


class FakeEngine:
    def __init__(self, tokenizer: KimiTokenizer, *, max_seq_len: int = 1024, model_name: str = "fake-k3",
                 tokens_per_delta: int = 1):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self.tokens_per_delta = tokens_per_delta
        self.is_healthy = True
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.calls: list[FakeCall] = []
        self.prefix_cache_resets = 0
        self._abort_requested: set[str] = set()
        self._think_prompt = tokenizer.encode_segments(generation_prompt(thinking=True))
        self._response_prompt = tokenizer.encode_segments(generation_prompt(thinking=False))

    @property
    def healthy(self) -> bool:
        return self.is_healthy

    def stats(self) -> EngineStats:
        running = len(self.active)
        return EngineStats(running=running, waiting=0, kv_pages_used=2 * running, kv_pages_total=64,
                           kda_slots_used=running, kda_slots_total=16)

    async def abort(self, request_id: str) -> None:
        self._abort_requested.add(request_id)

    async def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    # ---- what to generate ----------------------------------------------------------------------

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.active:
            raise RuntimeError(f"duplicate request id {request_id}")  # a server bug, not a bad request
        if not prompt_ids:
            raise ParamError("prompt is empty")
        if len(prompt_ids) > self.max_seq_len:
            raise ParamError(f"prompt is {len(prompt_ids)} tokens, longer than max_seq_len {self.max_seq_len}")
        if any(not 0 <= i < self.tokenizer.vocab_size for i in prompt_ids):
            raise ParamError("prompt holds ids outside the vocabulary")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise ParamError(f"max_tokens {params.max_tokens} with the prompt exceeds max_seq_len {self.max_seq_len}")
        if params.top_k > self.tokenizer.vocab_size:
            raise ParamError(f"top_k must be <= the vocabulary size {self.tokenizer.vocab_size}, got {params.top_k}")

    def script(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """The ids this engine generates for the prompt (endless: words follow the script)."""
        seed = params.seed if params.seed is not None else random.getrandbits(48)
        seed = 0 if params.greedy else seed
        digest = hashlib.sha256(repr((seed, prompt_ids)).encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        prompt_text = self.tokenizer.decode(prompt_ids)
        directive_text = prompt_text.rsplit('role="user"', 1)[-1]
        if prompt_ids[-len(self._think_prompt):] == self._think_prompt:
            segments = self._chat_turn(rng, directive_text, thinking=True)
        elif prompt_ids[-len(self._response_prompt):] == self._response_prompt:
            segments = self._chat_turn(rng, directive_text, thinking=False)
        else:
            segments = [Segment(" " + _words(rng, 10, 30)), Segment(END_OF_MSG, control=True)]
        yield from self.tokenizer.encode_segments(segments)
        while True:
            yield from self.tokenizer.encode(" " + rng.choice(WORDS))

    @staticmethod
    def _chat_turn(rng: random.Random, directive: str, thinking: bool) -> list[Segment]:
        segments: list[Segment] = []
        if thinking:
            segments += [Segment("I think about " + _words(rng, 3, 8) + ".")] + _close("think")
            if "[[stray]]" in directive:
                segments += [Segment("\n")] + [Segment("stray words")]
            segments += _open("response")
        answer = "Answer: " + _words(rng, 4, 12)
        if "[[spelled]]" in directive:
            answer += " <|open|>tools<|sep|> and <|close|>response<|sep|> as text"
        segments += [Segment(answer)] + _close("response")
        if "[[tool]]" in directive:
            segments += VALID_TOOLS
        elif "[[badtool]]" in directive:
            segments += MALFORMED_TOOLS
        return segments + _close("message") + [Segment(END_OF_MSG, control=True)]

    # ---- generation ----------------------------------------------------------------------------

    def _logprob(self, token_id: int, position: int, k: int) -> TokenLogprob:
        logprob = -((token_id * 7919 + position) % 50) / 10 - 0.01
        top = [(token_id, logprob)] + [((token_id + 1 + j) % self.tokenizer.num_ranks, logprob - 0.1 * (j + 1))
                                       for j in range(k)]
        return TokenLogprob(token_id, logprob, tuple(top[:k]))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        self._validate(request_id, prompt_ids, params)
        if "[[crash]]" in self.tokenizer.decode(prompt_ids):
            raise RuntimeError("simulated engine bug: secret internal detail")
        self.calls.append(FakeCall(request_id, list(prompt_ids), params))
        self.active.add(request_id)
        prompt_text = self.tokenizer.decode(prompt_ids)
        delay = SLOW_DELAY if "[[slow]]" in prompt_text else 0.0
        first_delay = LATE_DELAY if "[[late]]" in prompt_text else delay
        fail = "[[engine-error]]" in prompt_text
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.stop_ids))
        hold = max((len(s) for s in params.stop), default=1) - 1
        detok = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        text, sent = "", 0
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        first = True
        done = False
        try:
            for count, token in enumerate(self.script(prompt_ids, params), start=1):
                await asyncio.sleep(first_delay if count == 1 else delay)
                ids.append(token)
                if params.logprobs is not None:
                    logprobs.append(self._logprob(token, count, params.logprobs))
                finish, reason, error = None, None, None
                if token in stop_ids:
                    finish, reason = "stop", token
                else:
                    text += detok.push(token)
                    hits = [(at, s) for s in params.stop if (at := text.find(s, sent)) >= 0]
                    if hits:
                        at, stop = min(hits)
                        text = text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                        finish, reason = "stop", stop
                if finish is None and count >= params.max_tokens:
                    finish = "length"
                if finish is None and request_id in self._abort_requested:
                    finish = "abort"
                if finish is None and fail and count == 5:
                    finish, error = "error", "simulated engine failure"
                if finish is not None and not isinstance(reason, str):
                    text += detok.finish()
                end = len(text) if finish else max(sent, len(text) - hold)
                if finish is None and len(ids) < self.tokens_per_delta:
                    continue
                out = RequestOutput(
                    request_id=request_id, new_token_ids=ids, text=text[sent:end],
                    logprobs=logprobs if params.logprobs is not None else None,
                    finished=finish is not None, finish_reason=finish, stop_reason=reason,
                    num_prompt_tokens=len(prompt_ids), num_output_tokens=count, error=error,
                    prompt_token_ids=list(prompt_ids) if first else None,
                )
                sent, ids, logprobs, first = end, [], [], False
                done = finish is not None
                yield out
                if done:
                    return
        finally:
            self.active.discard(request_id)
            self._abort_requested.discard(request_id)
            (self.finished if done else self.aborted).append(request_id)


# ---- shared by the server tests ----------------------------------------------------------------


def sse(text: str) -> list:
    """The events of an SSE body: parsed JSON objects, and the final "[DONE]"."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
