"""Kimi K3 chat format ("XTML"): render OpenAI-style messages to token ids (`assistant_output.py`
parses the generated turns).

K3 ships no Jinja template; its `encoding_k3.py` builds prompts as a list of segments, and this
module follows the same format. Markup is built from four special tokens:

    <|open|>TAG ATTRS<|sep|>   opens an element       <|close|>TAG<|sep|>   closes it
    <|end_of_msg|>             ends a message (and is the generation stop token)

Attributes are written ` key="value"` with `&` -> `&amp;` and `"` -> `&quot;` in the value.
The special tokens are encoded as special ids; *all* text (tag names, attributes, message text) is
encoded as ordinary text, so nothing a user or tool writes can become a control token. Each segment
is BPE-encoded separately, and an attribute is four text segments (` key`, `="`, `value`, `"`).

Prompt order:
 1. tool declarations (if `tools`): a system message with `type="tool-declare"` whose body is
    `# Tools\\nHere are the available tools, described in JSONSchema.\\n\\n```json\\n{JSON}\\n```` with
    the tool list key-sorted at every level and dumped compactly (`,` `:`, non-ASCII kept).
 2. thinking effort (thinking on and `thinking_effort` set; HF's `apply_chat_template` sets "max"):
    a system message with `type="thinking-effort"`.
 3. the messages:
    - user/system: `<|open|>message role="user"[ name="N"]<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>`
      (a system message carrying `tools` becomes a `## New Tools Available` tool-declare message);
    - assistant: `<|open|>message role="assistant"<|sep|>` then, with thinking on,
      `<|open|>think<|sep|>REASONING<|close|>think<|sep|>` (present even when empty; absent entirely with
      thinking off), then `<|open|>response<|sep|>CONTENT<|close|>response<|sep|>`, then for tool calls
      `<|open|>tools<|sep|>` + per call `<|open|>call tool="NAME" index="i"<|sep|>` (i from 1) +
      per argument `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` +
      `<|close|>call<|sep|>`, then `<|close|>tools<|sep|>`, then `<|close|>message<|sep|><|end_of_msg|>`.
      T is string/number/boolean/null/object/array; a string VALUE is raw, others are `json.dumps`.
      Arguments that are not valid JSON are kept verbatim in `<|open|>json type="object"<|sep|>…<|close|>json<|sep|>`.
    - tool result: `<|open|>message role="tool" tool="NAME" index="i"<|sep|>RESULT` + the same closing,
      i counting tool messages since the last assistant message (from 1). Results are first put in
      the order of the assistant's `tool_calls` when every `tool_call_id` matches one.
 4. `tool_choice` "required"/"none" and `response_format` notes (system messages with a `type`).
 5. generation prompt: `<|open|>message role="assistant"<|sep|>` + `<|open|>think<|sep|>` (thinking on,
    the default) or `<|open|>response<|sep|>` (thinking off). No `[BOS]` anywhere.
    With `continue_final_message` the last message (an assistant's) is rendered here instead, left
    open: with thinking on and no content, inside its think channel (the reasoning continues);
    otherwise inside its response channel after a closed think channel.

Example (thinking off, one user message "Hi"):

    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>response<|sep|>

and a generated reply to parse (thinking on, so the prompt already opened `think`):

    I should look it up.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>
    <|close|>tools<|sep|><|close|>message<|sep|>

(line breaks added here for reading only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mstar.models.kimi_k3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, KimiTokenizer, Segment

# Upstream accepts exactly these, although the note it renders also names `medium`; a request the
# reference encoder refuses is refused here too.
THINKING_EFFORTS = ("low", "high", "max")

_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_DYNAMIC_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
_THINKING_EFFORT_NOTE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOL_CHOICE_NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON_NOTE = (
    "The system is invoked with `response_format={kind}`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)
_SCHEMA_NOTE = "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"


# ---- segment building ----------------------------------------------------------------------


def _control(name: str) -> list[Segment]:
    return [Segment(name, control=True)]


def _text(value: Any) -> list[Segment]:
    text = str(value)
    return [Segment(text)] if text else []


def _escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    segments = _control(OPEN) + _text(tag)
    for key, value in attrs:
        segments += _text(f" {key}") + _text('="') + _text(_escape_attr(value)) + _text('"')
    return segments + _control(SEP)


def _close_tag(tag: str) -> list[Segment]:
    return _control(CLOSE) + _text(tag) + _control(SEP)


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open_tag("message", attrs) + body + _close_tag("message") + _control(END_OF_MSG)


def _system_note(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _sorted_deep(value: Any) -> Any:
    """Key-sort every mapping so the same tools always render to the same bytes (prefix caching)."""
    if isinstance(value, dict):
        return {key: _sorted_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_deep(item) for item in value]
    return value


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _content_segments(content: Any, role: str) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    segments: list[Segment] = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(
                f"{role} message content part of type {part.get('type')!r} is not supported; "
                "this K3 chat renderer is text-only (use parts of type 'text')"
            )
        segments += _text(part["text"])
    return segments


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _normalize_arguments(arguments: Any, name: str) -> tuple[dict[str, Any], str | None]:
    """(argument mapping, raw JSON text when the arguments string is not valid JSON)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise TypeError(
            f"tool call {name!r}: arguments must be a dict or a JSON object string, got {type(arguments).__name__}"
        )
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    except RecursionError:  # nesting deeper than Python's parser recurses: a client's input, not our bug
        raise ValueError(f"tool call {name!r}: arguments are nested too deeply to parse") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {arguments[:80]!r}")
    return parsed, None


