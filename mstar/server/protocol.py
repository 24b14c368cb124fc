"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict JSON types).

Types are strict (`"16"` is not an int, `1` is not a bool) so that a wrong type is a 400 rather than
a silent coercion. An integral JSON number (`16.0`) is an integer, as JSON Schema (and so the
OpenAPI document at /openapi.json) says; `16.5` is not. Unknown fields are ignored, as OpenAI
clients send fields this server has no use for (`user`, `metadata`, ...).
Range checks of sampling values live in `SamplingParams`, so the engine and the server agree on
them; here only what the server itself needs (n, logprob counts) is bounded. The OpenAPI document
(server/openapi.py) states all of these bounds.

Fields that OpenAI or vLLM define and this server does not implement are declared too, in
`REFUSED`, so that a request setting one is a 400 naming it rather than a 200 that ignored it; each
is accepted only at its neutral value (what clients send by default).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from mstar.server.errors import from_validation_error

MAX_N = 128  # choices per prompt, as in OpenAI's API
MAX_TOP_LOGPROBS = 20
INT64_MAX = 2**63 - 1


Body = TypeVar("Body", bound=BaseModel)
LOGIT_BIAS_KEY = re.compile("^[0-9]+$")  # a logit_bias key: a token id in decimal


def _integral(value: Any) -> Any:
    """16.0 -> 16: JSON has one number type, and JSON Schema's "integer" includes integral floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
# Bounds inside the annotated type, so that the JSON schema of `X | None` keeps them.
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX - MAX_N), BeforeValidator(_integral)]
# The sampler holds top_k in an int64 tensor: a larger value would fail the whole engine step (and
# so every request in it), which is what the fuzz test found before this bound.
TopK = Annotated[int, Field(le=INT64_MAX), BeforeValidator(_integral)]  # below -1: SamplingParams says why


def parse_request(raw: bytes, model: type[Body]) -> Body:
    """Validate a raw JSON body; malformed JSON and invalid fields raise a 400 `APIError`."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        raise from_validation_error(err) from None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk


_STRUCTURED = "is not supported (structured outputs use llguidance; omit it)"

# field -> (neutral value, why it is refused). Both endpoints.
REFUSED: dict[str, tuple[Any, str]] = {
    "guided_decoding_backend": (None, _STRUCTURED),
    "guided_whitespace_pattern": (None, _STRUCTURED),
    "use_beam_search": (False, "beam search is not supported; omit it or pass false"),
    "length_penalty": (1.0, "is used by beam search only, which is not supported; omit it or pass 1"),
    "bad_words": (None, "is not supported; omit it"),
    "allowed_token_ids": (None, "is not supported; omit it"),
    "logits_processors": (None, "custom logits processors are not supported; omit it"),
    "skip_special_tokens": (True, "only true is supported (special tokens are never part of the text)"),
    "spaces_between_special_tokens": (True, "only true is supported; omit it"),
    "return_tokens_as_token_ids": (False, "is not supported; omit it or pass false"),
    "priority": (0, "priority scheduling is not supported; omit it or pass 0"),
}


def json_equal(value: Any, neutral: Any) -> bool:
    """Equal as JSON values: `true` is not `1` (Python's `True == 1` is), `1` is `1.0`."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


class SamplingFields(_Body):
    """Fields both endpoints share: the model, sampling, stopping, streaming and vLLM extensions."""

    model: str | None = None
    n: Int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None  # -1 or 0: no limit
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    min_tokens: Int | None = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)  # keep the prompt's last N tokens
    # vLLM's: each prompt token's logprob and rank plus the top N (not with stream, as in vLLM)
    prompt_logprobs: TopLogprobs | None = None
    # REFUSED's fields, any JSON value: checked against their neutral value (sampling.check_supported)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    bad_words: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    return_tokens_as_token_ids: Any = False
    priority: Any = 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = None  # 0 only with echo: the prompt alone is returned (OpenAI's and vLLM's)
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class FunctionCallArgs(_Body):
    name: str
    arguments: str | dict[str, Any] | None = None


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallArgs


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tools: list[dict[str, Any]] | None = None  # K3: a system message that adds tools mid-conversation

    def for_template(self) -> dict[str, Any]:
        """The dict `encode_chat` takes. `developer` is OpenAI's newer name for the system role."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        return message


class FunctionDecl(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # extra keys reach the model

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDecl(_Body):
    type: Literal["function"]
    function: FunctionDecl


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt switch must not pass silently

    thinking: bool = True  # K3 thinks by default
    thinking_effort: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text", "json_object", "json_schema"]


class ChatPromptFields(_Body):
    """What renders a conversation to a prompt: chat completions and /tokenize share it."""

    messages: list[ChatMessage]
    tools: list[ToolDecl] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | None = None  # OpenAI's name for K3's thinking effort
    continue_final_message: bool = False  # continue the last (assistant) message instead of starting a new one
    add_generation_prompt: bool = True  # vLLM: false with continue_final_message
    chat_template: Any = None  # refused: this server renders K3's own format only

    @property
    def thinking(self) -> bool:
        return True if self.chat_template_kwargs is None else self.chat_template_kwargs.thinking


class ChatCompletionRequest(SamplingFields, ChatPromptFields):
    # false: a forced tool_choice makes exactly one call; with "auto" the model decides how many it makes
    parallel_tool_calls: bool = True
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's current name; `max_tokens` the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # K3 adds no special tokens to text: the same ids either way
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPromptFields):
    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int]
