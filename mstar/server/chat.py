"""POST /v1/chat/completions.

The prompt is `encode_chat(tokenizer, messages, tools, thinking=...)` (`chat_template_kwargs`:
`thinking`, default true as in K3, and `thinking_effort`). The generated turn is split into
`reasoning_content` (the think channel), `content` and `tool_calls` (K3's tools section, parsed by
`parse_assistant_output`; a malformed section is given back as text in `content`). With tool calls
and a natural stop, `finish_reason` is "tool_calls"; a turn cut by max_tokens stays "length".

A named `tool_choice` ({"type": "function", "function": {"name": N}}) is rendered as K3's
`tool_choice=required` note with only tool N declared; nothing forces the model's output.
`max_completion_tokens` (or the older `max_tokens`) defaults to all the room the context leaves.

Streaming: one role chunk per choice, then for each engine delta the chunks of the text it released
(`reasoning_content` while in the think channel, `content` after; a delta that crosses the boundary
gives one chunk per field, in order), tool calls as one `tool_calls` chunk when their section
closes, and a last chunk per choice with an empty delta and its `finish_reason`. Logprobs and
`token_ids` of a delta ride on its first chunk (an empty-delta chunk if its tokens were markup).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mstar.engine.outputs import RequestOutput
from mstar.engine.params import ParamError
from mstar.models.kimi_k3.chat import THINKING_EFFORTS, encode_chat, parse_assistant_output
from mstar.models.kimi_k3.tokenizer import KimiTokenizer, Segment
from mstar.server import responses
from mstar.server.assistant_stream import AssistantStreamParser, Piece
from mstar.server.context import ServerContext
from mstar.server.disconnect import until_disconnected
from mstar.server.errors import APIError, from_param_error
from mstar.server.generation import ChoiceSpec, GenerationRun
from mstar.server.logprobs import chat_logprobs
from mstar.server.output_segments import AlignedSegmenter, merge_text
from mstar.server.protocol import ChatCompletionRequest, NamedToolChoice, parse_request
from mstar.server.request_log import log_request
from mstar.server.sampling import (
    base_params,
    check_model,
    check_n,
    check_prompt_ids,
    check_stop_token_ids,
    check_supported,
    choices_for_prompt,
    new_request_id,
    resolve_max_tokens,
)
from mstar.server.streaming import SSEResponse, json_response, sse_body, sse_event


def _tools_and_choice(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, str | None]:
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools or () if tool["function"]["name"] == choice.function.name]
        if not named:
            raise APIError(
                f"tool_choice names the function '{choice.function.name}', which is not declared in 'tools'",
                param="tool_choice",
            )
        return named, "required"
    if choice == "required" and not tools:
        raise APIError("tool_choice 'required' needs at least one tool in 'tools'", param="tool_choice")
    return tools, choice


def _prompt_ids(req: ChatCompletionRequest, tokenizer: KimiTokenizer) -> list[int]:
    if not req.messages:
        raise APIError("'messages' must hold at least one message", param="messages")
    options: dict[str, Any] = {"thinking": req.thinking}
    kwargs = req.chat_template_kwargs
    if kwargs is not None and kwargs.thinking_effort is not None:
        if kwargs.thinking_effort not in THINKING_EFFORTS:
            raise APIError(
                f"thinking_effort={kwargs.thinking_effort!r} is not supported; use one of {THINKING_EFFORTS}",
                param="chat_template_kwargs.thinking_effort",
            )
        options["thinking_effort"] = kwargs.thinking_effort
    tools, options["tool_choice"] = _tools_and_choice(req)
    if req.response_format is not None:
        options["response_format"] = req.response_format.model_dump()
    messages = [message.for_template() for message in req.messages]
    try:
        return encode_chat(tokenizer, messages, tools, **options)
    except (ValueError, TypeError, KeyError) as err:
        raise APIError(f"The messages cannot be rendered for K3: {err}", param="messages") from None


# Engine parameter names -> this endpoint's request fields, for the `param` of a 400.
_ENGINE_NAMES = {"logprobs": "top_logprobs", "prompt": "messages"}


def _cut_by_stop_string(out: RequestOutput) -> bool:
    return out.finish_reason == "stop" and isinstance(out.stop_reason, str)


def _tool_call(call: dict[str, Any]) -> responses.ToolCall:
    function = call["function"]
    return responses.ToolCall(
        id=call["id"], function=responses.FunctionCall(name=function["name"], arguments=function["arguments"])
    )


class _ChoiceOutput:
    """One choice's generated turn: per-delta chunks (streaming) or the parsed whole."""

    def __init__(self, spec: ChoiceSpec, tokenizer: KimiTokenizer, req: ChatCompletionRequest):
        self.spec = spec
        self._tokenizer = tokenizer
        self._thinking = req.thinking
        self._want_logprobs = req.logprobs
        self._want_token_ids = req.return_token_ids
        self._segmenter = AlignedSegmenter(tokenizer)
        self._parser = AssistantStreamParser(req.thinking) if req.stream else None
        self._segments: list[Segment] = []
        self._tool_calls_sent = 0
        self.token_ids: list[int] = []
        self._logprobs: list = []
        self._finished: RequestOutput | None = None

    def _finish_reason(self, has_tool_calls: bool) -> str | None:
        out = self._finished
        if out is None:
            return None
        return "tool_calls" if has_tool_calls and out.finish_reason == "stop" else out.finish_reason

    def _released(self, out: RequestOutput) -> list[Segment]:
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self._logprobs.extend(out.logprobs)
        segments = self._segmenter.push(out.new_token_ids, out.text)
        if out.finished:
            self._finished = out
            segments += self._segmenter.finish(cut_by_stop_string=_cut_by_stop_string(out))
        return segments

    # ---- streaming ----

    def role_chunk(self) -> responses.ChatChunkChoice:
        return responses.ChatChunkChoice(index=self.spec.index, delta=responses.ChatDelta(role="assistant", content=""))

    def add(self, out: RequestOutput) -> list[responses.ChatChunkChoice]:
        pieces = self._parser.push(self._released(out))
        if out.finished:
            pieces += self._parser.finish()
        chunks = [responses.ChatChunkChoice(index=self.spec.index, delta=self._delta(piece)) for piece in pieces]
        logprobs = chat_logprobs(self._tokenizer, out.logprobs) if self._want_logprobs and out.logprobs else None
        token_ids = list(out.new_token_ids) if self._want_token_ids and out.new_token_ids else None
        if logprobs is not None or token_ids is not None:
            if not chunks:
                chunks.append(responses.ChatChunkChoice(index=self.spec.index, delta=responses.ChatDelta()))
            chunks[0].logprobs, chunks[0].token_ids = logprobs, token_ids
        if out.finished:
            chunks.append(
                responses.ChatChunkChoice(
                    index=self.spec.index,
                    delta=responses.ChatDelta(),
                    finish_reason=self._finish_reason(self._tool_calls_sent > 0),
                    stop_reason=out.stop_reason,
                )
            )
        return chunks

    def _delta(self, piece: Piece) -> responses.ChatDelta:
        if piece.kind == "reasoning":
            return responses.ChatDelta(reasoning_content=piece.value)
        if piece.kind == "content":
            return responses.ChatDelta(content=piece.value)
        calls = []
        for call in piece.value:
            call = _tool_call(call)
            calls.append(responses.ToolCallDelta(index=self._tool_calls_sent, id=call.id, function=call.function))
            self._tool_calls_sent += 1
        return responses.ChatDelta(tool_calls=calls)

    # ---- whole response ----

    def add_whole(self, out: RequestOutput) -> None:
        self._segments += self._released(out)

    def whole(self) -> responses.ChatChoice:
        parsed = parse_assistant_output(merge_text(self._segments), thinking=self._thinking)
        tool_calls = [_tool_call(call) for call in parsed.tool_calls]
        content = parsed.content if parsed.content is not None or tool_calls else ""
        message = responses.AssistantMessage(
            content=content, reasoning_content=parsed.reasoning_content, tool_calls=tool_calls or None
        )
        logprobs = chat_logprobs(self._tokenizer, self._logprobs) if self._want_logprobs else None
        return responses.ChatChoice(
            index=self.spec.index,
            message=message,
            logprobs=logprobs,
            finish_reason=self._finish_reason(bool(tool_calls)),
            stop_reason=self._finished.stop_reason if self._finished else None,
            token_ids=self.token_ids if self._want_token_ids else None,
        )


