"""The OpenAPI document of one app (`GET /openapi.json`), exact about what this server accepts.

The endpoints parse their bodies themselves (for OpenAI-style 400s that name the parameter), so
FastAPI cannot derive the schema from their signatures; it is built here from the same pydantic
models, then tightened with the checks the server makes beyond pydantic's types, so that a body
valid by the schema passes every check the schema can express and one it rejects is refused:
the model name, `n` and `max_tokens` under this server's limits, token ids inside the
vocabulary, sampling values in range, refused parameters (each body's REFUSED) only at their neutral
values, no other keys.
What a JSON schema cannot say (a prompt's length in tokens, `best_of` equal to `n`, prompts x n
choices) is checked by the server and answered with a 400.

Responses: every status an operation can answer is listed, with its body (OpenAI's error shape
for all errors) and the headers it always carries (`Retry-After` on a 429, `WWW-Authenticate`
on a 401). The fuzz test (tests/server/test_hardening_fuzz.py) holds the server to this document.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from mstar.engine.params import MAX_LOGIT_BIAS, MAX_PENALTY
from mstar.models.kimi_k3.chat import THINKING_EFFORTS
from mstar.server import responses
from mstar.server.options import ServerOptions
from mstar.server.protocol import (
    INT64_MAX,
    LOGIT_BIAS_KEY,
    NO_REASONING,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from mstar.server.responses_api import ResponsesRequest

REF = "#/components/schemas/{model}"
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256  # list prompts per completion request (prompts x n choices is checked by the server)
SECURITY_SCHEME = "bearerAuth"

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# One server-sent event (before OpenAPI 3.2, the schema of text/event-stream describes each event):
# `data` is a JSON chunk (the response object of the endpoint, or an error object) or the last
# event's `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "pattern": "^\\{.*\\}$",
                                                 "contentMediaType": "application/json"}]},
        "event": {"type": "string"},
    },
}
_TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
                      "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                     "tokens": {"type": "array", "items": {"type": "integer"}},
                                     "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                                                              {"type": "null"}]}}}
_DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
_RESPONSE = {"type": "object", "required": ["id", "object", "status", "output"],
             "properties": {"object": {"const": "response"}, "output": {"type": "array"}}}
_VERSION = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
_HEALTH_SCHEMA = {"type": "object", "required": ["status"], "properties": {"status": {"enum": ["ok", "unhealthy"]}}}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _token_ids(vocab_size: int, max_items: int) -> dict:
    return {"type": "array", "minItems": 1, "maxItems": max_items,
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}


def _sampling_fields(props: dict, options: ServerOptions, model_name: str, vocab_size: int) -> None:
    """The fields both endpoints share, as the server checks them."""
    props["model"] = _nullable({"type": "string", "enum": [model_name]})
    props["n"] = {"type": "integer", "minimum": 1, "maximum": options.max_n, "default": 1}
    props["temperature"] = _nullable({"type": "number", "minimum": 0})
    props["top_p"] = _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    props["top_k"] = _nullable({"type": "integer", "minimum": -1, "maximum": INT64_MAX})
    props["min_p"] = _nullable({"type": "number", "minimum": 0, "maximum": 1})
    stop = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS},
                               {"type": "null"}], "default": None}
    props["stop_token_ids"] = _nullable({"type": "array", "items": _token_ids(vocab_size, 1)["items"]})
    for name in ("presence_penalty", "frequency_penalty"):
        props[name] = _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY})
    props["repetition_penalty"] = _nullable({"type": "number", "exclusiveMinimum": 0})
    props["logit_bias"] = _nullable({"type": "object", "propertyNames": {"pattern": LOGIT_BIAS_KEY.pattern},
                                     "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                              "maximum": MAX_LOGIT_BIAS}})
    props["min_tokens"] = _nullable({"type": "integer", "minimum": 0})
    props["truncate_prompt_tokens"] = _nullable({"type": "integer", "minimum": 1})


def _refused(props: dict, model: type) -> None:
    """A body's refused fields (protocol.Refused): accepted at their neutral values only."""
    for name, refused in model.REFUSED.items():
        values = ", ".join(map(repr, refused.neutral))
        props[name] = {"enum": list(refused.neutral), "default": refused.neutral[0],
                       "description": f"Refused unless one of {values}: {refused.why}"}


def _chat_prompt_fields(props: dict, model_name: str) -> None:
    """What renders a conversation (chat completions and /tokenize), as the server checks it."""
    props["model"] = _nullable({"type": "string", "enum": [model_name]})
    props["messages"]["minItems"] = 1
    props["reasoning_effort"] = _nullable({"enum": [*THINKING_EFFORTS, NO_REASONING]})
    props["chat_template"] = {"type": "null", "default": None, "description": "Refused: K3's own format only"}


