"""The FastAPI app: OpenAI-compatible completions and chat, models, health, metrics, the prefix cache's
reset and its OpenAPI document, behind the access guard (API keys, body size) of `ServerOptions`."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar.engine.client import EngineClient
from mstar.server import responses
from mstar.server.access import AccessGuard
from mstar.server.admission import Admission
from mstar.server.chat import create_chat_completion
from mstar.server.completions import create_completion
from mstar.server.context import ServerContext
from mstar.server.errors import APIError, echo, error_response, guarded, install_error_handlers
from mstar.server.metrics import CONTENT_TYPE, ServerMetrics
from mstar.server.openapi import build_openapi
from mstar.server.options import ServerOptions
from mstar.server.responses_api import create_response
from mstar.server.streaming import json_response
from mstar.server.tokenize_pool import TokenizePool
from mstar.server.vllm_routes import add_vllm_routes

logger = logging.getLogger("mstar.server")


def build_app(engine: EngineClient, *, served_model_name: str, metrics: ServerMetrics | None = None,
              options: ServerOptions | None = None, tokenize: TokenizePool | None = None) -> FastAPI:
    """An app serving `engine` under the model name `served_model_name`. `metrics` defaults to a
    fresh `ServerMetrics` with its own registry, `options` to `ServerOptions()` (open, no bound on
    requests in flight), `tokenize` to a pool without workers (every prompt tokenized in a thread); the
    caller starts and closes a pool it gives."""
    options = options if options is not None else ServerOptions()
    metrics = metrics if metrics is not None else ServerMetrics(served_model_name)
    ctx = ServerContext(
        engine=engine,
        served_model_name=served_model_name,
        metrics=metrics,
        created=int(time.time()),
        options=options,
        admission=Admission(options.max_in_flight, options.retry_after_s, metrics),
        tokenize=tokenize if tokenize is not None else TokenizePool(engine.tokenizer),
    )
    # redirect_slashes off: Starlette's redirect for a trailing slash is built from the client's Host
    # header (an open redirect that a following client re-sends its body to); such a path is a 404.
    app = FastAPI(title="mstar", docs_url=None, redoc_url=None, openapi_url="/openapi.json", redirect_slashes=False)
    document = build_openapi(options, served_model_name, engine.tokenizer.vocab_size, engine.max_seq_len)
    app.openapi = lambda: document  # FastAPI would derive one from the routes, which parse their own bodies
    app.state.ctx = ctx
    app.add_middleware(AccessGuard, options=options, metrics=metrics)
    install_error_handlers(app)

    def unavailable() -> APIError | None:
        if engine.healthy:
            return None
        return APIError("The engine is not healthy; try again later", status=503, code="engine_unhealthy")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if (err := unavailable()) is not None:
            return error_response(err)
        return await guarded(lambda: create_completion(request, ctx), "/v1/completions", ctx.metrics.invalid_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        if (err := unavailable()) is not None:
            return error_response(err)
        return await guarded(
            lambda: create_chat_completion(request, ctx), "/v1/chat/completions", ctx.metrics.invalid_request
        )

    @app.post("/v1/responses")
    async def responses_route(request: Request) -> Response:
        if (err := unavailable()) is not None:
            return error_response(err)
        return await guarded(lambda: create_response(request, ctx), "/v1/responses", ctx.metrics.invalid_request)

    def model_card() -> responses.ModelCard:
        return responses.ModelCard(id=served_model_name, created=ctx.created, max_model_len=engine.max_seq_len)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(responses.ModelList(data=[model_card()]))

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        if model != served_model_name:
            err = APIError(f"The model {echo(model)} does not exist", status=404, param="model", code="model_not_found")
            return error_response(err)
        return json_response(model_card())

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        try:
            ctx.metrics.update_engine_stats(engine.stats())
        except Exception:  # a scrape must still show the server's own metrics
            logger.exception("engine.stats() failed; engine gauges keep their last values")
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's route: forget every cached prefix (benchmarks measure cold prompts after it)."""
        if (err := unavailable()) is not None:
            return error_response(err)
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    add_vllm_routes(app, ctx)
    return app
