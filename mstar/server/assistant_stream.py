"""Incremental split of a generated K3 assistant turn into reasoning, content and tool calls.

`parse_assistant_output` parses a whole turn; a stream needs the same answer piece by piece. This
parser follows its rules exactly (the tests check that the pieces of any segment sequence add up to
what `parse_assistant_output` returns):

- markup is `<|open|>TAG<|sep|>` / `<|close|>TAG<|sep|>`; an open/close marker not followed by text
  and `<|sep|>` is text, spelled as written; `<|end_of_msg|>` / `[EOS]` end the turn;
- the first channel (think, or response with thinking off) runs until its close; then `think` and
  `response` channels add to reasoning and content, blank text between them is dropped, and any other
  text or markup outside a channel is content;
- inside a channel everything but its own close is the channel's text.

Text in a channel is emitted as it arrives. Only an open/close marker waits, for its `<|sep|>`, and
blank text between channels waits to see whether it stays blank. A tools section is buffered from
its open to its first `<|close|>tools<|sep|>` (or the end of the turn) and handed to
`parse_assistant_output`, so tool calls, and malformed sections given back as text, are exactly its.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from mstar.models.kimi_k3.chat import parse_assistant_output
from mstar.models.kimi_k3.tokenizer import CLOSE, END_OF_MSG, EOS, OPEN, SEP, Segment
from mstar.server.output_segments import merge_text

# The tag grammar of `chat.py` (`_TAG`): a name, then ` key="value"` attributes.
_TAG = re.compile(r'([A-Za-z_][\w-]*)((?: [A-Za-z_][\w-]*="[^"]*")*)')
_END_NAMES = (END_OF_MSG, EOS)


def tag_name(tag_text: str) -> str | None:
    match = _TAG.fullmatch(tag_text)
    return match.group(1) if match else None


class Piece(NamedTuple):
    kind: str  # "reasoning" | "content" | "tool_calls"
    value: Any  # str, or a list of OpenAI tool-call dicts


class _Event(NamedTuple):
    kind: str  # "open" | "close" (markup), "text" (part of a run of ordinary text), "mark" (a lone marker
    #            or other special token, as text), "end"
    value: str  # the tag text of open/close; the text otherwise
    raw: str  # how it was written, for giving it back as text
    segments: tuple[Segment, ...]


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
            return [_Event("text", segment.text, segment.text, (segment,))]
        events: list[_Event] = []
        if self._marker is not None:
            marker, tag = self._marker, "".join(self._tag_parts)
            self._marker, self._tag_parts = None, []
            if segment.text == SEP and tag:
                kind = "open" if marker == OPEN else "close"
                parts = (Segment(marker, control=True), Segment(tag), segment)
                return [_Event(kind, tag, marker + tag + SEP, parts)]
            events += self._unresolved(marker, tag)
        if segment.text in (OPEN, CLOSE):
            self._marker = segment.text
        elif segment.text in _END_NAMES:
            events.append(_Event("end", "", segment.text, (segment,)))
        else:
            events.append(_Event("mark", segment.text, segment.text, (segment,)))
        return events

    def finish(self) -> list[_Event]:
        if self._marker is None:
            return []
        marker, tag = self._marker, "".join(self._tag_parts)
        self._marker, self._tag_parts = None, []
        return self._unresolved(marker, tag)

    @staticmethod
    def _unresolved(marker: str, tag: str) -> list[_Event]:
        events = [_Event("mark", marker, marker, (Segment(marker, control=True),))]
        if tag:
            events.append(_Event("text", tag, tag, (Segment(tag),)))
        return events


class AssistantStreamParser:
    """Feed released segments with `push`, then call `finish`; both return the new pieces in order."""

    def __init__(self, thinking: bool = True):
        self._lexer = _Lexer()
        self._channel: str | None = "think" if thinking else "response"  # None: between channels
        self._ended = False
        self._tools: list[Segment] | None = None  # the buffered tools section
        self._blank_run: list[str] = []  # blank text between channels, not yet known to stay blank
        self._run_is_content = False  # the current text run between channels turned out not blank

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
            self._flush_tools(out)
        return _coalesce(out)

    def _handle(self, event: _Event, out: list[Piece]) -> None:
        if self._tools is not None:
            self._tools.extend(event.segments)
            if event.kind == "close" and tag_name(event.value) == "tools":
                self._flush_tools(out)
            return
        if self._ended:
            return
        if self._channel is not None:
            if event.kind == "end":
                self._ended = True
            elif event.kind == "close" and tag_name(event.value) == self._channel:
                self._channel = None
            else:
                out.append(Piece("reasoning" if self._channel == "think" else "content", event.raw))
            return
        if event.kind == "text":
            self._between_text(event.value, out)
            return
        self._end_run()
        tag = tag_name(event.value) if event.kind in ("open", "close") else None
        if event.kind == "end":
            self._ended = True
        elif event.kind == "open" and tag in ("think", "response"):
            self._channel = tag
        elif event.kind == "open" and tag == "tools":
            self._tools = list(event.segments)
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

    def _flush_tools(self, out: list[Piece]) -> None:
        """Parse the buffered section as the rest of a turn whose response channel just closed."""
        prefix = [Segment(CLOSE, control=True), Segment("response"), Segment(SEP, control=True)]
        parsed = parse_assistant_output(prefix + merge_text(self._tools), thinking=False)
        self._tools = None
        if parsed.reasoning_content:
            out.append(Piece("reasoning", parsed.reasoning_content))
        if parsed.content:
            out.append(Piece("content", parsed.content))
        if parsed.tool_calls:
            out.append(Piece("tool_calls", parsed.tool_calls))


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1].kind == piece.kind:
            out[-1] = Piece(piece.kind, out[-1].value + piece.value)
        else:
            out.append(piece)
    return out
