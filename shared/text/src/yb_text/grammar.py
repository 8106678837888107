"""Grammars that hold generated text to a structure, on llguidance.

llguidance (guidance-ai's Rust engine, a backend of vLLM and SGLang) is the one
structured-generation library here: its wheel has no dependencies, it compiles JSON
schemas (strict included), Lark grammars and regexes, and computes a token mask in tens
of microseconds without a warm-up compile. Its matchers consume tokens one at a time and
can be rebuilt from the tokens generated so far, which is how a grammar's state crosses
from prefill to decode without being serialized.

A grammar travels as llguidance's own JSON text (`SamplingParams.grammar`): the gateway
builds and checks it against the served tokenizer, the engines only match it.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import llguidance

#: Tokenizer wrappers by the transformers tokenizer they wrap (building one takes ~0.4 s).
_wrapped: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


#: JSON as models write it (`{"a": 1, "b": 2}`), with no freedom in between: a model
#: held to a schema cannot stall in an endless run of blanks.
_JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile for this tokenizer; the message says why."""


def grammar_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers fast tokenizer, built once per tokenizer."""
    wrapped = _wrapped.get(tokenizer)
    if wrapped is None:
        # Here, not at the top: llguidance.hf imports transformers, which the gateway's
        # request path must not pay for just to build a grammar.
        import llguidance.hf

        wrapped = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        _wrapped[tokenizer] = wrapped
    return wrapped


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """A grammar for one JSON value following `schema` (any JSON object when None).

    The schema itself is checked by `check_grammar`.
    """
    body = {"type": "object"} if schema is None else schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(body), overrides=_JSON_LAYOUT
        )
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def lark_grammar(lark: str) -> str:
    """A grammar from Lark text (llguidance's dialect, which embeds JSON schemas with
    `%json { ... }`)."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def check_grammar(grammar: str, tokenizer: Any) -> None:
    """Raise `GrammarError` unless `grammar` compiles for `tokenizer`."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, grammar_tokenizer(tokenizer)
    )
    if is_error:
        raise GrammarError(messages[0])


def new_matcher(grammar: str, tokenizer: Any) -> llguidance.LLMatcher:
    """A matcher at the grammar's start; `GrammarError` if it does not compile."""
    # Quiet: a token the grammar refuses is an error state the caller reads, not a
    # warning on stderr.
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return matcher
