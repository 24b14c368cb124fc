"""POST /v1/responses: OpenAI's Responses API (what OpenAI's Agents SDK speaks), on the chat pipeline.

Accepted: `input` as text or a list of items (messages of any role with text content, the
`function_call` and `function_call_output` items of earlier turns, `reasoning` items), `instructions`
(a system message first), function `tools`, `tool_choice` ("auto", "none", and "required" or
`{"type": "function", "name": ...}`, which force calls as chat completions do: server/chat.py;
`parallel_tool_calls` false then allows one call), `max_output_tokens`, `temperature`, `top_p`,
`reasoning.effort` (K3's thinking effort; "none", OpenAI's value for no reasoning, turns K3's thinking
off: the turn starts in the response channel), `stream`, and at their neutral values `text.format` "text",
`store` false, `truncation` "disabled", `user`. Any other field is a 400 naming it (the body is parsed
with unknown keys forbidden).

The conversation is rendered as chat completions render it; the generated turn becomes output
items in order: a `reasoning` item (the think channel), a `message` item with one `output_text`
part (the response channel), and a `function_call` item per tool call. A turn cut by
max_output_tokens is `status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`.

Streaming sends OpenAI's typed events (`event:` and a `data:` object with `type` and
`sequence_number`): response.created, response.in_progress, then per item
response.output_item.added, its deltas (response.reasoning_text.delta; response.content_part.added,
response.output_text.delta, .done and response.content_part.done; response.function_call_arguments
.delta and .done), response.output_item.done, and last response.completed (or response.incomplete).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.structured_output import Grammar
from mstar.models.kimi_k3.assistant_output import AssistantOutputParser, Piece
from mstar.models.kimi_k3.chat import THINKING_EFFORTS
from mstar.server.context import ServerContext
from mstar.server.disconnect import until_disconnected
from mstar.server.errors import APIError, from_param_error
from mstar.server.generation import GenerationRun
from mstar.server.output_segments import AlignedSegmenter
from mstar.server.protocol import NO_REASONING, Int
from mstar.server.request_log import log_request
from mstar.server.sampling import (
    check_model,
    check_prompt_ids,
    check_text_fits,
    choices_for_prompt,
    conversation_chars,
    longest_prompt,
    prompt_too_long,
    resolve_max_tokens,
)
from mstar.server.streaming import SSEResponse, sse_body
from mstar.server.structured_outputs import forced_tool_calls
from mstar.server.tokenize_pool import TooManyTokens

# ---- the request ----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ContentPart(_Strict):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _InputItem(_Strict):
    """What every input item may carry back from an earlier response (accepted, not used)."""

    id: str | None = None
    status: str | None = None


class MessageItem(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_InputItem):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_InputItem):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_InputItem):
    type: Literal["reasoning"]
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningOptions(_Strict):
    effort: str | None = None
    summary: None = None


class TextFormat(_Strict):
    type: Literal["text"]


class TextOptions(_Strict):
    format: TextFormat | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    text: TextOptions | None = None
    parallel_tool_calls: bool = True
    store: Literal[False] | None = None  # nothing is stored: there is no response to retrieve later
    truncation: Literal["disabled"] | None = None
    user: str | None = None


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions first, earlier turns' items folded into
    assistant messages (reasoning, text, tool calls) and tool results."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    pending_reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        """The assistant message items of this turn go to (the last one, or a new one)."""
        nonlocal pending_reasoning
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": None})
        if pending_reasoning is not None:
            messages[-1]["reasoning_content"] = pending_reasoning
            pending_reasoning = None
        return messages[-1]

    for item in items:
        if isinstance(item, ReasoningItem):
            pending_reasoning = _text(item.content or item.summary)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            message = assistant()
            message["content"] = (message["content"] or "") + _text(item.content)
        elif isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type", "strict"})}
            for tool in req.tools or ()]


def _effort(req: ResponsesRequest) -> str | None:
    return req.reasoning.effort if req.reasoning is not None else None


def thinking(req: ResponsesRequest) -> bool:
    """Whether the turn starts in K3's think channel (its default)."""
    return _effort(req) != NO_REASONING


def tool_call_grammar(req: ResponsesRequest) -> Grammar | None:
    """The grammar of a forced tool_choice, from the channel the turn starts in."""
    choice = req.tool_choice
    if choice != "required" and not isinstance(choice, FunctionToolChoice):
        return None
    name = choice.name if isinstance(choice, FunctionToolChoice) else None
    return forced_tool_calls(chat_tools(req), name, starts_in_think=thinking(req), parallel=req.parallel_tool_calls)


async def _prompt_ids(req: ResponsesRequest, ctx: ServerContext) -> list[int]:
    effort = _effort(req)
    if effort is not None and effort not in (*THINKING_EFFORTS, NO_REASONING):
        raise APIError(f"reasoning.effort={effort!r} is not supported; use one of {THINKING_EFFORTS} or "
                       f"{NO_REASONING!r} (no thinking)", param="reasoning.effort")
    tools = chat_tools(req)
    note = "required" if isinstance(req.tool_choice, FunctionToolChoice) else req.tool_choice  # as chat.py
    options: dict[str, Any] = {"tool_choice": note, "thinking": thinking(req)}
    if effort is not None and effort != NO_REASONING:
        options["thinking_effort"] = effort
    messages = chat_messages(req)
    num_chars = conversation_chars(messages)
    check_text_fits(num_chars, ctx.engine, "input")
    try:
        return await ctx.tokenize.encode_chat(num_chars, messages, tools or None, options,
                                              limit=longest_prompt(ctx.engine))
    except TooManyTokens as err:
        raise prompt_too_long(err.count, ctx.engine, "input") from None
    except (ValueError, TypeError, KeyError) as err:
        raise APIError(f"The input cannot be rendered for K3: {err}", param="input") from None


