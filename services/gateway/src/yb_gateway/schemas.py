"""The OpenAI wire format the gateway speaks, as msgspec structs.

Requests are decoded strictly (`msgspec.json.decode(..., strict=True)` by default), so
`"max_tokens": "10"` is a 400 rather than a silent coercion, and the decoder's error
names the offending field. Nothing a client sends is silently ignored: a client that
asks for JSON mode or tools and gets plain text would believe it got what it asked for.
So every request struct forbids unknown fields, and each field that OpenAI (or vLLM,
whose extensions load generators send) defines but this server does not implement is
declared with a type that admits only its neutral values: what asks for nothing
(`n: 1`, `presence_penalty: 0`, `tools: []`, null), which clients may send as defaults.
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
_Zero = Annotated[float, msgspec.Meta(ge=0.0, le=0.0)]
_One = Annotated[float, msgspec.Meta(ge=1.0, le=1.0)]
_EmptyList = Annotated[list[Any], msgspec.Meta(max_length=0)]
_EmptyMap = Annotated[dict[str, Any], msgspec.Meta(max_length=0)]


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


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Refused: tool calls and their results, audio, refusals.
    tool_calls: _EmptyList | None = None
    tool_call_id: None = None
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


class TextResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format: {"type": "text"}`, the only one served: unconstrained text."""

    type: Literal["text"]


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
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extension: larger runs earlier when the conductor has to choose.
    priority: int = 0
    # Extension (vLLM's spelling): keep generating past end-of-sequence, up to
    # `max_tokens` (load generators need outputs of a known length).
    ignore_eos: bool = False
    # Refused (see `REFUSED_FIELDS`).
    n: Literal[1] | None = 1
    presence_penalty: _Zero | None = None
    frequency_penalty: _Zero | None = None
    logit_bias: _EmptyMap | None = None
    repetition_penalty: _One | None = None  # vLLM's


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Refused (see `REFUSED_FIELDS`).
    logprobs: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    response_format: TextResponseFormat | None = None
    tools: _EmptyList | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: None = None
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
    service_tier: Literal["auto", "default"] | None = None
    store: Literal[False] | None = None
    metadata: _EmptyMap | None = None
    moderation: None = None
    prompt_cache_key: None = None
    prompt_cache_options: None = None
    prompt_cache_retention: None = None
    safety_identifier: None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/completions`: a text prompt or a list of token ids."""

    prompt: str | list[int]
    # Refused (see `REFUSED_FIELDS`).
    logprobs: None = None
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None


class Refused(NamedTuple):
    """A request field this server does not implement, and what of it is accepted."""

    accepts: str
    """The neutral values that pass, as the error message and the docs show them."""
    defined_by: str = "OpenAI"


_NULL = Refused("`null`")

_REFUSED_COMMON: dict[str, Refused] = {
    "n": Refused("`1` or `null`"),
    "presence_penalty": Refused("`0` or `null`"),
    "frequency_penalty": Refused("`0` or `null`"),
    "logit_bias": Refused("`{}` or `null`"),
    "repetition_penalty": Refused("`1` or `null`", "vLLM"),
    "stream_options.include_obfuscation": Refused("`false` or `null`"),
}

# Keys are field paths without list indices (`messages.tool_calls` stands for
# `messages[i].tool_calls`); a refused field's nested fields are refused with it.
REFUSED_FIELDS: Mapping[type[msgspec.Struct], Mapping[str, Refused]] = {
    ChatCompletionRequest: {
        **_REFUSED_COMMON,
        "logprobs": Refused("`false` or `null`"),
        "top_logprobs": Refused("`0` or `null`"),
        "response_format": Refused('`{"type": "text"}` or `null`'),
        "tools": Refused("`[]` or `null`"),
        "tool_choice": Refused('`"none"` or `null`'),
        "parallel_tool_calls": _NULL,
        "functions": Refused("`[]` or `null`"),
        "function_call": Refused('`"none"` or `null`'),
        "modalities": Refused('`["text"]` or `null`'),
        "audio": _NULL,
        "prediction": _NULL,
        "reasoning_effort": _NULL,
        "verbosity": _NULL,
        "web_search_options": _NULL,
        "service_tier": Refused('`"auto"`, `"default"` or `null`'),
        "store": Refused("`false` or `null`"),
        "metadata": Refused("`{}` or `null`"),
        "moderation": _NULL,
        "prompt_cache_key": _NULL,
        "prompt_cache_options": _NULL,
        "prompt_cache_retention": _NULL,
        "safety_identifier": _NULL,
        "messages.tool_calls": Refused("`[]` or `null`"),
        "messages.tool_call_id": _NULL,
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
        "logprobs": _NULL,
        "echo": Refused("`false` or `null`"),
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


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The generated message of a non-streaming chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(msgspec.Struct, kw_only=True):
    """The one choice of a chat completion (`n` is always 1 here)."""

    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a stream chunk adds to the message; absent fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """The choice of one chat stream chunk."""

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One `data:` line of a streaming chat completion; `usage` is set on the last only."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    """The one choice of a text completion, streamed or not."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(msgspec.Struct, kw_only=True):
    """A text completion, or one `data:` line of a streamed one (`usage` only at the end)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