async def create_chat_completion(request: Request, ctx: ServerContext) -> Response:
    try:
        return await _create(request, ctx)
    except ParamError as err:  # from the engine's own validation: name this endpoint's field
        raise from_param_error(err, _ENGINE_NAMES) from None


async def _create(request: Request, ctx: ServerContext) -> Response:
    arrival = time.perf_counter()
    created = int(time.time())
    req = parse_request(await request.body(), ChatCompletionRequest)
    check_model(req.model, ctx.served_model_name)
    check_n(req.n, ctx.options.max_n)
    check_supported(req)
    engine = ctx.engine
    # Off the event loop: rendering and tokenizing a large conversation would stall other clients' streams.
    prompt_ids = await asyncio.to_thread(_prompt_ids, req, engine.tokenizer)
    check_prompt_ids(prompt_ids, engine, "messages")
    check_stop_token_ids(req.stop_token_ids, engine)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = base_params(req, logprobs, renames=_ENGINE_NAMES)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt_ids), engine.max_seq_len, None, max_param,
                                    ctx.options.max_tokens)
    request_id = new_request_id("chatcmpl")
    specs = choices_for_prompt(request_id, 0, prompt_ids, params, req.n, max_tokens)
    log_request(ctx.options.log_requests, "/v1/chat/completions", request_id,
                [m.model_dump(exclude_none=True) for m in req.messages], specs[0].params, req.n)

    run = GenerationRun(engine, specs, ctx.metrics, arrival, ctx.admission)
    outputs = [_ChoiceOutput(spec, engine.tokenizer, req) for spec in specs]
    prompt_token_ids = prompt_ids if req.return_token_ids else None

    def usage() -> responses.Usage:
        return responses.Usage.of(len(prompt_ids), sum(len(o.token_ids) for o in outputs))

    def chunk(choices: list[responses.ChatChunkChoice], **fields: Any) -> responses.ChatCompletionChunk:
        return responses.ChatCompletionChunk(
            id=request_id, created=created, model=ctx.served_model_name, choices=choices, **fields
        )

    if req.stream:
        await until_disconnected(request, run.start())

        async def chunks() -> AsyncIterator[bytes]:
            exclude = None if req.include_usage else {"usage"}
            for o in outputs:  # the prompt's ids (vLLM: on the first chunk) are the same for every choice
                first_ids = prompt_token_ids if o is outputs[0] else None
                yield sse_event(chunk([o.role_chunk()], prompt_token_ids=first_ids), exclude=exclude)
            async for index, out in run.outputs():
                for choice in outputs[index].add(out):
                    yield sse_event(chunk([choice]), exclude=exclude)
            if req.include_usage:
                yield sse_event(chunk([], usage=usage()))

        return SSEResponse(sse_body(chunks(), run.close))

    async def generate() -> responses.ChatCompletion:
        await run.start()
        async for index, out in run.outputs():
            outputs[index].add_whole(out)
        return responses.ChatCompletion(
            id=request_id,
            created=created,
            model=ctx.served_model_name,
            choices=[o.whole() for o in outputs],
            usage=usage(),
            prompt_token_ids=prompt_token_ids,
        )

    return json_response(await until_disconnected(request, generate()))