# ---- output items and events -----------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Builds the output items from the parser's pieces, and the stream events that build them."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text is going into

    def add(self, piece: Piece) -> list[dict[str, Any]]:
        if piece.kind == "tool_calls":
            events = self._close()
            for call in piece.value:
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                events += self._added(item)
                index = len(self.items) - 1
                arguments = call["function"]["arguments"]
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": index, "delta": arguments})
                item["arguments"], item["status"] = arguments, "completed"
                events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                               "output_index": index, "arguments": arguments})
                events.append({"type": "response.output_item.done", "output_index": index, "item": item})
            return events
        kind = "reasoning" if piece.kind == "reasoning" else "message"
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close() + self._open_item(kind)
        index = len(self.items) - 1
        part = self._open["content"][0]
        part["text"] += piece.value
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        events.append({"type": delta, "item_id": self._open["id"], "output_index": index, "content_index": 0,
                       "delta": piece.value})
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    def _added(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown}]

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self._open = item
            return self._added(item)
        item = {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self._open = item
        events = self._added(item)
        events.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}})
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        part = item["content"][0]
        head = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **head, "text": part["text"]}]
        else:
            events = [{"type": "response.output_text.done", **head, "text": part["text"]},
                      {"type": "response.content_part.done", **head, "part": part}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


def _event(payload: dict[str, Any], sequence: int) -> bytes:
    body = json.dumps({**payload, "sequence_number": sequence}, ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {body}\n\n".encode()


# ---- the endpoint ---------------------------------------------------------------------------


async def create_response(request: Request, ctx: ServerContext) -> Response:
    try:
        return await _create(request, ctx)
    except ParamError as err:
        raise from_param_error(err, {"max_tokens": "max_output_tokens", "prompt": "input"}) from None


async def _create(request: Request, ctx: ServerContext) -> Response:
    arrival = time.perf_counter()
    created = int(time.time())
    req = await ctx.tokenize.parse(await request.body(), ResponsesRequest)  # a large body: in a worker
    check_model(req.model, ctx.served_model_name)
    engine = ctx.engine
    prompt_ids = await _prompt_ids(req, ctx)
    check_prompt_ids(prompt_ids, engine, "input")
    max_tokens = resolve_max_tokens(req.max_output_tokens, len(prompt_ids), engine.max_seq_len, None,
                                    "max_output_tokens", ctx.options.max_tokens)
    sampling = {name: getattr(req, name) for name in ("temperature", "top_p") if getattr(req, name) is not None}
    try:
        params = SamplingParams(**sampling, grammar=tool_call_grammar(req))
    except ParamError as err:
        raise from_param_error(err) from None
    response_id = _new_id("resp")
    [spec] = choices_for_prompt(response_id, 0, prompt_ids, params, 1, max_tokens)
    log_request(ctx.options.log_requests, "/v1/responses", response_id, req.model_dump(exclude_none=True),
                spec.params, 1)
    run = GenerationRun(engine, [spec], ctx.metrics, arrival, ctx.admission)
    segmenter = AlignedSegmenter(engine.tokenizer)
    parser = AssistantOutputParser(thinking=thinking(req))
    items = OutputItems()
    finished: list = []
    generated = [0]

    def response(status: str) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "model": ctx.served_model_name, "output": items.items if status != "in_progress" else [],
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or ()],
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionToolChoice)
                            else req.tool_choice or "auto"), "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": {"type": "text"}}, "reasoning": {"effort": req.reasoning.effort if req.reasoning
                                                                else None, "summary": None},
            "metadata": {}, "previous_response_id": None, "store": False, "truncation": "disabled",
            "usage": None if status == "in_progress" else {
                "input_tokens": len(prompt_ids), "input_tokens_details": {"cached_tokens": run.num_cached_tokens(0)},
                "output_tokens": generated[0], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(prompt_ids) + generated[0]},
        }

    async def events() -> AsyncIterator[dict[str, Any]]:
        async for _, out in run.outputs():
            generated[0] += len(out.new_token_ids)
            segments = segmenter.push(out.new_token_ids, out.text)
            if out.finished:
                finished.append(out)
                cut = out.finish_reason == "stop" and isinstance(out.stop_reason, str)
                segments += segmenter.finish(cut_by_stop_string=cut)
            pieces = parser.push(segments) + (parser.finish() if out.finished else [])
            for piece in pieces:
                for event in items.add(piece):
                    yield event
        for event in items.finish():
            yield event

    def final_status() -> str:
        return "incomplete" if finished and finished[0].finish_reason == "length" else "completed"

    if req.stream:
        await until_disconnected(request, run.start())

        async def stream() -> AsyncIterator[bytes]:
            sequence = 0
            for kind in ("response.created", "response.in_progress"):
                yield _event({"type": kind, "response": response("in_progress")}, sequence)
                sequence += 1
            async for event in events():
                yield _event(event, sequence)
                sequence += 1
            status = final_status()
            done = "response.incomplete" if status == "incomplete" else "response.completed"
            yield _event({"type": done, "response": response(status)}, sequence)

        return SSEResponse(sse_body(stream(), run.close))

    async def whole() -> dict[str, Any]:
        await run.start()
        async for _ in events():
            pass
        return response(final_status())

    return JSONResponse(await until_disconnected(request, whole()))
