"""The request fields that ask for structured outputs, as one engine Grammar (engine/structured_output.py).

    response_format        {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
                           (both endpoints: vLLM takes it on completions too)
    structured_outputs     vLLM's: {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": lark}
    guided_json, guided_regex, guided_choice, guided_grammar    vLLM's older names of the same
    tool_choice            "required" or a named function: a grammar of K3's tool-call markup whose
                           arguments follow the tools' schemas (models/kimi_k3/tool_grammar.py)

At most one of them may be set; a malformed one is a 400 naming it (the engine checks the grammar itself;
a tool's `parameters` it cannot compile is a 400 naming `tools`).
"""

from __future__ import annotations

import json
from typing import Any

from mstar.engine.structured_output import Grammar, choice_grammar
from mstar.models.kimi_k3.tool_grammar import forced_tool_call_grammar
from mstar.server.errors import APIError
from mstar.server.protocol import ResponseFormat, SamplingFields

_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _grammar(kind: str, value: Any, field: str) -> Grammar:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise APIError(f"{field} is not valid JSON: {err}", param=field) from None
        if not isinstance(value, dict):
            raise APIError(f"{field} must be a JSON Schema object", param=field)
        return Grammar("json_schema", json.dumps(value), field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(f"{field} must be a non-empty list of strings", param=field)
        return choice_grammar(value, field)
    if not isinstance(value, str) or not value:
        raise APIError(f"{field} must be a non-empty string", param=field)
    return Grammar(kind, value, field)


def _from_response_format(fmt: ResponseFormat) -> Grammar | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object", "", "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError("response_format json_schema needs json_schema.schema (the JSON Schema)",
                       param="response_format.json_schema")
    return _grammar("json_schema", fmt.json_schema.schema_, "response_format.json_schema")


def forced_tool_calls(tools: list[dict[str, Any]] | None, name: str | None, *, starts_in_think: bool,
                      parallel: bool = True) -> Grammar:
    """tool_choice "required" (`name` None: any of `tools`) or the named function, as a grammar."""
    if not tools:
        raise APIError("tool_choice forces a tool call, but the request declares no tools; give 'tools' or use "
                       "tool_choice 'auto' or 'none'", param="tool_choice")
    try:
        source = forced_tool_call_grammar(tools, name=name, starts_in_think=starts_in_think, parallel=parallel)
    except ValueError as err:
        raise APIError(f"tool_choice names a function the request does not declare: {err}",
                       param="tool_choice") from None
    return Grammar("lark", source, "tools")


def request_grammar(req: SamplingFields, tool_calls: Grammar | None = None) -> Grammar | None:
    """The one grammar the request asks for; `tool_calls` is `forced_tool_calls`' (chat's tool_choice)."""
    found: list[Grammar] = [] if tool_calls is None else [tool_calls]
    if req.response_format is not None and (g := _from_response_format(req.response_format)) is not None:
        found.append(g)
    if req.structured_outputs is not None:
        so = req.structured_outputs
        keys = [k for k in _KINDS if isinstance(so, dict) and so.get(k) is not None]
        if not isinstance(so, dict) or len(keys) != 1 or set(so) - set(_KINDS):
            raise APIError(f"structured_outputs must set exactly one of {sorted(_KINDS)}", param="structured_outputs")
        found.append(_grammar(_KINDS[keys[0]], so[keys[0]], f"structured_outputs.{keys[0]}"))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "lark")):
        if getattr(req, name) is not None:
            found.append(_grammar(kind, getattr(req, name), name))
    if len(found) > 1:
        names = ", ".join("tool_choice" if g is tool_calls else g.field for g in found)
        raise APIError(f"{names}: set at most one structured-output field", param=found[1].field)
    return found[0] if found else None
