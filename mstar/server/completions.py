"""POST /v1/completions.

`prompt` is a string, a list of token ids, a list of strings or a list of token-id lists. Several
prompts are supported: prompt p's n choices get indices p*n .. p*n+n-1 (OpenAI's order), each its
own engine request. `echo` puts the prompt's text before each choice's text (in the first chunk when
streaming); with `logprobs` the prompt's tokens lead the choice's logprobs too (the first with None),
scored by the engine (`prompt_logprobs`, which defaults to `logprobs` then, as in vLLM), and with
`max_tokens: 0` the prompt alone is returned (the engine samples one token, which is dropped: vLLM's
way). `prompt_logprobs` (vLLM's extension) gives each choice vLLM's `prompt_logprobs` list; it is a 400
with `stream`, as in vLLM (echo with logprobs streams: the prompt's part rides on the first chunk).
`suffix` and `best_of` other than n are refused (400). `truncate_prompt_tokens` keeps each prompt's
last N tokens. `response_format` constrains the text as on chat (server/structured_outputs.py), as vLLM
allows here too. `max_tokens` defaults to 16 (OpenAI's default), cut to the room the context leaves.
With `stream`, each engine delta of each choice becomes one chunk (choices interleave, each in
order); with `stream_options.include_usage`, a last chunk with no choices carries the usage, and with
`continuous_usage_stats` every chunk carries the usage so far.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from mstar.engine.outputs import RequestOutput
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.server import responses
from mstar.server.context import ServerContext
from mstar.server.disconnect import until_disconnected
from mstar.server.errors import APIError
from mstar.server.generation import ChoiceSpec, GenerationRun
from mstar.server.logprobs import CompletionLogprobsBuilder, prompt_logprobs
from mstar.server.protocol import CompletionRequest
from mstar.server.request_log import log_request
from mstar.server.sampling import (
    base_params,
    check_model,
    check_n,
    check_prompt_ids,
    check_stop_token_ids,
    check_supported,
    check_text_fits,
    choices_for_prompt,
    longest_prompt,
    new_request_id,
    prompt_too_long,
    resolve_max_tokens,
    truncate_prompt,
)
from mstar.server.streaming import SSEResponse, json_response, sse_body, sse_event
from mstar.server.tokenize_pool import TooManyTokens

DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 256  # prompts x n in one request


async def _prompts(req: CompletionRequest, ctx: ServerContext) -> list[list[int]]:
    """Each prompt's ids, truncated as `truncate_prompt_tokens` asks; text is tokenized off the event loop
    (ctx.tokenize), where text of more tokens than the context holds is refused without its ids."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        try:
            return await ctx.tokenize.encode(texts, keep=req.truncate_prompt_tokens, limit=longest_prompt(ctx.engine))
        except TooManyTokens as err:
            param = "prompt" if len(texts) == 1 else f"prompt[{err.index}]"
            raise prompt_too_long(err.count, ctx.engine, param) from None
    if not prompt:
        raise APIError("The prompt is empty; 'prompt' must hold at least one token", param="prompt")
    if isinstance(prompt[0], int):  # cut before the copy: a body may hold millions of ids
        return [list(truncate_prompt(prompt, req))]
    return [list(truncate_prompt(ids, req)) for ids in prompt]


def _echo_text(req: CompletionRequest, p: int, ids: list[int], tokenizer: KimiTokenizer) -> str:
    """Prompt p's text for `echo`: as sent when it was text and was not truncated, else its ids decoded."""
    if not req.echo:
        return ""
    text = req.prompt if isinstance(req.prompt, str) else req.prompt[p]
    if isinstance(text, str) and req.truncate_prompt_tokens is None:
        return text
    return tokenizer.decode(ids, skip_special=False)