def _max_tokens(options: ServerOptions, max_seq_len: int, minimum: int = 1) -> dict:
    return _nullable({"type": "integer", "minimum": minimum, "maximum": options.cap_max_tokens(max_seq_len - 1)})


def request_schemas(options: ServerOptions, model_name: str, vocab_size: int, max_seq_len: int) -> dict[str, Any]:
    """Component schemas of request and response bodies, the request ones tightened."""
    models = [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
              (responses.Completion, "serialization"), (responses.ChatCompletion, "serialization"),
              (responses.ModelList, "serialization"), (responses.ModelCard, "serialization"),
              (TokenizeCompletionRequest, "validation"), (TokenizeChatRequest, "validation"),
              (DetokenizeRequest, "validation"), (ResponsesRequest, "validation")]
    _, top = models_json_schema(models, ref_template=REF)
    schemas = copy.deepcopy(top["$defs"])
    completion = schemas["CompletionRequest"]["properties"]
    _sampling_fields(completion, options, model_name, vocab_size)
    _refused(completion, CompletionRequest)
    ids = _token_ids(vocab_size, max_seq_len - 1)
    text = {"type": "string", "minLength": 1}
    completion["prompt"] = {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1,
                                                  "maxItems": MAX_PROMPTS},
                                      {"type": "array", "items": ids, "minItems": 1, "maxItems": MAX_PROMPTS}]}
    completion["max_tokens"] = _max_tokens(options, max_seq_len, minimum=0)  # 0: with echo only (the prompt alone)
    completion["suffix"] = _nullable({"type": "string", "maxLength": 0})
    completion["best_of"] = _nullable({"type": "integer", "minimum": 1, "maximum": options.max_n})
    chat = schemas["ChatCompletionRequest"]["properties"]
    _sampling_fields(chat, options, model_name, vocab_size)
    _refused(chat, ChatCompletionRequest)
    _chat_prompt_fields(chat, model_name)
    chat["max_tokens"] = _max_tokens(options, max_seq_len)
    chat["max_completion_tokens"] = _max_tokens(options, max_seq_len)
    _refused(schemas["ChatMessage"]["properties"], ChatMessage)
    _refused(schemas["StreamOptions"]["properties"], StreamOptions)
    _chat_prompt_fields(schemas["TokenizeChatRequest"]["properties"], model_name)
    schemas["TokenizeCompletionRequest"]["properties"]["model"] = _nullable({"type": "string", "enum": [model_name]})
    detokenize = schemas["DetokenizeRequest"]["properties"]
    detokenize["model"] = _nullable({"type": "string", "enum": [model_name]})
    detokenize["tokens"] = {"type": "array", "items": _token_ids(vocab_size, 1)["items"]}
    schemas["TokenizeRequest"] = {"anyOf": [{"$ref": REF.format(model="TokenizeCompletionRequest")},
                                            {"$ref": REF.format(model="TokenizeChatRequest")}]}
    responses_request = schemas["ResponsesRequest"]["properties"]
    responses_request["model"] = _nullable({"type": "string", "enum": [model_name]})
    responses_request["max_output_tokens"] = _max_tokens(options, max_seq_len)
    responses_request["temperature"] = _nullable({"type": "number", "minimum": 0})
    responses_request["top_p"] = _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    schemas["ReasoningOptions"]["properties"]["effort"] = _nullable({"enum": [*THINKING_EFFORTS, NO_REASONING]})
    schemas["Response"] = _RESPONSE
    schemas["TokenizeResponse"] = _TOKENIZE_RESPONSE
    schemas["DetokenizeResponse"] = _DETOKENIZE_RESPONSE
    schemas["Version"] = _VERSION
    schemas["FunctionDecl"]["properties"]["name"]["minLength"] = 1
    text_part = schemas["TextPart"]
    text_part["properties"] = {"type": {"type": "string", "const": "text"}, "text": {"type": "string"}}
    text_part["required"] = ["type", "text"]  # the K3 renderer is text-only
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    schemas["Health"] = _HEALTH_SCHEMA
    return schemas


def _json(ref_or_schema: str | dict) -> dict:
    schema = {"$ref": REF.format(model=ref_or_schema)} if isinstance(ref_or_schema, str) else ref_or_schema
    return {"application/json": {"schema": schema}}


def _error(description: str, headers: dict | None = None) -> dict:
    out = {"description": description, "content": _json("ErrorResponse")}
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {"Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"},
                                "description": "Seconds to wait before retrying"}}
_WWW_AUTHENTICATE = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}


