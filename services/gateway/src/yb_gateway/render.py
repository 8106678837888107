"""The two OpenAI response dialects (chat and text completions), streamed or whole.

Both endpoints relay the same token stream; only the JSON around the text differs.
Each frame carries one choice's update (`choices.ChoiceUpdate`); with `n` > 1 the
choices' frames interleave as their chunks arrive, told apart by `index`.
`ChatFormat` and `TextFormat` build that JSON, and the SSE framing is written here by
hand: OpenAI frames are `data: <json>\\n\\n`, errors are an `event: error` frame, and the
stream ends with `data: [DONE]`. Producing the bytes directly keeps the wire format
exactly OpenAI's and costs one JSON encode per token chunk.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence

import msgspec

from yb_core.protocol import TokenLogprob
from yb_gateway.choices import ChoiceState, ChoiceUpdate
from yb_gateway.logprobs import (
    TokenTable,
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_logprobs,
)
from yb_gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
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
    """How one request's answer is shaped.

    `logprobs` (the number of alternatives per token, None for no logprobs), `tokens`
    (their text), `echoes` (each prompt's echoed text, None without `echo`) and `n`
    (choices per prompt: choice i answers prompt i // n) are the request's, set once
    it is prepared, as is `service_tier`, the tier that serves it, which every frame
    and the whole body report (as OpenAI's do).
    """

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs: int | None = None
        self.tokens: TokenTable | None = None
        self.echoes: list[str | None] = [None]
        self.n = 1
        self.service_tier: str | None = None

    def prepared(
        self,
        logprobs: int | None,
        tokens: TokenTable,
        echo: str | Sequence[str | None] | None,
        n: int = 1,
        *,
        service_tier: str | None = None,
    ) -> None:
        """Set what the request asked for that changes its shape (`echo`: the one
        prompt's echoed text, or each prompt's) and the tier that serves it."""
        self.logprobs, self.tokens, self.n = logprobs, tokens, n
        self.service_tier = service_tier
        self.echoes = [echo] if echo is None or isinstance(echo, str) else list(echo)

    def echo_of(self, index: int) -> str:
        """The text choice `index` starts with ("" without `echo`)."""
        prompt = index // self.n
        return (self.echoes[prompt] if prompt < len(self.echoes) else None) or ""

    def opening(self, n: int = 1) -> bytes | None:
        """The frames sent before any text (chat announces the assistant's role, a
        text completion echoes the prompts that wait for nothing: `open_prompt`)."""
        return None

    def prompt_in(self, prompt: int, token_ids: list[int], entries: list[TokenLogprob]) -> None:
        """Prompt `prompt`'s own logprobs are in (`entries`: those of tokens 1..n-1 of
        `token_ids`); only `echo` with `logprobs` asks for them."""
        return None

    def open_prompt(self, prompt: int) -> bytes:
        """The frames that open the choices of `prompt` once its logprobs are in, for a
        request whose choices wait for them (nothing otherwise)."""
        return b""

    @abc.abstractmethod
    def delta(self, update: ChoiceUpdate, usage: Usage | None = None) -> bytes:
        """A frame carrying what one chunk added to a choice (and the counts so far,
        when asked for)."""

    @abc.abstractmethod
    def closing(self, index: int, finish_reason: str, usage: Usage | None = None) -> bytes:
        """The frame that says why choice `index` stopped."""

    @abc.abstractmethod
    def usage_frame(self, usage: Usage) -> bytes:
        """The optional last frame with the token counts (`include_usage`)."""

    @abc.abstractmethod
    def whole(self, choices: list[ChoiceState], default_finish: str, usage: Usage) -> bytes:
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
                service_tier=self.service_tier,
            )
        )

    def _logprobs(self, entries: list[TokenLogprob]) -> ChoiceLogprobs | None:
        if self.logprobs is None or self.tokens is None:
            return None
        return chat_logprobs(self.tokens, entries, self.logprobs)

    def opening(self, n: int = 1) -> bytes:
        return b"".join(
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(n)
        )

    def delta(self, update: ChoiceUpdate, usage: Usage | None = None) -> bytes:
        delta = ChatDelta(content=update.content or None, tool_calls=update.tool_calls or None)
        choice = ChatChunkChoice(
            index=update.choice.index, delta=delta, logprobs=self._logprobs(update.logprobs)
        )
        return self._chunk([choice], usage)

    def closing(self, index: int, finish_reason: str, usage: Usage | None = None) -> bytes:
        choice = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason)
        return self._chunk([choice], usage)

    def usage_frame(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def whole(self, choices: list[ChoiceState], default_finish: str, usage: Usage) -> bytes:
        out = []
        for state in choices:
            calls = state.parser.tool_calls() if state.parser is not None else []
            content = "".join(state.content)
            message = AssistantMessage(
                role="assistant",
                content=content if content or not calls else None,
                tool_calls=calls or None,
            )
            out.append(
                ChatChoice(
                    index=state.index,
                    message=message,
                    finish_reason=state.finish_reason(default_finish),
                    logprobs=self._logprobs(state.logprobs),
                )
            )
        return _json.encode(
            ChatCompletion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=out,
                usage=usage,
                service_tier=self.service_tier,
            )
        )


class TextFormat(ResponseFormat):
    """`/v1/completions`."""

    def __init__(self, request_id: str, model: str) -> None:
        super().__init__(request_id, model)
        #: Each prompt's own logprobs, rendered (`echo` with `logprobs`), once in.
        self.prompt_parts: dict[int, CompletionLogprobs] = {}

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse_data(
            Completion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
                service_tier=self.service_tier,
            )
        )

    @property
    def waits_for_prompts(self) -> bool:
        """Whether each prompt's choices open only once its logprobs are in (`echo`
        with `logprobs`)."""
        return self.logprobs is not None and any(e is not None for e in self.echoes)

    def _logprobs(
        self, state: ChoiceState, entries: list[TokenLogprob]
    ) -> CompletionLogprobs | None:
        if self.logprobs is None or self.tokens is None:
            return None
        if not state.offset and (echo := self.echo_of(state.index)):
            state.offset = len(echo)  # offsets count in the choice's whole text
        rendered, state.offset = completion_logprobs(
            self.tokens, entries, self.logprobs, state.offset
        )
        return rendered

    def opening(self, n: int = 1) -> bytes | None:
        if self.waits_for_prompts:
            return None
        frames = [
            self._completion([CompletionChoice(index=i, text=echo)])
            for i in range(n)
            if (echo := self.echo_of(i))
        ]
        return b"".join(frames) or None

    def prompt_in(self, prompt: int, token_ids: list[int], entries: list[TokenLogprob]) -> None:
        if self.tokens is None or self.logprobs is None:
            return
        self.prompt_parts[prompt] = prompt_logprobs(self.tokens, token_ids, entries, self.logprobs)

    def open_prompt(self, prompt: int) -> bytes:
        part = self.prompt_parts.get(prompt)
        first = prompt * self.n
        return b"".join(
            self._completion([CompletionChoice(index=i, text=self.echo_of(i), logprobs=part)])
            for i in range(first, first + self.n)
        )

    def delta(self, update: ChoiceUpdate, usage: Usage | None = None) -> bytes:
        state = update.choice
        choice = CompletionChoice(
            index=state.index, text=update.content, logprobs=self._logprobs(state, update.logprobs)
        )
        return self._completion([choice], usage)

    def closing(self, index: int, finish_reason: str, usage: Usage | None = None) -> bytes:
        choice = CompletionChoice(index=index, text="", finish_reason=finish_reason)
        return self._completion([choice], usage)

    def usage_frame(self, usage: Usage) -> bytes:
        return self._completion([], usage)

    def whole(self, choices: list[ChoiceState], default_finish: str, usage: Usage) -> bytes:
        out = []
        for state in choices:
            logprobs = self._logprobs(state, state.logprobs)
            prompt_part = self.prompt_parts.get(state.index // self.n)
            if prompt_part is not None:
                logprobs = joined(prompt_part, logprobs)
            out.append(
                CompletionChoice(
                    index=state.index,
                    text=self.echo_of(state.index) + "".join(state.content),
                    finish_reason=state.finish_reason(default_finish),
                    logprobs=logprobs,
                )
            )
        return _json.encode(
            Completion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=out,
                usage=usage,
                service_tier=self.service_tier,
            )
        )
