"""The OpenAI wire format the gateway speaks, as msgspec structs.

Requests are decoded strictly (`msgspec.json.decode(..., strict=True)` by default), so
`"max_tokens": "10"` is a 400 rather than a silent coercion, and the decoder's error
names the offending field. Unknown fields are ignored: OpenAI clients send options
this server does not implement (`frequency_penalty`, `logit_bias`...) and rejecting
them would break those clients for no benefit.

Responses follow OpenAI's shapes field for field, including the `null`s clients look
for (`finish_reason: null` on intermediate chunks), so the structs that carry such
fields do not omit defaults.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# --- requests -----------------------------------------------------------------------

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a multi-part message; only `text` parts can be served here."""

    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options`: whether the stream ends with a usage chunk."""

    include_usage: bool = False


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions.

    Range checks live in the type (`Meta`), so the decoder reports them with the field's
    path; `n` is checked by the endpoint because its message must say that only 1 is
    supported, not merely that 2 is out of range.
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
    n: int = 1
    user: str | None = None
    # Extension: larger runs earlier when the conductor has to choose.
    priority: int = 0
    # Extension (vLLM's spelling): keep generating past end-of-sequence, up to
    # `max_tokens` (load generators need outputs of a known length).
    ignore_eos: bool = False


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    """`POST /v1/completions`: a text prompt or a list of token ids."""

    prompt: str | list[int]


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