def _tool_call_segments(call: dict[str, Any], index: int) -> list[Segment]:
    function = call.get("function", call)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_calls[{index - 1}] has no function name")
    arguments, raw_json = _normalize_arguments(function.get("arguments"), name)
    segments = _open_tag("call", [("tool", name), ("index", index)])
    if raw_json is not None:
        segments += _open_tag("json", [("type", "object")]) + _text(raw_json) + _close_tag("json")
    for key, value in arguments.items():
        rendered = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        segments += _open_tag("argument", [("key", key), ("type", _argument_type(value))])
        segments += _text(rendered) + _close_tag("argument")
    return segments + _close_tag("call")


def _assistant_body(message: dict[str, Any], thinking: bool) -> list[Segment]:
    segments: list[Segment] = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        segments += _open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            segments += _text(reasoning)
        segments += _close_tag("think")
    segments += _open_tag("response") + _content_segments(message.get("content"), "assistant")
    segments += _close_tag("response")
    tool_calls = message.get("tool_calls") or []
    if tool_calls:
        segments += _open_tag("tools")
        for index, call in enumerate(tool_calls, start=1):
            segments += _tool_call_segments(call, index)
        segments += _close_tag("tools")
    return segments


def _tool_declaration(tools: Any, dynamic: bool = False) -> list[Segment]:
    header = _DYNAMIC_TOOLS_HEADER if dynamic else _TOOLS_HEADER
    body = f"{header}```json\n{_compact_json(_sorted_deep(tools))}\n```"
    return _message([("role", "system"), ("type", "tool-declare")], _text(body))


def _call_positions(tool_calls: Any) -> dict[str, tuple[int, str | None]]:
    """Assistant `tool_calls[].id` -> (1-based position, function name); first occurrence wins."""
    positions: dict[str, tuple[int, str | None]] = {}
    for position, call in enumerate(tool_calls or [], start=1):
        if isinstance(call, dict) and call.get("id") is not None:
            function = call.get("function", call)
            positions.setdefault(str(call["id"]), (position, function.get("name")))
    return positions


