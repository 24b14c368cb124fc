"""vLLM's utility routes: POST /tokenize and /detokenize (vLLM's request and response shapes),
GET /version, and GET or POST /ping (vLLM's health probe for SageMaker-style load balancers).

/tokenize takes a `prompt` (text) or `messages` (a conversation, rendered exactly as chat
completions render it, with `tools`, `chat_template_kwargs`, `reasoning_effort`,
`add_generation_prompt` and `continue_final_message`) and answers `count`, `max_model_len`,
`tokens` and, with `return_token_strs`, each token's text (special tokens by name). Text of more tokens
than the context holds is a 400 that gives the count (as completions refuse it): its ids would be
megabytes of JSON built on the event loop.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar.server.chat import chat_prompt_ids
from mstar.server.context import ServerContext
from mstar.server.errors import APIError, guarded
from mstar.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, parse_request
from mstar.server.sampling import check_model, check_text_fits, longest_prompt, prompt_too_long
from mstar.server.tokenize_pool import TooManyTokens


def package_version() -> str:
    try:
        return version("mstar")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _is_chat(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False  # parse_request reports the malformed JSON
    return isinstance(body, dict) and "messages" in body


async def tokenize(request: Request, ctx: ServerContext) -> Response:
    raw = await request.body()
    tokenizer = ctx.engine.tokenizer
    if _is_chat(raw):
        chat = await ctx.tokenize.parse(raw, TokenizeChatRequest)
        check_model(chat.model, ctx.served_model_name)
        ids, want_strs = await chat_prompt_ids(chat, ctx.tokenize, ctx.engine), chat.return_token_strs
    else:
        text = await ctx.tokenize.parse(raw, TokenizeCompletionRequest)
        check_model(text.model, ctx.served_model_name)
        check_text_fits(len(text.prompt), ctx.engine, "prompt")
        try:
            [ids] = await ctx.tokenize.encode([text.prompt], limit=longest_prompt(ctx.engine))
        except TooManyTokens as err:
            raise prompt_too_long(err.count, ctx.engine, "prompt") from None
        want_strs = text.return_token_strs
    return JSONResponse({
        "count": len(ids),
        "max_model_len": ctx.engine.max_seq_len,
        "tokens": ids,
        "token_strs": [tokenizer.decode([i]) for i in ids] if want_strs else None,
    })


async def detokenize(request: Request, ctx: ServerContext) -> Response:
    req = parse_request(await request.body(), DetokenizeRequest)
    check_model(req.model, ctx.served_model_name)
    vocab = ctx.engine.tokenizer.vocab_size
    bad = next((i for i in req.tokens if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(f"tokens holds {bad}, outside the vocabulary 0..{vocab - 1}", param="tokens")
    return JSONResponse({"prompt": ctx.engine.tokenizer.decode(req.tokens)})


def add_vllm_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await guarded(lambda: tokenize(request, ctx), "/tokenize", ctx.metrics.invalid_request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await guarded(lambda: detokenize(request, ctx), "/detokenize", ctx.metrics.invalid_request)

    @app.get("/version")
    async def version_route() -> Response:
        return JSONResponse({"version": package_version()})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200 if ctx.engine.healthy else 503)
