"""/v1/responses' conversions: input items to the chat messages K3 renders, a forced tool_choice to the
tool-call grammar, and the parser's pieces to output items and stream events (function tools become
function_call items)."""

from __future__ import annotations

import json

import pytest

from mstar.models.kimi_k3.assistant_output import Piece
from mstar.models.kimi_k3.tool_grammar import forced_tool_call_grammar
from mstar.server.errors import APIError
from mstar.server.responses_api import OutputItems, ResponsesRequest, chat_messages, chat_tools, tool_call_grammar


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                      "text": "in Paris?"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    })
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]


def test_pieces_become_items_and_events_in_order():
    items = OutputItems()
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": 1})}}
    events = []
    for piece in [Piece("reasoning", "Hm"), Piece("reasoning", "m."), Piece("content", "Calling."),
                  Piece("tool_calls", [call])]:
        events += items.add(piece)
    events += items.finish()
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert items.items[0]["content"][0]["text"] == "Hmm." and items.items[1]["content"][0]["text"] == "Calling."
    assert items.items[2]["call_id"] == "call_9" and json.loads(items.items[2]["arguments"]) == {"x": 1}
    assert all(i["status"] == "completed" for i in items.items)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_forced_tool_choice_is_the_tool_call_grammar_from_the_think_channel():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}, {"type": "function", "name": "g", "strict": True}]
    chat = [{"type": "function", "function": {"name": "f", "parameters": tools[0]["parameters"]}},
            {"type": "function", "function": {"name": "g"}}]

    def request(**fields) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"input": "hi", "tools": tools, **fields})

    assert chat_tools(request()) == chat
    assert tool_call_grammar(request()) is None and tool_call_grammar(request(tool_choice="auto")) is None
    for fields, name, parallel in (({"tool_choice": "required"}, None, True),
                                   ({"tool_choice": "required", "parallel_tool_calls": False}, None, False),
                                   ({"tool_choice": {"type": "function", "name": "g"}}, "g", True)):
        grammar = tool_call_grammar(request(**fields))
        assert grammar.kind == "lark" and grammar.field == "tools"
        assert grammar.source == forced_tool_call_grammar(chat, name=name, starts_in_think=True, parallel=parallel)
    # reasoning.effort "none": the turn starts in the response channel, so does the grammar
    grammar = tool_call_grammar(request(tool_choice="required", reasoning={"effort": "none"}))
    assert grammar.source == forced_tool_call_grammar(chat, name=None, starts_in_think=False, parallel=True)
    with pytest.raises(APIError, match="does not declare"):
        tool_call_grammar(request(tool_choice={"type": "function", "name": "h"}))
