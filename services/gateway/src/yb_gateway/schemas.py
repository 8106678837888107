"""The OpenAI wire format the gateway speaks, as msgspec structs.

Requests are decoded strictly (`msgspec.json.decode(..., strict=True)` by default), so
`"max_tokens": "10"` is a 400 rather than a silent coercion, and the decoder's error
names the offending field. Nothing a client sends is silently ignored: a client that
asks for JSON mode or tools and gets plain text would believe it got what it asked for.
So every request struct forbids unknown fields, and each field that OpenAI (or vLLM,
whose extensions load generators send) defines but this server does not implement is
declared with a type that admits only its neutral values: what asks for nothing
(`best_of: 1`, `audio: null`), which clients may send as defaults.
`REFUSED_FIELDS` lists them per request type; `errors.from_decode_error` turns the
decoder's error on one of them, or on an unknown field, into a 400 naming the field.

Responses follow OpenAI's shapes field for field, including the `null`s clients look
for (`finish_reason: null` on intermediate chunks), so the structs that carry such
fields do not omit defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

# --- requests -----------------------------------------------------------------------

Role = Literal["system", "developer", "user", "assistant", "tool"]

# Types of the fields this server does not implement (see `REFUSED_FIELDS`): each admits
# only the values that ask for nothing.
_One = Annotated[float, msgspec.Meta(ge=1.0, le=1.0)]
_EmptyList = Annotated[list[Any], msgspec.Meta(max_length=0)]
_EmptyMap = Annotated[dict[str, Any], msgspec.Meta(max_length=0)]
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
_Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
# What the bus's msgpack carries, and OpenAI's range for `seed`: a larger integer would
# fail to encode after the request was checked (a 500 instead of a 400).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One part of a multi-part message; only `text` parts can be served here."""

    type: str
    text: str = ""
    # Refused: the other kinds of part, and cache hints.
    image_url: None = None
    input_audio: None = None
    file: None = None
    refusal: None = None
    prompt_cache_breakpoint: None = None


#: The most choices one request may ask for (`n`).
MAX_CHOICES = 16
#: The most alternatives per token: chat's `top_logprobs`, completions' `logprobs`.
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_TEXT = 5

# OpenAI's rule for function names.
_FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCallIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The function an earlier assistant turn called; `arguments` is JSON text."""

    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool call of an earlier assistant turn, sent back as history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's tool calls, and (role `tool`) which call a result answers.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Refused: the deprecated function call, audio, refusals.
    function_call: None = None
    refusal: None = None
    audio: None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`stream_options`: whether the stream ends with a usage chunk, and (vLLM's
    `continuous_usage_stats`, with `include_usage`) whether every chunk carries the
    counts so far, as load generators such as guidellm ask."""

    include_usage: bool = False
    continuous_usage_stats: bool | None = None
    # Refused: the stream's chunks carry no padding.
    include_obfuscation: Literal[False] | None = None


class TextResponseFormat(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="text"
):
    """`response_format: {"type": "text"}`: unconstrained text."""


class JsonObjectFormat(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="json_object"
):
    """`response_format: {"type": "json_object"}`: the output is one JSON object."""


class JsonSchemaSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The schema of `response_format: {"type": "json_schema"}`.

    `strict` true or false, the output is held to `schema` (a grammar allows nothing
    else): OpenAI's non-strict mode only promises less.
    """

    name: _FunctionName
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="json_schema"
):
    """`response_format: {"type": "json_schema", "json_schema": {...}}`."""

    json_schema: JsonSchemaSpec


ResponseFormatSpec = TextResponseFormat | JsonObjectFormat | JsonSchemaFormat


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function the model may call: its name, what it does, its JSON-schema
    parameters (any object when absent)."""

    name: _FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and text completions.

    Range checks live in the type (`Meta`), so the decoder reports them with the field's
    path.
    """

    model: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # Extension (vLLM's spelling): 0 or -1 disables top-k.
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=_INT64_MAX)] | None = None
    seed: _Int64 | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The tier the request runs in (`yb_gateway.tiers`): one of `gateway.service_tiers`,
    # or `auto` (= `default`).
    service_tier: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    # Extension: names the service tier of this priority (larger runs earlier).
    priority: _Int64 | None = None
    # Extension (vLLM's spelling): keep generating past end-of-sequence, up to
    # `max_tokens` (load generators need outputs of a known length).
    ignore_eos: bool = False
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    # Token ids (as strings, JSON keys) to a bias added to their logits.
    logit_bias: Annotated[dict[str, _Bias], msgspec.Meta(max_length=300)] | None = None
    # Refused (see `REFUSED_FIELDS`).
    repetition_penalty: _One | None = None  # vLLM's


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS_CHAT)] | None = None
    response_format: ResponseFormatSpec | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Refused (see `REFUSED_FIELDS`).
    functions: _EmptyList | None = None
    function_call: Literal["none"] | None = None
    modalities: (
        Annotated[list[Literal["text"]], msgspec.Meta(min_length=1, max_length=1)] | None
    ) = None
    audio: None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None
    store: Literal[False] | None = None
    metadata: _EmptyMap | None = None
    moderation: None = None
    prompt_cache_key: None = None
    prompt_cache_options: None = None
    prompt_cache_retention: None = None
    safety_identifier: None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/completions`: a prompt in any of OpenAI's four forms (a string, a list
    of token ids, or a list of either for several prompts: `prompt.completion_prompts`
    tells them apart, since a union may hold one list type only)."""

    prompt: str | list[str | int | list[int]]
    # 0 with `echo` asks only for the prompt back (and its logprobs, with `logprobs`).
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS_TEXT)] | None = None
    echo: bool | None = None
    # Refused (see `REFUSED_FIELDS`).
    best_of: Literal[1] | None = None
    suffix: None = None


