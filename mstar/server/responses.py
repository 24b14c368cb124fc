"""Response bodies, in OpenAI's shapes (`text_completion`, `chat.completion`, `chat.completion.chunk`,
`list` of `model`), plus vLLM's `prompt_token_ids` / `token_ids` / `stop_reason` extensions.

Fields OpenAI always sends stay in the JSON even when null (`finish_reason`, `logprobs`, message
`content`); extension fields are left out unless they have a value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


def _is_none(value: Any) -> bool:
    return value is None


def _omitted() -> Any:
    """An optional field that is left out of the JSON while it is None."""
    return Field(default=None, exclude_if=_is_none)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# ---- /v1/completions ----------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, under its token id (a JSON object key: a string)."""

    logprob: float
    rank: int  # how many tokens are at least as likely there, itself included
    decoded_token: str


# vLLM's `prompt_logprobs`: one entry per prompt token, None for the first (nothing comes before it), else
# the prompt's token and the top N alternatives
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omitted()
    prompt_logprobs: PromptLogprobs | None = _omitted()
    prompt_token_ids: list[int] | None = _omitted()
    token_ids: list[int] | None = _omitted()


class Completion(BaseModel):
    """A whole completion, or (with `stream`) one chunk of it: OpenAI uses the same object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- /v1/chat/completions -----------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # current vLLM's name for reasoning_content (the same text)
    tool_calls: list[ToolCall] | None = _omitted()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omitted()
    token_ids: list[int] | None = _omitted()


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = _omitted()
    prompt_logprobs: PromptLogprobs | None = _omitted()  # vLLM: of the request, beside the choices


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omitted()
    content: str | None = _omitted()
    reasoning_content: str | None = _omitted()
    reasoning: str | None = _omitted()
    tool_calls: list[ToolCallDelta] | None = _omitted()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omitted()
    token_ids: list[int] | None = _omitted()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _omitted()


# ---- /v1/models ---------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mstar"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
