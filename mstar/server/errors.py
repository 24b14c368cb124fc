"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

Bad input (malformed JSON, wrong types, out-of-range values, unknown model, prompts that do not fit)
is a 400 that names the parameter; a missing or wrong API key a 401, a body over the size limit a
413, more engine requests than the server admits at once a 429 with `Retry-After`, an engine that
has stopped a 503. Only an unexpected exception is a 500, with a generic message; its traceback goes
to the log, not to the client (and never the request's prompt); the body carries an error id that
the log line names too. Tracebacks are logged at most once per exception type per minute (a client
that can trigger one must not flood the log: mstar/tracebacks.py), later ones as one line. A client
that disconnects while its body is read is logged at INFO without a traceback. Values echoed from
the request are cut to `ECHO_CHARS` characters (`echo`).
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mstar.engine.errors import EngineDeadError
from mstar.engine.params import ParamError
from mstar.server.disconnect import ClientDisconnected
from mstar.tracebacks import TracebackLimiter

logger = logging.getLogger("mstar.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a bad key
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request; see the server log."
ECHO_CHARS = 200  # longest piece of a request echoed back in an error message


def echo(value: object) -> str:
    """`repr(value)` for an error message, cut to ECHO_CHARS (a 100 KB model name is not sent back whole)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


class APIError(Exception):
    """An error to send to the client as-is: status, message, and the parameter at fault."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def __reduce__(self):  # raised in a worker process (server/tokenize_pool.py parses large bodies there)
        return functools.partial(APIError, self.message, status=self.status, param=self.param, code=self.code,
                                 type=self.type, headers=self.headers), ()

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def engine_unavailable(detail: str) -> APIError:
    return APIError(f"The engine is not available: {detail}", status=503, code="engine_unavailable")


def internal_error(error_id: str) -> APIError:
    return APIError(f"{INTERNAL_ERROR_MESSAGE} Error id: {error_id}.", status=500, type="internal_server_error")


TRACEBACKS = TracebackLimiter()


def log_unexpected(exc: Exception, what: str) -> str:
    """Log an unexpected exception of an endpoint (traceback rate-limited); returns its error id."""
    error_id = uuid.uuid4().hex[:16]
    TRACEBACKS.error(logger, exc, "unexpected error in %s (error id %s)", what, error_id)
    return error_id


_LEADING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def from_param_error(err: ParamError, renames: dict[str, str] | None = None) -> APIError:
    """A `ParamError` (from `SamplingParams` or `engine.generate`) as a 400. Its message starts
    with the parameter's name; `renames` maps engine names to request names (e.g. chat's
    `logprobs` count is the request's `top_logprobs`)."""
    message = str(err)
    match = _LEADING_NAME.match(message)
    param = match.group(0) if match else None
    if param is not None and renames and param in renames:
        param = renames[param]
        message = renames[match.group(0)] + message[match.end() :]
    return APIError(message, param=param, code="invalid_value")


# ---- pydantic validation errors -------------------------------------------------------------

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}
_UNION_HINTS = {
    "prompt": "prompt takes a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "stop takes a string or a list of strings",
    "content": "content takes a string, null, or a list of {'type': 'text', 'text': ...} parts",
    "tool_choice": "tool_choice takes 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def _is_union_tag(part: str | int) -> bool:
    """Whether a part of an error's location names a union's member (`list[TextPart]`, `str`, `NamedToolChoice`)."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[:1].isupper())


def _field_path(loc: tuple) -> tuple[str, str | None]:
    """('messages', 0, 'content', 'list[TextPart]', 0, 'text') -> ('messages[0].content[0].text', 'content'):
    the path with pydantic's union-member tags dropped, and the last field name on it."""
    path = ""
    last_field = None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_union_tag(part):
            path += f".{part}" if path else part
            last_field = part
    return path, last_field


def _unknown_fields(errors: list[dict]) -> APIError | None:
    """All the unknown fields of a body, as one 400 that lists them; None when there are none. Keys
    unknown to one member of a union only (a body may match another) are left to the usual report."""
    names = list(dict.fromkeys(_field_path(e["loc"])[0] for e in errors
                               if e["type"] == "extra_forbidden" and not any(map(_is_union_tag, e["loc"]))))
    return _unknown(names) if names else None


def _unknown(names: list[str]) -> APIError:
    listed = ", ".join(f"'{name}'" for name in names)
    return APIError(f"Unknown field{'s' if len(names) > 1 else ''} {listed}: this server honours or refuses each "
                    "field OpenAI and vLLM define (the OpenAPI document at /openapi.json lists them) and ignores "
                    f"none; remove {'them' if len(names) > 1 else 'it'}", param=names[0], code="unknown_parameter")


def from_validation_error(err: ValidationError) -> APIError:
    """The most specific error of a failed request validation, as a 400 naming the parameter."""
    errors = err.errors(include_url=False)
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(f"The request body is not valid JSON: {detail}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError("The request body must be a JSON object", code="invalid_json")
    unknown = _unknown_fields(errors)
    if unknown is not None:
        return unknown
    # Among union alternatives, the one that got furthest says best what was wrong.
    best = max(errors, key=lambda e: len(e["loc"]))
    path, last_field = _field_path(best["loc"])
    code = "invalid_type" if "type" in best["type"] else "invalid_value"
    if best["type"] == "missing":
        message, code = f"'{path}' is required", "missing_required_parameter"
    elif best["type"] == "extra_forbidden":
        return _unknown([path])
    elif best["type"] == "unsupported":  # protocol._Body: a field refused at this value; its message says why
        field = best["ctx"]["field"]
        path = f"{path}.{field}" if path else field
        return APIError(f"{path} {best['ctx']['why']}", param=path, code="unsupported")
    else:
        message = f"'{path}': {best['msg']}"
        given = best.get("input")
        if not isinstance(given, dict | list):
            message += f" (got {echo(given)})"
    if len(errors) > 1 and last_field in _UNION_HINTS:
        message += f"; {_UNION_HINTS[last_field]}"
    return APIError(message, param=path or None, code=code)


# ---- wiring -------------------------------------------------------------------------------


async def guarded(
    handler: Callable[[], Awaitable[Response]], what: str, on_invalid: Callable[[], None] | None = None
) -> Response:
    """Run an endpoint body: `APIError`/`ParamError` become their 4xx (`on_invalid` is called for a
    400), a stopped engine a 503, a vanished client an empty 499, anything else a logged 500."""
    try:
        return await handler()
    except (ClientDisconnected, ClientDisconnect):
        logger.info("%s: the client disconnected before its answer", what)
        return Response(status_code=499)  # nobody is listening; nginx's code for "client closed request"
    except EngineDeadError as err:
        return error_response(engine_unavailable(str(err)))
    except (APIError, ParamError) as err:
        api_error = err if isinstance(err, APIError) else from_param_error(err)
        if api_error.status == 400 and on_invalid is not None:
            on_invalid()
        return error_response(api_error)
    except Exception as exc:
        return error_response(internal_error(log_unexpected(exc, what)))


def install_error_handlers(app: FastAPI) -> None:
    """Framework-level errors (unknown route, wrong method, stray exceptions) in the same shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ParamError)
    async def _param_error(request: Request, exc: ParamError) -> JSONResponse:
        return error_response(from_param_error(exc))
