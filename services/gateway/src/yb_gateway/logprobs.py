"""Log-probabilities as OpenAI renders them, from the engines' `TokenLogprob`s.

Engines send token ids and numbers; the text of each token is the gateway's to add. A
token's `bytes` are its real bytes (byte-level BPE: one token may hold part of a UTF-8
character), read once per vocabulary from llguidance's view of the tokenizer; its
`token` is those bytes decoded, a broken character replaced by U+FFFD.
"""

from __future__ import annotations

import math
from typing import Any

from yb_core.protocol import TokenLogprob
from yb_gateway.schemas import ChoiceLogprobs, CompletionLogprobs, ContentLogprob, TopLogprob
from yb_text.grammar import grammar_tokenizer

#: What a logprob of -inf (a token the grammar or a bias ruled out) is shown as: JSON
#: has no infinity, and OpenAI's clients expect a number.
FLOOR = -9999.0


class TokenTable:
    """Every token id's bytes and text."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self._text = [b.decode("utf-8", errors="replace") for b in token_bytes]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenTable:
        """The table of a transformers tokenizer (tens of milliseconds for 50k tokens)."""
        wrapped = grammar_tokenizer(tokenizer)
        return cls([wrapped.decode_bytes([i]) for i in range(len(tokenizer))])

    def text(self, token_id: int) -> str:
        """The token's text ("" for an id outside the tokenizer's vocabulary)."""
        return self._text[token_id] if 0 <= token_id < len(self._text) else ""

    def raw(self, token_id: int) -> list[int]:
        """The token's bytes, as the list of integers OpenAI sends."""
        return list(self._bytes[token_id]) if 0 <= token_id < len(self._bytes) else []


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(table: TokenTable, entries: list[TokenLogprob], top: int) -> ChoiceLogprobs:
    """`choices[].logprobs` of a chat completion for `entries` (a delta's, or all)."""
    return ChoiceLogprobs(
        content=[
            ContentLogprob(
                token=table.text(e.token_id),
                logprob=_number(e.logprob),
                bytes=table.raw(e.token_id),
                top_logprobs=[
                    TopLogprob(token=table.text(tid), logprob=_number(lp), bytes=table.raw(tid))
                    for tid, lp in e.top[:top]
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(
    table: TokenTable, entries: list[TokenLogprob], top: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """`choices[].logprobs` of a text completion for `entries`, whose first token starts
    at character `offset` of the choice's text; and the offset after the last token.

    `top_logprobs` holds the `top` likeliest tokens and the sampled one, as OpenAI's
    legacy format does.
    """
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text = table.text(e.token_id)
        tokens.append(text)
        values.append(_number(e.logprob))
        alternatives = {table.text(tid): _number(lp) for tid, lp in e.top[:top]}
        alternatives.setdefault(text, _number(e.logprob))
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    lp: list[float | None] = list(values)
    top_maps: list[dict[str, float] | None] = list(tops)
    return (
        CompletionLogprobs(
            tokens=tokens, token_logprobs=lp, top_logprobs=top_maps, text_offset=offsets
        ),
        offset,
    )


def prompt_logprobs(
    table: TokenTable, token_ids: list[int], entries: list[TokenLogprob], top: int
) -> CompletionLogprobs:
    """The prompt's part of a text completion's `logprobs` (`echo` with `logprobs`):
    every prompt token, the first with `null` (nothing precedes it), each after it with
    its logprob and alternatives from `entries` (prompt tokens 1..n-1, in order), as
    `completion_logprobs` renders a generated token's. `text_offset` counts from the
    start of the echoed text."""
    tokens = [table.text(t) for t in token_ids]
    values: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for token, e in zip(tokens[1:], entries, strict=True):
        values.append(_number(e.logprob))
        alternatives = {table.text(tid): _number(lp) for tid, lp in e.top[:top]}
        alternatives.setdefault(token, _number(e.logprob))
        tops.append(alternatives)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    """`first`'s tokens followed by `then`'s (the prompt's, then the generated ones)."""
    if then is None:
        return first
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )
