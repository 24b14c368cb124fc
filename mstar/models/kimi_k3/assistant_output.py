"""A generated K3 assistant turn split into reasoning, content and tool calls, piece by piece or whole.

`AssistantOutputParser` takes the turn's segments as they are released and returns new pieces at
once; `parse_assistant_output` feeds it the whole turn and joins the pieces, so a streamed and a
whole response are one parse. The rules (markup as in `chat.py`):

- markup is `<|open|>TAG<|sep|>` / `<|close|>TAG<|sep|>`; an open/close marker not followed by text
  and `<|sep|>` is text, spelled as written; `<|end_of_msg|>` / `[EOS]` end the turn;
- the first channel (think, or response with thinking off) runs until its close; then `think` and
  `response` channels add to reasoning and content, blank text between them is dropped, and any other
  text or markup outside a channel is content;
- inside a channel everything but its own close is the channel's text;
- a tools section runs from its open to its first `<|close|>tools<|sep|>`; its calls come back in
  OpenAI form (`arguments` a JSON string). A section that does not parse is kept as text in
  content, never dropped; one the turn ends inside runs to the first `<|close|>message<|sep|>`
  (what follows is read as usual) or the end.

Text in a channel is emitted as it arrives. Only an open/close marker waits, for its `<|sep|>`; blank
text between channels waits to see whether it stays blank; a tools section waits for its close.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from mstar.models.kimi_k3.tokenizer import CLOSE, END_OF_MSG, EOS, OPEN, SEP, KimiTokenizer, Segment

_MARKER_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in (OPEN, CLOSE, SEP, END_OF_MSG)) + ")")
_TAG = re.compile(r'([A-Za-z_][\w-]*)((?: [A-Za-z_][\w-]*="[^"]*")*)')
_ATTR = re.compile(r' ([A-Za-z_][\w-]*)="([^"]*)"')
_ENTITY = re.compile(r"&(amp|quot);")
_END_NAMES = (END_OF_MSG, EOS)


class ParsedAssistant(NamedTuple):
    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


class Piece(NamedTuple):
    kind: str  # "reasoning" | "content" | "tool_calls"
    value: Any  # str, or a list of OpenAI tool-call dicts


class _Event(NamedTuple):
    kind: str  # "open" | "close" (markup), "text" (part of a run of ordinary text), "mark" (a lone marker
    #            or other special token, as text), "end"
    value: str  # the tag text of open/close; the text otherwise
    raw: str  # how it was written, for giving it back as text


def _split_tag(tag_text: str) -> tuple[str, dict[str, str]] | None:
    match = _TAG.fullmatch(tag_text)
    if match is None:
        return None
    attrs: dict[str, str] = {}
    for key, value in _ATTR.findall(match.group(2)):
        attrs[key] = _ENTITY.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)
    return match.group(1), attrs


def _tag_name(event: _Event) -> str | None:
    parsed = _split_tag(event.value) if event.kind in ("open", "close") else None
    return parsed[0] if parsed else None


class _Lexer:
    """Segments in, events out; an open/close marker is held until its `<|sep|>` decides."""

    def __init__(self) -> None:
        self._marker: str | None = None
        self._tag_parts: list[str] = []

    def push(self, segment: Segment) -> list[_Event]:
        if not segment.control:
            if self._marker is not None:
                self._tag_parts.append(segment.text)
                return []
            return [_Event("text", segment.text, segment.text)]
        events: list[_Event] = []
        if self._marker is not None:
            tag = "".join(self._tag_parts)
            if segment.text == SEP and tag:  # the marker's tag is complete
                marker, self._marker, self._tag_parts = self._marker, None, []
                return [_Event("open" if marker == OPEN else "close", tag, marker + tag + SEP)]
            events += self.finish()
        if segment.text in (OPEN, CLOSE):
            self._marker = segment.text
        elif segment.text in _END_NAMES:
            events.append(_Event("end", "", segment.text))
        else:
            events.append(_Event("mark", segment.text, segment.text))
        return events

    def finish(self) -> list[_Event]:
        """The held marker (if any) given back as text: nothing can complete it now."""
        if self._marker is None:
            return []
        marker, tag = self._marker, "".join(self._tag_parts)
        self._marker, self._tag_parts = None, []
        return [_Event("mark", marker, marker)] + ([_Event("text", tag, tag)] if tag else [])


class AssistantOutputParser:
    """Feed released segments with `push`, then call `finish`; both return the new pieces in order.

    `thinking` says which channel the prompt opened (think or response). `call_id_prefix` makes tool
    call ids `prefix0, prefix1, ...`; by default they are random `call_...`.
    """

    def __init__(self, thinking: bool = True, call_id_prefix: str | None = None):
        self._lexer = _Lexer()
        self._channel: str | None = "think" if thinking else "response"  # None: between channels
        self._ended = False
        self._tools: list[_Event] | None = None  # the tools section so far, from its open marker
        self._blank_run: list[str] = []  # blank text between channels, not yet known to stay blank
        self._run_is_content = False  # the current text run between channels turned out not blank
        self._call_id_prefix = call_id_prefix
        self._calls_named = 0

    def push(self, segments: Iterable[Segment]) -> list[Piece]:
        out: list[Piece] = []
        for segment in segments:
            for event in self._lexer.push(segment):
                self._handle(event, out)
        return _coalesce(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        for event in self._lexer.finish():
            self._handle(event, out)
        self._end_run()
        if self._tools is not None:
            self._unterminated_tools(out)
        return _coalesce(out)

    def _handle(self, event: _Event, out: list[Piece]) -> None:
        if self._ended:
            return
        if self._tools is not None:
            if event.kind == "end":
                self._unterminated_tools(out)
                self._ended = True
            else:
                self._tools.append(event)
                if event.kind == "close" and _tag_name(event) == "tools":
                    self._close_tools(out)
            return
        if self._channel is not None:
            if event.kind == "end":
                self._ended = True
            elif event.kind == "close" and _tag_name(event) == self._channel:
                self._channel = None
            else:
                out.append(Piece("reasoning" if self._channel == "think" else "content", event.raw))
            return
        if event.kind == "text":
            self._between_text(event.value, out)
            return
        self._end_run()
        tag = _tag_name(event)
        if event.kind == "end":
            self._ended = True
        elif event.kind == "open" and tag in ("think", "response"):
            self._channel = tag
        elif event.kind == "open" and tag == "tools":
            self._tools = [event]
        elif not (event.kind == "close" and tag == "message"):
            out.append(Piece("content", event.raw))

    def _between_text(self, text: str, out: list[Piece]) -> None:
        if self._run_is_content:
            out.append(Piece("content", text))
            return
        self._blank_run.append(text)
        if text.strip():
            out.append(Piece("content", "".join(self._blank_run)))
            self._blank_run = []
            self._run_is_content = True

    def _end_run(self) -> None:
        self._blank_run = []
        self._run_is_content = False

    def _close_tools(self, out: list[Piece]) -> None:
        section, self._tools = self._tools, None
        calls = _parse_tools(section[1:], self._make_id)
        if calls is None:
            out.append(Piece("content", "".join(event.raw for event in section)))
        elif calls:
            out.append(Piece("tool_calls", calls))

    def _unterminated_tools(self, out: list[Piece]) -> None:
        """The turn ended inside a tools section: it is text up to the message's close, and what came
        after that close is read again as the rest of the turn."""
        section, self._tools = self._tools, None
        end = next((j for j, e in enumerate(section) if e.kind == "close" and _tag_name(e) == "message"), None)
        out.append(Piece("content", "".join(event.raw for event in section[:end])))
        for event in section[end:] if end is not None else ():
            self._handle(event, out)
        self._end_run()
        if self._tools is not None:  # the rest opened another section
            self._unterminated_tools(out)

    def _make_id(self) -> str:
        if self._call_id_prefix is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        self._calls_named += 1
        return f"{self._call_id_prefix}{self._calls_named - 1}"


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1].kind == piece.kind:
            out[-1] = Piece(piece.kind, out[-1].value + piece.value)
        else:
            out.append(piece)
    return out


# ---- the tools section: a body of calls between `<|open|>tools<|sep|>` and its close ----


class _Malformed(Exception):
    pass


def _is_text(event: _Event) -> bool:
    return event.kind in ("text", "mark")


def _typed_value(raw: str, kind: str) -> Any:
    if kind == "string":
        return raw
    checks = {
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if kind not in checks:
        raise _Malformed(f"unknown argument type {kind!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _Malformed(f"argument of type {kind} is not JSON: {err}") from err
    if not checks[kind](value):
        raise _Malformed(f"argument declared {kind} holds {raw[:40]!r}")
    return value


def _skip_blank(events: list[_Event], i: int) -> int:
    while i < len(events) and events[i].kind == "text" and not events[i].value.strip():
        i += 1
    return i


def _expect_open(events: list[_Event], i: int) -> tuple[str, dict[str, str]]:
    if i >= len(events) or events[i].kind != "open":
        raise _Malformed("expected an element")
    parsed = _split_tag(events[i].value)
    if parsed is None:
        raise _Malformed(f"bad tag {events[i].value!r}")
    return parsed


def _read_text_until_close(events: list[_Event], i: int, tag: str) -> tuple[str, int]:
    parts: list[str] = []
    while i < len(events) and _is_text(events[i]):
        parts.append(events[i].value)
        i += 1
    if i >= len(events) or events[i].kind != "close" or _tag_name(events[i]) != tag:
        raise _Malformed(f"unterminated {tag}")
    return "".join(parts), i + 1


def _parse_call(events: list[_Event], i: int, make_id) -> tuple[dict[str, Any], int]:
    tag, attrs = _expect_open(events, i)
    if tag != "call" or not attrs.get("tool"):
        raise _Malformed("expected <|open|>call tool=...")
    name = attrs["tool"]
    arguments: dict[str, Any] = {}
    raw_json: str | None = None
    i += 1
    while True:
        i = _skip_blank(events, i)
        if i < len(events) and events[i].kind == "close" and _tag_name(events[i]) == "call":
            i += 1
            break
        tag, attrs = _expect_open(events, i)
        if tag == "argument" and "key" in attrs and "type" in attrs and attrs["key"] not in arguments:
            raw, i = _read_text_until_close(events, i + 1, "argument")
            arguments[attrs["key"]] = _typed_value(raw, attrs["type"])
        elif tag == "json" and raw_json is None:
            raw_json, i = _read_text_until_close(events, i + 1, "json")
        else:
            raise _Malformed(f"unexpected {tag!r} in call")
    if raw_json is not None and arguments:
        raise _Malformed("call has both a json block and arguments")
    arguments_text = raw_json if raw_json is not None else json.dumps(arguments, ensure_ascii=False)
    call = {"id": make_id(), "type": "function", "function": {"name": name, "arguments": arguments_text}}
    return call, i


def _parse_tools(events: list[_Event], make_id) -> list[dict[str, Any]] | None:
    """The calls of a section body whose last event is its `<|close|>tools<|sep|>`; None if malformed."""
    calls: list[dict[str, Any]] = []
    i = 0
    try:
        while True:
            i = _skip_blank(events, i)
            if i < len(events) and events[i].kind == "close" and _tag_name(events[i]) == "tools":
                return calls
            call, i = _parse_call(events, i, make_id)
            calls.append(call)
    except _Malformed:
        return None


# ---- a whole turn ----


def _as_segments(output: str | Sequence[Segment] | Sequence[int], tokenizer: KimiTokenizer | None) -> list[Segment]:
    if isinstance(output, str):
        # Plain text: the four marker spellings are taken as structure (a text-only limitation).
        return [Segment(p, control=p in (OPEN, CLOSE, SEP, END_OF_MSG)) for p in _MARKER_SPLIT.split(output) if p]
    items = list(output)
    if items and not isinstance(items[0], Segment):
        if tokenizer is None:
            raise ValueError("parse_assistant_output got token ids; pass tokenizer= to decode them")
        return tokenizer.decode_segments([int(i) for i in items])
    return items


def parse_assistant_output(
    output: str | Sequence[Segment] | Sequence[int],
    *,
    thinking: bool = True,
    tokenizer: KimiTokenizer | None = None,
    call_id_prefix: str | None = None,
) -> ParsedAssistant:
    """Split a generated assistant turn into (reasoning_content, content, tool_calls).

    `output` is what the model produced after the generation prompt: token ids (with `tokenizer`),
    segments from `KimiTokenizer.decode_segments`, or text. Ids/segments are exact: only real special
    tokens count as markup. With text, the marker spellings are taken as markup. A turn cut off
    inside a channel yields what it has. `thinking` and `call_id_prefix` as in `AssistantOutputParser`.
    """
    parser = AssistantOutputParser(thinking, call_id_prefix)
    pieces = parser.push(_as_segments(output, tokenizer)) + parser.finish()
    fields: dict[str, Any] = {"reasoning": "", "content": "", "tool_calls": []}
    for piece in pieces:
        fields[piece.kind] = fields[piece.kind] + piece.value
    return ParsedAssistant(fields["reasoning"] or None, fields["content"] or None, fields["tool_calls"])