def _check_supported(req: CompletionRequest) -> None:
    check_supported(req)
    if req.suffix:
        raise APIError("suffix is not supported; omit it", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported; omit it or set it equal to n", param="best_of", code="unsupported")


def _echo_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt is the whole choice."""
    return req.echo and req.max_tokens == 0


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """What the engine scores the prompt with: `prompt_logprobs`, or with echo `logprobs` (vLLM's default)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


def _extend(logprobs: responses.CompletionLogprobs, more: responses.CompletionLogprobs) -> None:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(logprobs, name).extend(getattr(more, name))


class _ChoiceOutput:
    """One choice's output: per-delta chunks for streaming, merged for a whole response."""

    def __init__(self, spec: ChoiceSpec, tokenizer: KimiTokenizer, req: CompletionRequest, echo: str):
        self.spec = spec
        self._tokenizer = tokenizer
        self._echo = echo  # the prompt's text when `echo`, else ""
        self._echo_only = _echo_only(req)
        self._echo_logprobs = req.echo and req.logprobs is not None
        self._logprobs = CompletionLogprobsBuilder(tokenizer, req.logprobs) if req.logprobs is not None else None
        self._token_ids = req.return_token_ids
        self._sent_first = False
        self.text: list[str] = [echo]
        self.token_ids: list[int] = []
        self.logprobs = responses.CompletionLogprobs() if self._logprobs else None
        self.prompt_logprobs: responses.PromptLogprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, out: RequestOutput) -> responses.CompletionChoice | None:
        """Record a delta; return it as a streaming chunk's choice, or None if it carries nothing to send."""
        if self._echo_only:  # the one token the engine sampled is not part of the choice
            out = dataclasses.replace(out, new_token_ids=[], text="", logprobs=None)
        self.text.append(out.text)
        self.token_ids.extend(out.new_token_ids)
        logprobs = None
        if self._logprobs is not None:
            logprobs = responses.CompletionLogprobs()
            if self._echo_logprobs and out.prompt_logprobs is not None:  # the first delta: the prompt leads
                _extend(logprobs, self._logprobs.prompt(self.spec.prompt_ids, out.prompt_logprobs, self._echo))
            _extend(logprobs, self._logprobs.build(out.logprobs or ()))
            _extend(self.logprobs, logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(self._tokenizer, out.prompt_logprobs)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        first = not self._sent_first
        if not (out.text or out.finished or first or (out.new_token_ids and (logprobs or self._token_ids))):
            return None
        self._sent_first = True
        return responses.CompletionChoice(
            index=self.spec.index,
            text=self._echo + out.text if first else out.text,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_token_ids=self.spec.prompt_ids if self._token_ids and first else None,
            token_ids=list(out.new_token_ids) if self._token_ids else None,
        )

    def whole(self) -> responses.CompletionChoice:
        return responses.CompletionChoice(
            index=self.spec.index,
            text="".join(self.text),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.spec.prompt_ids if self._token_ids else None,
            token_ids=self.token_ids if self._token_ids else None,
        )


async def create_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.perf_counter()
    created = int(time.time())
    req = await ctx.tokenize.parse(await request.body(), CompletionRequest)  # a large body: in a worker
    check_model(req.model, ctx.served_model_name)
    check_n(req.n, ctx.options.max_n)
    _check_supported(req)
    engine = ctx.engine
    sent = req.prompt
    texts = [sent] if isinstance(sent, str) else sent if sent and isinstance(sent[0], str) else []
    for p, text in enumerate(texts):  # (not a loop over the ids of a prompt of ids: there may be millions)
        check_text_fits(len(text), engine, "prompt" if isinstance(req.prompt, str) else f"prompt[{p}]",
                        truncated=req.truncate_prompt_tokens is not None)
    prompts = await _prompts(req, ctx)
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices per request", param="n")
    for p, ids in enumerate(prompts):
        check_prompt_ids(ids, engine, "prompt" if len(prompts) == 1 else f"prompt[{p}]")
    check_stop_token_ids(req.stop_token_ids, engine)
    params = base_params(req, req.logprobs, engine, prompt_logprobs=_prompt_logprobs(req))
    request_id = new_request_id("cmpl")
    specs: list[ChoiceSpec] = []
    for p, ids in enumerate(prompts):
        max_tokens = 1 if _echo_only(req) else resolve_max_tokens(req.max_tokens, len(ids), engine.max_seq_len,
                                                                   DEFAULT_MAX_TOKENS, "max_tokens",
                                                                   ctx.options.max_tokens)
        specs += choices_for_prompt(request_id, p * req.n, ids, params, req.n, max_tokens, req.min_tokens)
    log_request(ctx.options.log_requests, "/v1/completions", request_id, req.prompt, specs[0].params, req.n)

    run = GenerationRun(engine, specs, ctx.metrics, arrival, ctx.admission)
    echoes = [_echo_text(req, p, ids, engine.tokenizer) for p, ids in enumerate(prompts)]
    outputs = [_ChoiceOutput(spec, engine.tokenizer, req, echoes[spec.index // req.n]) for spec in specs]
    prompt_tokens = sum(len(ids) for ids in prompts)

    def completion(choices: list[responses.CompletionChoice], usage: responses.Usage | None) -> responses.Completion:
        return responses.Completion(id=request_id, created=created, model=ctx.served_model_name, choices=choices,
                                    usage=usage)

    def usage() -> responses.Usage:
        # each prompt's cached tokens as its first choice found them (the prompt counts once, as in prompt_tokens)
        cached = sum(run.num_cached_tokens(p * req.n) for p in range(len(prompts)))
        return responses.Usage.of(prompt_tokens, sum(len(o.token_ids) for o in outputs), cached)

    if req.stream:
        await until_disconnected(request, run.start())
        return SSEResponse(sse_body(_chunks(run, outputs, completion, usage, req), run.close))

    async def generate() -> responses.Completion:
        await run.start()
        async for index, out in run.outputs():
            outputs[index].add(out)
        return completion([o.whole() for o in outputs], usage())

    result = await until_disconnected(request, generate())
    return json_response(result)


async def _chunks(run: GenerationRun, outputs: list[_ChoiceOutput], completion, usage, req: CompletionRequest
                  ) -> AsyncIterator[bytes]:
    exclude = None if req.include_usage or req.continuous_usage else {"usage"}
    async for index, out in run.outputs():
        choice = outputs[index].add(out)
        if choice is not None:
            yield sse_event(completion([choice], usage() if req.continuous_usage else None), exclude=exclude)
    if req.include_usage:
        yield sse_event(completion([], usage()))
