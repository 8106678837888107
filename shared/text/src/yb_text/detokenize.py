"""Turning a growing list of token ids into text deltas, and cutting at stop strings.

Two problems, two small classes. A token is not a unit of text: a multi-byte character
can span tokens, and SentencePiece tokenizers decide a token's leading space from its
neighbour. `IncrementalDetokenizer` therefore re-decodes a short window and emits only
text that is complete. A stop string can also span tokens, so `StopStringFilter` holds
back any tail that could still become a stop string; the client never sees text that a
later token reveals to be the start of a stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded in front of the first generated token: enough for a tokenizer
# to decide on leading spaces and byte fallbacks, small enough to cost nothing.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Incremental decoding with a prefix/read offset window (as TGI and vLLM do).

    `push` returns the text a new token completes; text that ends in an incomplete
    UTF-8 sequence (decoded as U+FFFD) is held until the following tokens finish it.
    Special tokens (EOS, chat markers) produce no text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add a generated token; the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD); call at the end."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class StopStringFilter:
    """Passes text through until a stop string appears, never emitting any part of it.

    `feed` returns `(text safe to emit, stopped)`. A tail of the text that is a prefix of
    some stop string is held back; `flush` releases it when generation ends otherwise.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; what may be emitted now and whether a stop string was hit."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        # Everything emitted so far is free of stop prefixes, so any stop string that
        # is now complete lies wholly inside `buffer`; take the earliest one.
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Release held text: generation ended without completing a stop string."""
        held, self._held = self._held, ""
        return held
