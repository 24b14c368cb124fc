"""From request fields to engine requests: checks of the prompt and the model name, max_tokens,
and one `SamplingParams` per choice.

Seeds: with `seed` s and n choices, choice i samples with seed s + i, so each choice is reproducible
on its own (choice i of a seeded n-request equals a single request with seed s + i), and the n
choices still differ.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from mstar.engine.client import EngineClient
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.structured_output import Grammar
from mstar.server.errors import APIError, echo, from_param_error
from mstar.server.generation import ChoiceSpec
from mstar.server.protocol import LOGIT_BIAS_KEY, SamplingFields
from mstar.server.structured_outputs import request_grammar


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(requested: str | None, served_model_name: str) -> None:
    if requested is not None and requested != served_model_name:
        raise APIError(
            f"The model {echo(requested)} does not exist; this server serves '{served_model_name}' (or omit 'model')",
            param="model",
            code="model_not_found",
        )


def check_supported(req: SamplingFields) -> None:
    """`prompt_logprobs` with `stream` is a 400 (vLLM's rule: no streamed response carries them); fields this
    server does not implement at all were refused by the body's parse (protocol.REFUSED)."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs are not available with stream=true (as in vLLM); omit one of them",
                       param="prompt_logprobs", code="unsupported")


def logit_bias(req: SamplingFields, engine: EngineClient) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; keys must be token ids of the vocabulary."""
    pairs = []
    vocab = engine.tokenizer.vocab_size
    for key, value in (req.logit_bias or {}).items():
        if not LOGIT_BIAS_KEY.fullmatch(key):
            raise APIError(f"logit_bias keys must be token ids (decimal digits), got {key!r}", param="logit_bias")
        token = int(key)
        if not 0 <= token < vocab:
            raise APIError(f"logit_bias names token id {token}, outside the vocabulary 0..{vocab - 1}",
                           param="logit_bias")
        pairs.append((token, value))
    return tuple(pairs)


def truncate_prompt(ids: list[int], req: SamplingFields) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last N tokens."""
    n = req.truncate_prompt_tokens
    return ids if n is None else ids[-n:]


def check_text_fits(num_chars: int, engine: EngineClient, param: str, truncated: bool = False) -> None:
    """Refuse prompt text that cannot fit in the context before tokenizing it (tokenizing megabytes is
    seconds of a worker thread): `num_chars` characters are at least `min_num_tokens` tokens. A prompt
    that will be truncated (`truncate_prompt_tokens`) is not refused for its length."""
    least = engine.tokenizer.min_num_tokens(num_chars)
    if not truncated and least >= engine.max_seq_len:
        raise APIError(
            f"The prompt is {num_chars} characters, so at least {least} tokens; this model's maximum context is "
            f"{engine.max_seq_len} tokens, which must also hold at least one generated token. Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def conversation_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the text a conversation's messages carry (what `check_text_fits` bounds)."""
    total = 0
    for message in messages:
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content or ()]
        total += sum(len(part) for part in parts if isinstance(part, str))
    return total


def check_prompt_ids(ids: list[int], engine: EngineClient, param: str) -> None:
    """Refuse what cannot run: an empty prompt, ids outside the vocabulary, no room to generate."""
    if not ids:
        raise APIError(f"The prompt is empty; '{param}' must hold at least one token", param=param)
    if len(ids) > longest_prompt(engine):  # first: a body of millions of ids is refused without a scan of them
        raise prompt_too_long(len(ids), engine, param)
    vocab = engine.tokenizer.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(f"'{param}' holds token id {bad}, outside the vocabulary 0..{vocab - 1}", param=param)


def longest_prompt(engine: EngineClient) -> int:
    """The most prompt ids the context holds with room for one generated token (the tokenizer's `limit`)."""
    return engine.max_seq_len - 1


def prompt_too_long(num_tokens: int, engine: EngineClient, param: str) -> APIError:
    return APIError(
        f"The prompt is {num_tokens} tokens; this model's maximum context is {engine.max_seq_len} tokens, "
        "which must also hold at least one generated token. Shorten the prompt.",
        param=param,
        code="context_length_exceeded",
    )


def check_stop_token_ids(ids: list[int] | None, engine: EngineClient) -> None:
    vocab = engine.tokenizer.vocab_size
    bad = next((i for i in ids or () if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(f"stop_token_ids holds {bad}, outside the vocabulary 0..{vocab - 1}", param="stop_token_ids")


def check_n(n: int, max_n: int) -> None:
    """The operator's bound on choices per prompt (pydantic already holds n to 1..MAX_N)."""
    if n > max_n:
        raise APIError(f"'n': Input should be less than or equal to {max_n} on this server (got {n})",
                       param="n", code="invalid_value")


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_seq_len: int, default: int | None, param: str, cap: int = 0
) -> int:
    """An explicit value must fit next to the prompt and under the operator's `cap` (0: none); an
    omitted one is `default` (or all the room left), cut to the room left and to `cap`."""
    room = max_seq_len - prompt_len
    if requested is None:
        chosen = room if default is None else min(default, room)
        return min(chosen, cap) if cap else chosen
    if requested < 1:
        raise APIError(f"{param} must be >= 1, got {requested}", param=param, code="invalid_value")
    if cap and requested > cap:
        raise APIError(f"{param}={requested} is above this server's limit of {cap} tokens per request",
                       param=param, code="invalid_value")
    if requested > room:
        raise APIError(
            f"{param}={requested} does not fit: the prompt is {prompt_len} tokens and the maximum context is "
            f"{max_seq_len}, so at most {room} tokens can be generated",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def base_params(req: SamplingFields, logprobs: int | None, engine: EngineClient,
                renames: dict[str, str] | None = None, tool_calls: Grammar | None = None,
                prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling parameters (max_tokens, min_tokens and seed are set per choice later);
    `tool_calls` is the grammar of a forced tool_choice (structured_outputs.forced_tool_calls)."""
    optional = {
        name: getattr(req, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")
        if getattr(req, name) is not None
    }
    try:
        return SamplingParams(
            **optional,
            seed=req.seed,
            stop=req.stop_strings(),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias(req, engine),
            grammar=request_grammar(req, tool_calls),
            cache_salt=req.cache_salt,
        )
    except ParamError as err:
        raise from_param_error(err, renames) from None


def choices_for_prompt(
    request_id: str, first_index: int, prompt_ids: list[int], params: SamplingParams, n: int, max_tokens: int,
    min_tokens: int | None = None,
) -> list[ChoiceSpec]:
    """n choices of one prompt: engine ids `{request_id}-{index}`, seeds seed + i."""
    if min_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"min_tokens={min_tokens} is above max_tokens={max_tokens}", param="min_tokens",
                       code="invalid_value")
    specs = []
    for i in range(n):
        seed = None if params.seed is None else params.seed + i
        index = first_index + i
        try:
            choice_params = dataclasses.replace(params, max_tokens=max_tokens, seed=seed, min_tokens=min_tokens or 0)
        except ParamError as err:
            raise from_param_error(err) from None
        specs.append(ChoiceSpec(index, f"{request_id}-{index}", prompt_ids, choice_params))
    return specs
