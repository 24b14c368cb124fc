"""POST /v1/chat/completions.

The prompt is `encode_chat(tokenizer, messages, tools, thinking=...)` (`chat_template_kwargs`:
`thinking`, default true as in K3, and `thinking_effort`). The generated turn is split into
`reasoning_content` (the think channel), `content` and `tool_calls` (K3's tools section, parsed by
`parse_assistant_output`; a malformed section is given back as text in `content`). With tool calls
and a natural stop, `finish_reason` is "tool_calls"; a turn cut by max_tokens stays "length".

`reasoning_effort` (OpenAI's name) is K3's `thinking_effort`; "none" (OpenAI's value for no reasoning) turns K3's
thinking off. With `continue_final_message` (and
`add_generation_prompt` false, as vLLM asks) the last assistant message is continued, not closed.
`response_format` json_object / json_schema constrain the output (server/structured_outputs.py), and
so do `tool_choice` "required" (one or more calls of any of the tools) and a named function (one call
of it; `parallel_tool_calls` false: one call of any): the turn is then K3's tool-call markup with
arguments valid under each tool's `parameters` (models/kimi_k3/tool_grammar.py), and `content` is empty.
With "auto" `parallel_tool_calls` constrains nothing (the model decides). The prompt carries K3's `tool_choice=required`
note for both (K3's format has no note naming one function). `chat_template` is a 400 (K3's format only),
and so are OpenAI's legacy `functions` / `function_call` and the other features of protocol.CHAT_REFUSED.
`max_completion_tokens` (or the older `max_tokens`) defaults to all the room the context leaves.
The reasoning is sent both as `reasoning_content` and as `reasoning` (current vLLM's name).
`prompt_logprobs` (vLLM's extension) scores the rendered prompt's tokens; as in vLLM the list is beside
the choices, and it is a 400 with `stream`.

Streaming: one role chunk per choice, then for each engine delta the chunks of the text it released
(`reasoning_content` while in the think channel, `content` after; a delta that crosses the boundary
gives one chunk per field, in order), tool calls as one `tool_calls` chunk when their section
closes, and a last chunk per choice with an empty delta and its `finish_reason`. Logprobs and
`token_ids` of a delta ride on its first chunk (an empty-delta chunk if its tokens were markup).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mstar.engine.client import EngineClient
from mstar.engine.outputs import RequestOutput
from mstar.engine.params import ParamError
from mstar.engine.structured_output import Grammar
from mstar.models.kimi_k3.assistant_output import AssistantOutputParser, Piece, parse_assistant_output
from mstar.models.kimi_k3.chat import THINKING_EFFORTS, continues_in_think
from mstar.models.kimi_k3.tokenizer import KimiTokenizer, Segment
from mstar.server import responses
from mstar.server.context import ServerContext
from mstar.server.disconnect import until_disconnected
from mstar.server.errors import APIError, from_param_error
from mstar.server.generation import ChoiceSpec, GenerationRun
from mstar.server.logprobs import chat_logprobs, prompt_logprobs
from mstar.server.output_segments import AlignedSegmenter
from mstar.server.protocol import NO_REASONING, ChatCompletionRequest, ChatPromptFields, NamedToolChoice
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
    conversation_chars,
    longest_prompt,
    new_request_id,
    prompt_too_long,
    resolve_max_tokens,
)
from mstar.server.streaming import SSEResponse, json_response, sse_body, sse_event
from mstar.server.structured_outputs import forced_tool_calls
from mstar.server.tokenize_pool import TokenizePool, TooManyTokens


def _tools(req: ChatPromptFields) -> list[dict[str, Any]] | None:
    return [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None


def _tool_choice_note(req: ChatPromptFields) -> str | None:
    """The tool_choice chat.py renders a note for: a named function is rendered as "required"."""
    return "required" if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice


def _forced_tool_calls(req: ChatCompletionRequest) -> Grammar | None:
    """The grammar of a forced tool_choice ("required" or a named function), None otherwise."""
    choice = req.tool_choice
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return forced_tool_calls(_tools(req), name, starts_in_think=_starts_in_think(req), parallel=req.parallel_tool_calls)


def _thinking_effort(req: ChatPromptFields) -> tuple[str | None, str]:
    """(effort, the field it came from): `chat_template_kwargs.thinking_effort` or top-level `reasoning_effort`."""
    kwargs = req.chat_template_kwargs
    nested = kwargs.thinking_effort if kwargs is not None else None
    if nested is not None and req.reasoning_effort is not None and nested != req.reasoning_effort:
        raise APIError(f"reasoning_effort={req.reasoning_effort!r} and chat_template_kwargs.thinking_effort="
                       f"{nested!r} disagree; give one of them", param="reasoning_effort")
    if nested is not None:
        return nested, "chat_template_kwargs.thinking_effort"
    if req.reasoning_effort == NO_REASONING:  # no thinking (ChatPromptFields.thinking), so no effort either
        if kwargs is not None and "thinking" in kwargs.model_fields_set and kwargs.thinking:
            raise APIError(f"reasoning_effort={NO_REASONING!r} turns thinking off, but chat_template_kwargs.thinking "
                           "is true; give one of them", param="reasoning_effort")
        return None, "reasoning_effort"
    return req.reasoning_effort, "reasoning_effort"


async def chat_prompt_ids(req: ChatPromptFields, tokenize: TokenizePool, engine: EngineClient,
                          keep: int | None = None) -> list[int]:
    """The conversation rendered in K3's format and tokenized off the event loop, its last `keep` ids when
    `keep` is set (400s name the field at fault; one that cannot fit in the context is refused)."""
    if not req.messages:
        raise APIError("'messages' must hold at least one message", param="messages")
    if req.chat_template is not None:
        raise APIError("chat_template is not supported: this server renders K3's own chat format; omit it",
                       param="chat_template", code="unsupported")
    options: dict[str, Any] = {"thinking": req.thinking}
    effort, field = _thinking_effort(req)
    if effort is not None:
        if effort not in THINKING_EFFORTS:
            raise APIError(f"{field}={effort!r} is not supported; use one of {THINKING_EFFORTS}", param=field)
        options["thinking_effort"] = effort
    tools = _tools(req)
    options["tool_choice"] = _tool_choice_note(req)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError("continue_final_message continues the last message; set add_generation_prompt to false",
                           param="add_generation_prompt")
        last = req.messages[-1]
        if last.role != "assistant" or last.tool_calls:
            raise APIError("continue_final_message needs the last message to be an assistant's, without "
                           "tool_calls", param="continue_final_message")
    options["continue_final_message"] = req.continue_final_message
    options["add_generation_prompt"] = req.add_generation_prompt
    messages = [message.for_template() for message in req.messages]
    num_chars = conversation_chars(messages)
    check_text_fits(num_chars, engine, "messages", truncated=keep is not None)
    try:
        return await tokenize.encode_chat(num_chars, messages, tools, options, keep=keep, limit=longest_prompt(engine))
    except TooManyTokens as err:
        raise prompt_too_long(err.count, engine, "messages") from None
    except (ValueError, TypeError, KeyError) as err:
        raise APIError(f"The messages cannot be rendered for K3: {err}", param="messages") from None


def _starts_in_think(req: ChatCompletionRequest) -> bool:
    """Whether the generated text begins inside the think channel (what the output parsers need)."""
    if req.continue_final_message:
        return continues_in_think(req.messages[-1].for_template(), req.thinking)
    return req.thinking


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
        self._thinking = _starts_in_think(req)
        self._want_logprobs = req.logprobs
        self._want_token_ids = req.return_token_ids
        self._segmenter = AlignedSegmenter(tokenizer)
        self._parser = AssistantOutputParser(self._thinking) if req.stream else None
        self._segments: list[Segment] = []
        self._tool_calls_sent = 0
        self.token_ids: list[int] = []
        self._logprobs: list = []
        self._finished: RequestOutput | None = None
        self.prompt_logprobs: responses.PromptLogprobs | None = None

    def _finish_reason(self, has_tool_calls: bool) -> str | None:
        out = self._finished
        if out is None:
            return None
        return "tool_calls" if has_tool_calls and out.finish_reason == "stop" else out.finish_reason

    def _released(self, out: RequestOutput) -> list[Segment]:
        self.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(self._tokenizer, out.prompt_logprobs)
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
            return responses.ChatDelta(reasoning_content=piece.value, reasoning=piece.value)
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
        parsed = parse_assistant_output(self._segments, thinking=self._thinking)
        tool_calls = [_tool_call(call) for call in parsed.tool_calls]
        content = parsed.content if parsed.content is not None or tool_calls else ""
        message = responses.AssistantMessage(
            content=content, reasoning_content=parsed.reasoning_content, reasoning=parsed.reasoning_content,
            tool_calls=tool_calls or None
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
    req = await ctx.tokenize.parse(await request.body(), ChatCompletionRequest)  # a large body: in a worker
    check_model(req.model, ctx.served_model_name)
    check_n(req.n, ctx.options.max_n)
    check_supported(req)
    engine = ctx.engine
    check_stop_token_ids(req.stop_token_ids, engine)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # before the prompt is rendered: what is wrong with the fields is found without tokenizing
    params = base_params(req, logprobs, engine, renames=_ENGINE_NAMES, tool_calls=_forced_tool_calls(req),
                         prompt_logprobs=req.prompt_logprobs)
    prompt_ids = await chat_prompt_ids(req, ctx.tokenize, engine, keep=req.truncate_prompt_tokens)
    check_prompt_ids(prompt_ids, engine, "messages")
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(req.requested_max_tokens, len(prompt_ids), engine.max_seq_len, None, max_param,
                                    ctx.options.max_tokens)
    request_id = new_request_id("chatcmpl")
    specs = choices_for_prompt(request_id, 0, prompt_ids, params, req.n, max_tokens, req.min_tokens)
    # the choices share the prompt: the first one scores it (prompt_logprobs), the others need not
    specs[1:] = [dataclasses.replace(s, params=dataclasses.replace(s.params, prompt_logprobs=None)) for s in specs[1:]]
    log_request(ctx.options.log_requests, "/v1/chat/completions", request_id,
                [m.model_dump(exclude_none=True) for m in req.messages], specs[0].params, req.n)

    run = GenerationRun(engine, specs, ctx.metrics, arrival, ctx.admission)
    outputs = [_ChoiceOutput(spec, engine.tokenizer, req) for spec in specs]
    prompt_token_ids = prompt_ids if req.return_token_ids else None

    def usage() -> responses.Usage:
        return responses.Usage.of(len(prompt_ids), sum(len(o.token_ids) for o in outputs), run.num_cached_tokens(0))

    def chunk(choices: list[responses.ChatChunkChoice], **fields: Any) -> responses.ChatCompletionChunk:
        return responses.ChatCompletionChunk(
            id=request_id, created=created, model=ctx.served_model_name, choices=choices, **fields
        )

    if req.stream:
        await until_disconnected(request, run.start())

        async def chunks() -> AsyncIterator[bytes]:
            exclude = None if req.include_usage or req.continuous_usage else {"usage"}

            def so_far() -> responses.Usage | None:
                return usage() if req.continuous_usage else None

            for o in outputs:  # the prompt's ids (vLLM: on the first chunk) are the same for every choice
                first_ids = prompt_token_ids if o is outputs[0] else None
                yield sse_event(chunk([o.role_chunk()], prompt_token_ids=first_ids, usage=so_far()), exclude=exclude)
            async for index, out in run.outputs():
                for choice in outputs[index].add(out):
                    yield sse_event(chunk([choice], usage=so_far()), exclude=exclude)
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
            prompt_logprobs=outputs[0].prompt_logprobs,  # of the prompt every choice shares
        )

    return json_response(await until_disconnected(request, generate()))
