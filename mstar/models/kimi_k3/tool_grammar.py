"""A grammar that forces K3 tool calls: OpenAI's `tool_choice` "required" or a named function.

The grammar (Lark, in llguidance's dialect: `<|open|>` names a special token, `%json {...}` embeds a
JSON Schema) covers what the model writes after the generation prompt (chat.py's format):

    [think text <|close|>think<|sep|> <|open|>response<|sep|>]   only when the turn starts in think
    <|close|>response<|sep|>                                       the response channel stays empty
    <|open|>tools<|sep|> call ... <|close|>tools<|sep|> <|close|>message<|sep|>

The response channel is empty, as vLLM leaves `content` empty for a forced call. "required" allows
1 to `MAX_FORCED_CALLS` calls of any of the tools (one with `parallel=False`), a named function
exactly one call of it; calls are numbered `index="1"`, `"2"`, ... as chat.py renders them.

A call's arguments follow the tool's `parameters` schema in K3's per-argument markup,
`<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`, one per declared property in
the schema's order (required ones always, others optionally): a string VALUE is the raw text, and
is constrained here where that is exact (`enum`, `const`, `minLength`, `maxLength`); any other VALUE
is JSON under the property's own schema (`%json`, written as `json.dumps` writes it, which is how
chat.py renders it). A schema the per-argument form cannot express exactly (a string `pattern` or
`format`, a property without a `type`, `anyOf` at the top, `patternProperties`, ...) makes that tool's
calls carry the whole arguments object as one JSON block, `<|open|>json type="object"<|sep|>{...}
<|close|>json<|sep|>`, which assistant_output.py's parser also reads: valid under the schema either way.
"""

from __future__ import annotations

import json
from typing import Any

MAX_FORCED_CALLS = 16  # calls a "required" turn may make: a grammar numbers its calls, so it needs a bound

_THINK_TEXT = "/(?s:.*)/"  # any text: special tokens are never text, so the think channel ends at its close
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps'
# What a raw string argument can be held to exactly; other string keywords need the JSON block.
_RAW_STRING_KEYS = frozenset({"type", "enum", "const", "minLength", "maxLength", "title", "description", "default",
                              "examples"})
# An arguments schema that is only a list of properties; any other keyword needs the JSON block.
_PLAIN_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "title", "description",
                                "$defs", "definitions", "$schema", "$id", "default", "examples"})
_DEFINITIONS = ("$defs", "definitions")


def _literal(text: str) -> str:
    """A Lark string literal (JSON string syntax, which llguidance reads)."""
    return json.dumps(text)


def _attr(value: str) -> str:
    """An attribute value escaped as chat.py writes it."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(tag_text: str) -> str:
    return f"<|open|> {_literal(tag_text)} <|sep|>"


def _close(tag: str) -> str:
    return f"<|close|> {_literal(tag)} <|sep|>"


def _json_value(schema: dict[str, Any], definitions: dict[str, Any]) -> str:
    embedded = {**definitions, **schema, "x-guidance": {**_JSON_STYLE, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(embedded)


def _k3_type(value: Any) -> str:
    """The `type` attribute chat.py writes for a JSON value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", dict: "object"}.get(type(value), "array")


class _Rules:
    """Collects named rules; each property's value becomes one."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name


def _enum_alternatives(values: list[Any]) -> list[tuple[str, str | None]]:
    """(type attribute, value body or None for an empty string) per allowed value."""
    out = []
    for value in values:
        k3_type = _k3_type(value)
        text = value if k3_type == "string" else json.dumps(value, ensure_ascii=False)
        out.append((k3_type, _literal(text) if text else None))
    return out


def _property_alternatives(schema: Any, definitions: dict[str, Any]) -> list[tuple[str, str | None]] | None:
    """(type attribute, value body) per form the property's value may take, or None if this schema
    needs the JSON block (see the module doc)."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if types is not None and (not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types)):
        return None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list):
            return None
        if types is not None:
            values = [v for v in values if _k3_type(v) in types or (isinstance(v, int) and "integer" in types
                                                                   and not isinstance(v, bool))]
        return _enum_alternatives(values) or None
    if types is None:
        return None
    if "number" in types:  # integers are numbers: one alternative covers both
        types = [t for t in types if t != "integer"]
    alternatives: list[tuple[str, str | None]] = []
    for json_type in types:
        if json_type == "string":
            if set(schema) - _RAW_STRING_KEYS:
                return None
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if not isinstance(low, int) or not (high is None or isinstance(high, int)):
                return None
            alternatives.append(("string", f"/(?s:.{{{low},{'' if high is None else high}}})/"))
        else:
            k3_type = "number" if json_type == "integer" else json_type
            alternatives.append((k3_type, _json_value({**schema, "type": json_type}, definitions)))
    return alternatives


