"""The `n` choices of one request, as their token chunks arrive.

Chunks carry their choice's `index`; each choice keeps its text, the content and tool
calls read from it (`structured.ToolCallParser`, when the request has tools), its
logprobs and its finish reason. `Choices.add` turns a chunk into the `ChoiceUpdate` a
stream frame shows; the whole answer is read from the states at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yb_core.protocol import TokenChunk, TokenLogprob
from yb_gateway.schemas import ToolCallDelta
from yb_gateway.structured import ToolCallParser, ToolMode, finish_reason


@dataclass(slots=True)
class ChoiceState:
    """One choice so far."""

    index: int
    parser: ToolCallParser | None
    text: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    counted_tokens: int = 0
    engine_finish: str | None = None
    #: Completions' `text_offset` of the next token.
    offset: int = 0

    def finish_reason(self, default: str = "stop") -> str:
        """OpenAI's finish reason: the engine's, `tool_calls` after calls."""
        return finish_reason(self.engine_finish or default, self.parser)


@dataclass(slots=True)
class ChoiceUpdate:
    """What one chunk added to its choice."""

    choice: ChoiceState
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to show (a chunk of tokens whose text is held back, or only counts)."""
        return not (self.content or self.tool_calls or self.logprobs)


class Choices:
    """The choices of one request, by index."""

    def __init__(self, n: int, tools: ToolMode) -> None:
        self._tools = tools
        self.states = [self._new(i) for i in range(n)]
        # The engine's running count over all choices (tokens a re-planned request's
        # client had before included), the authority when it sends one.
        self._reported_tokens = 0

    def _new(self, index: int) -> ChoiceState:
        parser = ToolCallParser(self._tools) if self._tools != "none" else None
        return ChoiceState(index, parser)

    def add(self, chunk: TokenChunk) -> ChoiceUpdate:
        """Fold `chunk` into its choice; what it adds."""
        while chunk.index >= len(self.states):  # an engine sending more than asked
            self.states.append(self._new(len(self.states)))
        state = self.states[chunk.index]
        update = ChoiceUpdate(state, logprobs=list(chunk.logprobs), finished=chunk.finished)
        state.counted_tokens += len(chunk.token_ids)
        self._reported_tokens = max(self._reported_tokens, chunk.completion_tokens)
        state.logprobs.extend(chunk.logprobs)
        if chunk.text:
            state.text.append(chunk.text)
            if state.parser is None:
                update.content = chunk.text
            else:
                parsed = state.parser.feed(chunk.text)
                update.content, update.tool_calls = parsed.content, parsed.tool_calls
            if update.content:
                state.content.append(update.content)
        if chunk.finished:
            state.engine_finish = chunk.finish_reason or "stop"
        return update

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return max(sum(s.counted_tokens for s in self.states), self._reported_tokens)