def _operation(summary: str, ok: dict, *, protected: bool, errors: dict[int, str], body: str | None = None,
               parameters: list | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok}}
    for status, description in errors.items():
        op["responses"][str(status)] = _error(description, _RETRY_AFTER if status == 429 else None)
    if protected:
        op["security"] = [{SECURITY_SCHEME: []}]
        op["responses"]["401"] = _error("Missing or wrong API key", _WWW_AUTHENTICATE)
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body)}
    if parameters:
        op["parameters"] = parameters
    return op


def build_openapi(options: ServerOptions, model_name: str, vocab_size: int, max_seq_len: int) -> dict[str, Any]:
    auth = options.auth_enabled
    generation_errors = {
        400: "Invalid request: the message names the parameter",
        408: f"The body did not arrive within {options.body_timeout_s:g} s",
        413: f"The body is larger than {options.max_body_bytes} bytes",
        429: "More generations in flight than the server admits; retry after Retry-After seconds",
        500: "The engine failed the request (an internal error, or non-finite logits)",
        503: "The engine is not available (stopping, or stopped after repeated failures)",
    }
    event_stream = {"text/event-stream": {"schema": _SSE_EVENT}}

    def generation(summary: str, request: str, response: str) -> dict:
        ok = {"description": "The generation; with `stream`, server-sent events of chunks ending in [DONE]",
              "content": {**_json(response), **event_stream}}
        return {"post": _operation(summary, ok, protected=auth, errors=generation_errors, body=request)}

    # Any other name is a 404 (documented); the one model served is the only one that exists.
    model_param = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string",
                                                                                "enum": [model_name]}}]
    paths = {
        "/v1/completions": generation("Text completion", "CompletionRequest", "Completion"),
        "/v1/chat/completions": generation("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
        "/v1/responses": generation("OpenAI Responses API (text, function tools)", "ResponsesRequest", "Response"),
        "/v1/models": {"get": _operation("The served model", {"description": "Models", "content": _json("ModelList")},
                                         protected=auth, errors={})},
        "/v1/models/{model}": {"get": _operation(
            "One model", {"description": "The model", "content": _json("ModelCard")}, protected=auth,
            errors={404: "No such model"}, parameters=model_param)},
        "/health": {"get": _operation(
            "Liveness and readiness", {"description": "Healthy", "content": _json("Health")},
            protected=auth and options.protect_health, errors={})},
        "/metrics": {"get": _operation(
            "Prometheus metrics", {"description": "Metrics in Prometheus' text format",
                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
            protected=auth and options.protect_metrics, errors={})},
    }
    tokens_errors = {400: "Invalid request: the message names the parameter",
                     413: f"The body is larger than {options.max_body_bytes} bytes"}
    paths["/tokenize"] = {"post": _operation(
        "Token ids of a prompt or a conversation (vLLM)", {"description": "The ids",
                                                            "content": _json("TokenizeResponse")},
        protected=auth, errors=tokens_errors, body="TokenizeRequest")}
    paths["/detokenize"] = {"post": _operation(
        "Text of token ids (vLLM)", {"description": "The text", "content": _json("DetokenizeResponse")},
        protected=auth, errors=tokens_errors, body="DetokenizeRequest")}
    paths["/version"] = {"get": _operation("The server's version", {"description": "Version",
                                                                     "content": _json("Version")},
                                           protected=auth, errors={})}
    paths["/reset_prefix_cache"] = {"post": _operation(
        "Forget every cached prefix (vLLM)", {"description": "The prefix cache is empty (an empty body)"},
        protected=auth, errors={413: f"The body is larger than {options.max_body_bytes} bytes",
                                503: "The engine is not available (stopping, or stopped after repeated failures)"})}
    ping_ok = {"description": "Healthy (an empty body)"}
    paths["/ping"] = {method: _operation("Health probe (vLLM)", ping_ok, protected=auth and options.protect_health,
                                         errors={}) for method in ("get", "post")}
    for method in ("get", "post"):
        paths["/ping"][method]["responses"]["503"] = {"description": "The engine is not healthy"}
    paths["/health"]["get"]["responses"]["503"] = {"description": "The engine is not healthy",
                                                    "content": _json("Health")}
    shape_errors = {414: f"The path and query string are longer than {options.max_url_bytes} bytes",
                    431: f"The request has more than {options.max_headers} headers"}
    for operation in (op for item in paths.values() for op in item.values()):  # every route refuses these
        for status, description in shape_errors.items():
            operation["responses"][str(status)] = _error(description)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "mstar", "version": "1", "description": "OpenAI-compatible API of mstar-serve"},
        "paths": paths,
        "components": {"schemas": request_schemas(options, model_name, vocab_size, max_seq_len)},
    }
    if auth:
        doc["components"]["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    return doc
