"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict JSON types).

Types are strict (`"16"` is not an int, `1` is not a bool) so that a wrong type is a 400 rather than
a silent coercion. An integral JSON number (`16.0`) is an integer, as JSON Schema (and so the
OpenAPI document at /openapi.json) says; `16.5` is not. Unknown fields are a 400 that lists them
(errors.from_validation_error): a field this server has never heard of would otherwise be ignored,
and the request would mean something else than its sender meant. OpenAI's own clients send only
the fields the caller gives, all of them declared here.
Range checks of sampling values live in `SamplingParams`, so the engine and the server agree on
them; here only what the server itself needs (n, logprob counts) is bounded. The OpenAPI document
(server/openapi.py) states all of these bounds.

Fields that OpenAI or vLLM define and this server does not implement are declared too, in each
body's `REFUSED`, so that a request setting one is a 400 naming it rather than a 200 that ignored it;
each is accepted only at a neutral value (what clients send when they do not ask for the feature).
Labels that change nothing in the output (`user`, `safety_identifier`, `metadata`, `prompt_cache_key`)
are accepted as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from mstar.server.errors import echo, from_validation_error

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


@dataclass(frozen=True)
class Refused:
    """A field this server does not implement: accepted only at one of its `neutral` values (the first
    is the default), anything else is a 400 that says `why`."""

    neutral: tuple[Any, ...]
    why: str

    def accepts(self, value: Any) -> bool:
        return any(json_equal(value, neutral) for neutral in self.neutral)


def json_equal(value: Any, neutral: Any) -> bool:
    """Equal as JSON values: `true` is not `1` (Python's `True == 1` is), `1` is `1.0`."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # field -> what it is accepted at; such fields are typed Any (any JSON value reaches the check)
    REFUSED: ClassVar[dict[str, Refused]] = {}

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> Any:
        for name, refused in self.REFUSED.items():
            if not refused.accepts(getattr(self, name)):
                # errors.from_validation_error names the field: `field` joins the body's path
                raise PydanticCustomError("unsupported", "{field} {why}", {"field": name, "why": refused.why})
        return self


class StreamOptions(_Body):
    REFUSED = {"include_obfuscation": Refused((None, False), "is not supported (chunks carry no obfuscation "
                                                             "padding); omit it or pass false")}

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk
    include_obfuscation: Any = None


_STRUCTURED = "is not supported (structured outputs use llguidance; omit it)"
_OMIT = "is not supported; omit it"

# Both endpoints.
REFUSED: dict[str, Refused] = {
    "guided_decoding_backend": Refused((None,), _STRUCTURED),
    "guided_whitespace_pattern": Refused((None,), _STRUCTURED),
    "use_beam_search": Refused((False,), "beam search is not supported; omit it or pass false"),
    "length_penalty": Refused((1.0,), "is used by beam search only, which is not supported; omit it or pass 1"),
    "bad_words": Refused((None,), _OMIT),
    "allowed_token_ids": Refused((None,), _OMIT),
    "logits_processors": Refused((None,), "custom logits processors are not supported; omit it"),
    "skip_special_tokens": Refused((True,), "only true is supported (special tokens are never part of the text)"),
    "spaces_between_special_tokens": Refused((True,), "only true is supported; omit it"),
    "return_tokens_as_token_ids": Refused((False,), "is not supported; omit it or pass false"),
    "priority": Refused((0,), "priority scheduling is not supported; omit it or pass 0"),
    "vllm_xargs": Refused((None,), "is not supported (no extension of this server reads it); omit it"),
}

# Chat completions only: OpenAI's fields for what K3 or this server does not do.
CHAT_REFUSED: dict[str, Refused] = {
    "functions": Refused((None,), "(OpenAI's deprecated form of tools) is not supported; declare them as "
                                  "tools: [{'type': 'function', 'function': {'name': ..., 'parameters': ...}}]"),
    "function_call": Refused((None,), "(OpenAI's deprecated form of tool_choice) is not supported; use "
                                      "tool_choice: 'none', 'auto', 'required' or {'type': 'function', "
                                      "'function': {'name': ...}}"),
    "modalities": Refused((None, ["text"]), "other than ['text'] are not supported (K3 outputs text only); omit it or "
                                              "pass ['text']"),
    "audio": Refused((None,), "audio output is not supported (K3 outputs text only); omit it"),
    "prediction": Refused((None,), "(predicted outputs) is not supported; omit it"),
    "web_search_options": Refused((None,), "web search is not supported; omit it"),
    "verbosity": Refused((None,), _OMIT),
    "documents": Refused((None,), "is not supported (K3's chat format has no documents); put them in a message"),
    "store": Refused((None, False), "this server stores no completions; omit it or pass false"),
    "service_tier": Refused((None, "auto", "default"), "this server has one tier; omit it or pass 'auto'"),
}


class JsonSchemaFormat(_Body):
    """response_format's `json_schema` (OpenAI's shape): the output is constrained to `schema` whatever
    `strict` says (a non-strict schema is met all the more)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """Fields both endpoints share: the model, sampling, stopping, streaming and vLLM extensions."""

    REFUSED = REFUSED

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
    user: str | None = None  # a label: accepted, changes nothing
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    min_tokens: Int | None = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)  # keep the prompt's last N tokens
    # vLLM's: each prompt token's logprob and rank plus the top N (not with stream, as in vLLM)
    prompt_logprobs: TopLogprobs | None = None
    # K3's tokenizer adds no special tokens to text (no BOS): the ids are the same either way, as vLLM's
    # definition then gives them
    add_special_tokens: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: prefix-cache entries of this salt only
    response_format: ResponseFormat | None = None
    # REFUSED's fields, any JSON value: checked against their neutral values (_Body)
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
    vllm_xargs: Any = None

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

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":  # said before its other keys are called unknown
            raise PydanticCustomError("unsupported", "{field} {why}", {
                "field": "type", "why": f"{echo(kind)} is not supported: K3's chat renderer is "
                                        "text-only (use content parts of type 'text')"})
        return data


class FunctionCallArgs(_Body):
    name: str
    arguments: str | dict[str, Any] | None = None


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallArgs


class ChatMessage(_Body):
    # what OpenAI's assistant messages carry back (a client may send a response's message as it came)
    REFUSED = {
        "refusal": Refused((None,), "is not supported in messages; put the text in 'content'"),
        "annotations": Refused((None, []), "(citations) are not supported in messages; omit them"),
        "audio": Refused((None,), "is not supported (K3 takes text only); omit it"),
        "function_call": Refused((None,), "(OpenAI's deprecated form of tool_calls) is not supported; use "
                                          "tool_calls"),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tools: list[dict[str, Any]] | None = None  # K3: a system message that adds tools mid-conversation
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    def for_template(self) -> dict[str, Any]:
        """The dict `encode_chat` takes. `developer` is OpenAI's newer name for the system role."""
        message = self.model_dump(exclude_none=True, exclude=set(self.REFUSED))
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


NO_REASONING = "none"  # OpenAI's reasoning effort for no reasoning: K3 without its think channel


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt switch must not pass silently

    thinking: bool = True  # K3 thinks by default
    thinking_effort: str | None = None


class ChatPromptFields(_Body):
    """What renders a conversation to a prompt: chat completions and /tokenize share it."""

    messages: list[ChatMessage]
    tools: list[ToolDecl] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | None = None  # OpenAI's name for K3's thinking effort; NO_REASONING: no thinking
    continue_final_message: bool = False  # continue the last (assistant) message instead of starting a new one
    add_generation_prompt: bool = True  # vLLM: false with continue_final_message
    chat_template: Any = None  # refused: this server renders K3's own format only

    @property
    def thinking(self) -> bool:
        """K3's think channel: `chat_template_kwargs.thinking` (default on), off with reasoning_effort "none"."""
        if self.reasoning_effort == NO_REASONING:
            return False
        return True if self.chat_template_kwargs is None else self.chat_template_kwargs.thinking


class ChatCompletionRequest(SamplingFields, ChatPromptFields):
    REFUSED = {**REFUSED, **CHAT_REFUSED}

    # false: a forced tool_choice makes exactly one call; with "auto" the model decides how many it makes
    parallel_tool_calls: bool = True
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # labels that change nothing here (nothing is stored; prefix caching needs no key)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # CHAT_REFUSED's fields, any JSON value: checked against their neutral values (_Body)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    documents: Any = None
    store: Any = None
    service_tier: Any = None

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