def order_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put each run of tool messages in the order of the preceding assistant's `tool_calls`.

    XTML binds a result to a call by position, while OpenAI clients bind by `tool_call_id` and may
    send results in any order. A run is reordered (and each message's `tool` set to its call's name)
    only if every `tool_call_id` in it matches; otherwise it is left as sent. Inputs are not mutated.
    """
    ordered: list[dict[str, Any]] = []
    positions: dict[str, tuple[int, str | None]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                positions = _call_positions(message.get("tool_calls"))
            ordered.append(message)
            i += 1
            continue
        run_end = i
        while run_end < len(messages) and messages[run_end].get("role") == "tool":
            run_end += 1
        run = messages[i:run_end]
        matches = [positions.get(str(m.get("tool_call_id", m.get("id")))) for m in run]
        if all(match is not None for match in matches):
            keyed = sorted(zip(matches, range(len(run)), run, strict=True), key=lambda item: (item[0][0], item[1]))
            for (_, name), _, tool_message in keyed:
                resolved = dict(tool_message)
                if name is not None:
                    resolved["tool"] = name
                    if "name" in resolved:
                        resolved["name"] = name
                ordered.append(resolved)
        else:
            ordered.extend(run)
        i = run_end
    return ordered


def generation_prompt(thinking: bool = True) -> list[Segment]:
    """The open assistant message the model continues: think channel first, or straight to response."""
    return _open_tag("message", [("role", "assistant")]) + _open_tag("think" if thinking else "response")


def build_chat_segments(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: Any = None,
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Segment]:
    """Render a conversation to segments (see the module docstring for the format).

    `thinking_effort` defaults to "max" as in HF's `apply_chat_template`; None omits the note.
    """
    continued = None
    if continue_final_message:
        if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
            raise ValueError("continue_final_message needs the last message to be an assistant's, without tool_calls")
        if add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: set add_generation_prompt to false")
        messages, continued = messages[:-1], messages[-1]
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort={thinking_effort!r} is not supported; use one of {THINKING_EFFORTS}")
    segments: list[Segment] = []
    if tools:
        segments += _tool_declaration(tools)
    if thinking and thinking_effort is not None:
        segments += _system_note("thinking-effort", _THINKING_EFFORT_NOTE.format(effort=thinking_effort))

    last_tool_calls: list[Any] | None = None
    tool_index = 0
    for position, message in enumerate(order_tool_results(list(messages))):
        role = message.get("role")
        name_attr = [("name", message["name"])] if message.get("name") else []
        if role == "system" and message.get("tools"):
            segments += _tool_declaration(message["tools"], dynamic=True)
        elif role in ("user", "system"):
            segments += _message([("role", role), *name_attr], _content_segments(message.get("content"), role))
        elif role == "assistant":
            last_tool_calls = message.get("tool_calls")
            tool_index = 0
            segments += _message([("role", "assistant"), *name_attr], _assistant_body(message, thinking))
        elif role == "tool":
            tool_index += 1
            tool_name = message.get("tool", message.get("name"))
            if tool_name is None and last_tool_calls and tool_index <= len(last_tool_calls):
                call = last_tool_calls[tool_index - 1]
                tool_name = call.get("function", call).get("name")
            if tool_name is None:
                raise ValueError(
                    f"messages[{position}] (role 'tool') has no tool name: give 'name' or "
                    "'tool_call_id', or follow an assistant message with matching tool_calls"
                )
            attrs = [("role", "tool"), ("tool", tool_name), ("index", tool_index)]
            segments += _message(attrs, _content_segments(message.get("content"), "tool"))
        else:
            raise ValueError(f"messages[{position}] has role {role!r}; K3 accepts system, user, assistant, tool")

    if tool_choice in _TOOL_CHOICE_NOTES:
        segments += _system_note("tool-choice", _TOOL_CHOICE_NOTES[tool_choice])
    format_type = response_format.get("type") if isinstance(response_format, dict) else None
    if format_type in ("json_object", "json_schema"):
        note = _RAW_JSON_NOTE.format(kind=format_type)
        if format_type == "json_schema":
            note += _SCHEMA_NOTE.format(schema=_compact_json(_sorted_deep(_response_schema(response_format))))
        segments += _system_note("response-format", note)
    if add_generation_prompt:
        segments += generation_prompt(thinking)
    if continued is not None:
        segments += _open_tag("message", [("role", "assistant")]) + _continued_body(continued, thinking)
    return segments


def continues_in_think(message: dict[str, Any], thinking: bool) -> bool:
    """Whether a continued assistant message is left open inside its think channel."""
    return thinking and not message.get("content")


def _continued_body(message: dict[str, Any], thinking: bool) -> list[Segment]:
    segments: list[Segment] = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        segments += _open_tag("think") + (_text(reasoning) if reasoning else [])
        if continues_in_think(message, thinking):
            return segments
        segments += _close_tag("think")
    return segments + _open_tag("response") + _content_segments(message.get("content"), "assistant")


def _response_schema(response_format: dict[str, Any]) -> Any:
    json_schema = response_format.get("json_schema")
    if isinstance(json_schema, dict):
        return json_schema.get("schema", json_schema.get("json_schema", json_schema))
    return json_schema


def encode_chat(tokenizer: KimiTokenizer, messages: list[dict[str, Any]], tools=None, **options) -> list[int]:
    """Token ids of a rendered conversation (options as in `build_chat_segments`)."""
    return tokenizer.encode_segments(build_chat_segments(messages, tools, **options))


def render_chat_text(messages: list[dict[str, Any]], tools=None, **options) -> str:
    """The prompt as one string, for logs and debugging only: re-encoding it would let text that
    spells a control token become one, and would merge BPE across segment edges."""
    return "".join(segment.text for segment in build_chat_segments(messages, tools, **options))
