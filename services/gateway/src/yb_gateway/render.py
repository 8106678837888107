"""The two OpenAI response dialects (chat and text completions), streamed or whole.

Both endpoints relay the same token stream; only the JSON around the text differs.
`ChatFormat` and `TextFormat` build that JSON, and the SSE framing is written here by
hand: OpenAI frames are `data: <json>\\n\\n`, errors are an `event: error` frame, and the
stream ends with `data: [DONE]`. Producing the bytes directly keeps the wire format
exactly OpenAI's and costs one JSON encode per token chunk.
"""

from __future__ import annotations

import abc
import time

import msgspec

from yb_gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ErrorBody,
    Usage,
)

SSE_DONE = b"data: [DONE]\n\n"

_json = msgspec.json.Encoder()


def sse_data(payload: msgspec.Struct) -> bytes:
    """One SSE `data:` frame holding `payload` as JSON (JSON never contains a newline)."""
    return b"data: " + _json.encode(payload) + b"\n\n"


def sse_error(error: ErrorBody) -> bytes:
    """An SSE error frame; OpenAI clients raise on any frame carrying `error`."""
    return b"event: error\ndata: " + _json.encode(error) + b"\n\n"


class ResponseFormat(abc.ABC):
    """How one request's answer is shaped."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def opening(self) -> bytes | None:
        """The frame sent before any text (chat announces the assistant's role)."""
        return None

    @abc.abstractmethod
    def delta(self, text: str, usage: Usage | None = None) -> bytes:
        """A frame carrying new text (and the counts so far, when asked for)."""

    @abc.abstractmethod
    def closing(self, finish_reason: str, usage: Usage | None = None) -> bytes:
        """The frame that says why generation stopped."""

    @abc.abstractmethod
    def usage_frame(self, usage: Usage) -> bytes:
        """The optional last frame with the token counts (`include_usage`)."""

    @abc.abstractmethod
    def whole(self, text: str, finish_reason: str, usage: Usage) -> bytes:
        """The non-streaming JSON body."""


class ChatFormat(ResponseFormat):
    """`/v1/chat/completions`."""

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_data(
            ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def opening(self) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])

    def delta(self, text: str, usage: Usage | None = None) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text))], usage)

    def closing(self, finish_reason: str, usage: Usage | None = None) -> bytes:
        choice = ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason)
        return self._chunk([choice], usage)

    def usage_frame(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> bytes:
        return _json.encode(
            ChatCompletion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
                ],
                usage=usage,
            )
        )


class TextFormat(ResponseFormat):
    """`/v1/completions`."""

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse_data(
            Completion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def delta(self, text: str, usage: Usage | None = None) -> bytes:
        return self._completion([CompletionChoice(text=text)], usage)

    def closing(self, finish_reason: str, usage: Usage | None = None) -> bytes:
        choice = CompletionChoice(text="", finish_reason=finish_reason)
        return self._completion([choice], usage)

    def usage_frame(self, usage: Usage) -> bytes:
        return self._completion([], usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> bytes:
        return _json.encode(
            Completion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
                usage=usage,
            )
        )