def _argument_rules(parameters: dict[str, Any] | None, prefix: str, rules: _Rules) -> str | None:
    """The rule body of a call's arguments in per-argument markup (its property rules added to `rules`),
    or None if the schema needs the block (nothing added)."""
    if parameters is None or parameters == {}:
        return ""
    if not isinstance(parameters, dict) or set(parameters) - _PLAIN_OBJECT_KEYS:
        return None
    if parameters.get("type", "object") != "object":
        return None
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list) or not all(
            isinstance(key, str) and key in properties for key in required):
        return None
    definitions = {key: parameters[key] for key in _DEFINITIONS if key in parameters}
    own = _Rules()
    parts = []
    for number, (key, schema) in enumerate(properties.items()):
        alternatives = _property_alternatives(schema, definitions)
        if alternatives is None:
            return None
        bodies = []
        for k3_type, value in alternatives:
            head = _open(f'argument key="{_attr(key)}" type="{k3_type}"')
            bodies.append(" ".join(part for part in (head, value, _close("argument")) if part))
        name = own.add(f"{prefix}_arg{number}", " | ".join(bodies))
        parts.append(name if key in required else f"{name}?")
    rules.lines += own.lines
    return " ".join(parts)


def _tool_arguments(tool: dict[str, Any], prefix: str, rules: _Rules) -> str:
    """The rule holding a call's arguments (per-argument markup or the JSON block)."""
    parameters = tool.get("function", tool).get("parameters")
    body = _argument_rules(parameters, prefix, rules)
    if body is None:
        block = _json_value(parameters, {})
        body = " ".join((_open('json type="object"'), block, _close("json")))
    return rules.add(f"{prefix}_args", body) if body else ""


def _tool_name(tool: dict[str, Any]) -> str:
    return tool.get("function", tool)["name"]


def forced_tool_call_grammar(tools: list[dict[str, Any]], *, name: str | None = None, starts_in_think: bool,
                             parallel: bool = True) -> str:
    """The Lark grammar of a turn that calls tools (see the module doc).

    `tools` are OpenAI tool declarations (`{"type": "function", "function": {...}}`); `name` forces that
    tool (one call), otherwise any of them may be called; `starts_in_think` says whether the generation
    prompt left the turn in its think channel. Raises ValueError if `name` is not one of `tools`."""
    names = [_tool_name(tool) for tool in tools]
    if not tools:
        raise ValueError("forcing a tool call needs at least one tool")
    if name is not None and name not in names:
        raise ValueError(f"{name!r} is not one of the tools {names}")
    rules = _Rules()
    chosen = [(i, tool) for i, tool in enumerate(tools) if name is None or _tool_name(tool) == name]
    arguments = {i: _tool_arguments(tool, f"tool{i}", rules) for i, tool in chosen}
    most = 1 if name is not None or not parallel else MAX_FORCED_CALLS
    for index in range(1, most + 1):
        calls = []
        for i, tool in chosen:
            head = _open(f'call tool="{_attr(_tool_name(tool))}" index="{index}"')
            calls.append(" ".join(part for part in (head, arguments[i], _close("call")) if part))
        rules.add(f"call{index}", " | ".join(calls))
        rules.add(f"calls{index}", f"call{index} calls{index + 1}?" if index < most else f"call{index}")
    channels = [_THINK_TEXT, _close("think"), _open("response")] if starts_in_think else []
    start = [*channels, _close("response"), _open("tools"), "calls1", _close("tools"), _close("message")]
    return "\n".join([f"start: {' '.join(start)}", *rules.lines]) + "\n"