class Refused(NamedTuple):
    """A request field this server does not implement, and what of it is accepted."""

    accepts: str
    """The neutral values that pass, as the error message and the docs show them."""
    defined_by: str = "OpenAI"


_NULL = Refused("`null`")

_REFUSED_COMMON: dict[str, Refused] = {
    "repetition_penalty": Refused("`1` or `null`", "vLLM"),
    "stream_options.include_obfuscation": Refused("`false` or `null`"),
}

# Keys are field paths without list indices (`messages.tool_calls` stands for
# `messages[i].tool_calls`); a refused field's nested fields are refused with it.
REFUSED_FIELDS: Mapping[type[msgspec.Struct], Mapping[str, Refused]] = {
    ChatCompletionRequest: {
        **_REFUSED_COMMON,
        "functions": Refused("`[]` or `null`"),
        "function_call": Refused('`"none"` or `null`'),
        "modalities": Refused('`["text"]` or `null`'),
        "audio": _NULL,
        "prediction": _NULL,
        "reasoning_effort": _NULL,
        "verbosity": _NULL,
        "web_search_options": _NULL,
        "store": Refused("`false` or `null`"),
        "metadata": Refused("`{}` or `null`"),
        "moderation": _NULL,
        "prompt_cache_key": _NULL,
        "prompt_cache_options": _NULL,
        "prompt_cache_retention": _NULL,
        "safety_identifier": _NULL,
        "messages.function_call": _NULL,
        "messages.refusal": _NULL,
        "messages.audio": _NULL,
        "messages.content.image_url": _NULL,
        "messages.content.input_audio": _NULL,
        "messages.content.file": _NULL,
        "messages.content.refusal": _NULL,
        "messages.content.prompt_cache_breakpoint": _NULL,
    },
    CompletionRequest: {
        **_REFUSED_COMMON,
        "best_of": Refused("`1` or `null`"),
        "suffix": _NULL,
    },
}


# --- responses ----------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """How much of the prompt was served from the KV cache."""

    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of the likeliest tokens at a position: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class ContentLogprob(msgspec.Struct, kw_only=True):
    """A generated token's logprob, with the likeliest alternatives (`top_logprobs`)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    """A chat choice's `logprobs`: one entry per generated token (per delta, streamed)."""

    content: list[ContentLogprob] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """A text completion's `logprobs`, in the legacy shape: parallel lists."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function a tool call calls; `arguments` is JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call of a non-streaming chat completion."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The generated message of a non-streaming chat completion (`tool_calls` only
    when it called tools; `content` is then null unless text came before the calls)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    #: The tier that served the request (OpenAI reports it on every response).
    service_tier: str | None = None


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a stream chunk adds to a tool call's function: its name first (with
    `arguments: ""`), then fragments of the arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a stream chunk adds to tool call `index` (its `id` and `type` come once,
    with the function's name)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a stream chunk adds to the message; absent fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """A choice of one chat stream chunk."""

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One `data:` line of a streaming chat completion; `usage` is set on the last only."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    """A choice of a text completion, streamed or not."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, kw_only=True):
    """A text completion, or one `data:` line of a streamed one (`usage` only at the end)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "yuebing"
    max_model_len: int = 0
    # Extension: token ids in 0..vocab_size-1 are valid in a token-id prompt.
    vocab_size: int = 0


class ModelList(msgspec.Struct, kw_only=True):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct, kw_only=True):
    """OpenAI's error object; every field is always present, `null` when unknown."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """`{"error": {...}}`: the body of every error response and SSE error event."""

    error: ErrorDetail
