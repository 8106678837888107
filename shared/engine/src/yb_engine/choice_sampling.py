"""One choice's sampling state, rebuilt from its parameters and its tokens, and the
batched step that processes logits, draws and reports logprobs.

What crosses the prefill → decode hand-off (and a re-plan's hand-off to new
instances) is the request's `SamplingParams` and the tokens generated so far, never
the state sampling built from them. `ChoiceState.rebuild` derives that state again:

- the random stream: `choice_generator(params, index)` and one skipped draw per
  generated token (every sampled token consumes exactly one uniform);
- the penalties' counts: how often the choice generated each token;
- the grammar's parse: a new llguidance matcher that consumed the generated tokens.

Rebuilding costs microseconds per token, and it keeps the wire format free of
library-specific state: an llguidance matcher has no serialized form, a torch
generator's state is 5 KB of Mersenne Twister, and both would tie the two engines to
one library version. The parameters and the tokens are what any engine already has.

Processing order, as vLLM and OpenAI apply it: penalties on the generated tokens'
counts, then `logit_bias`, then the grammar mask, then temperature/top-k/top-p and the
draw (`Sampler`). Logprobs are read from the raw logits, before any of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import llguidance
import llguidance.numpy
import numpy as np
import torch

from yb_core.protocol import SamplingParams, TokenLogprob
from yb_engine.sampling import Sampler, choice_generator, skip_draws
from yb_text.grammar import new_matcher


class GrammarViolation(ValueError):
    """Tokens given as generated that the choice's grammar refuses."""


class Sampled(NamedTuple):
    """One choice's token from one step, with its logprob when the request asked."""

    token_id: int
    logprob: TokenLogprob | None


@dataclass(eq=False)
class ChoiceState:
    """What sampling has built up for one choice: its stream, its penalty counts and
    its grammar's parse. Built by `rebuild`; advanced by `sample_choices`."""

    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]
    #: Counts of the generated tokens, when a penalty needs them.
    counts: Counter[int] | None = None
    matcher: llguidance.LLMatcher | None = None
    #: Tokens the matcher knows (the tokenizer's); logits beyond them are masked.
    grammar_vocab: int = 0
    #: The matcher refused a sampled token or allowed none: the choice must end.
    grammar_broken: bool = False
    _bias_ids: torch.Tensor | None = field(default=None, repr=False)
    _bias_values: torch.Tensor | None = field(default=None, repr=False)
    _bitmask: np.ndarray[Any, np.dtype[np.int32]] | None = field(default=None, repr=False)
    _eos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @classmethod
    def rebuild(
        cls,
        params: SamplingParams,
        generated: Sequence[int] = (),
        *,
        index: int = 0,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
    ) -> ChoiceState:
        """The state of choice `index` after it generated `generated`.

        `tokenizer` is needed only with a grammar. Raises `GrammarViolation` if the
        grammar refuses `generated` (they were not generated under it).
        """
        generator = choice_generator(params, index)
        skip_draws(generator, len(generated))
        state = cls(params, generator, frozenset(eos_token_ids))
        if params.presence_penalty or params.frequency_penalty:
            state.counts = Counter(generated)
        if params.logit_bias:
            ids, values = zip(*sorted(params.logit_bias.items()), strict=True)
            state._bias_ids = torch.tensor(ids, dtype=torch.long)
            state._bias_values = torch.tensor(values, dtype=torch.float32)
        if params.grammar:
            if tokenizer is None:
                raise ValueError("a grammar needs the tokenizer")
            state.matcher = new_matcher(params.grammar, tokenizer)
            state.grammar_vocab = len(tokenizer)
            state._bitmask = llguidance.numpy.allocate_token_bitmask(1, state.grammar_vocab)
            state._eos = torch.tensor(
                sorted(t for t in state.eos_token_ids if t < state.grammar_vocab),
                dtype=torch.long,
            )
            for token in generated:
                if not state._advance_matcher(token):
                    raise GrammarViolation(
                        f"generated token {token} refused: {state.matcher.get_error()}"
                    )
        return state

    @property
    def processes_logits(self) -> bool:
        """Whether this choice changes its logits before the draw (else they are used
        as the model gave them, at no extra cost)."""
        return self.counts is not None or self._bias_ids is not None or self.matcher is not None

    @property
    def grammar_finished(self) -> bool:
        """The grammar is complete and allows nothing more: the choice ends ("stop")."""
        return self.matcher is not None and (self.grammar_broken or self.matcher.is_stopped())

    def accept(self, token: int) -> None:
        """Account for a token this choice generated."""
        if self.counts is not None:
            self.counts[token] += 1
        # A masked draw cannot pick a refused token; should the matcher refuse one all
        # the same, the choice ends rather than the batch it shares a step with.
        if self.matcher is not None and not self._advance_matcher(token):
            self.grammar_broken = True

    def _advance_matcher(self, token: int) -> bool:
        """Feed the matcher a generated token; False if it refuses it."""
        assert self.matcher is not None
        # EOS ends the choice; the masks allowed it only where the grammar accepts,
        # and the matcher's own idea of EOS may be another token.
        if token in self.eos_token_ids or self.matcher.is_stopped():
            return True
        return bool(self.matcher.consume_token(token))

    def process(self, row: torch.Tensor) -> None:
        """Penalties, bias and grammar mask, in place on one float32 row of logits."""
        vocab = row.shape[0]
        params = self.params
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            ids_in = ids < vocab
            ids = ids[ids_in]
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)[ids_in]
            row.index_add_(0, ids, -(params.frequency_penalty * counts + params.presence_penalty))
        if self._bias_ids is not None and self._bias_values is not None:
            keep = self._bias_ids < vocab
            row.index_add_(0, self._bias_ids[keep], self._bias_values[keep])
        if self.matcher is not None:
            self._mask(row)

    def _mask(self, row: torch.Tensor) -> None:
        """Keep only the tokens the grammar allows next; EOS only where it accepts."""
        assert self.matcher is not None and self._bitmask is not None
        n = min(self.grammar_vocab, row.shape[0])
        eos_logits = row.index_select(0, self._eos)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        # Bit k of int32 word w is token 32w + k: on a little-endian machine, bit k % 8
        # of byte 4w + k // 8, which is what unpackbits' little bit order lists.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:n]
        refused = bits == 0
        row[:n].masked_fill_(torch.from_numpy(refused), float("-inf"))
        if n < row.shape[0]:
            row[n:] = float("-inf")  # ids the tokenizer does not have
        if len(self._eos):
            if self.matcher.is_accepting():
                row.index_copy_(0, self._eos, eos_logits)
                return
            row.index_fill_(0, self._eos, float("-inf"))
            refused[self._eos.numpy()] = True
            if refused.all():
                # Nothing allowed (a matcher in error): end the choice with EOS rather
                # than draw from nothing.
                self.grammar_broken = True
                row.index_copy_(0, self._eos, eos_logits)


def sample_choices(
    logits: torch.Tensor, states: Sequence[ChoiceState], sampler: Sampler | None = None
) -> list[Sampled]:
    """One token per row of `logits` `[B, vocab]`, row i drawn for `states[i]`, which
    it advances; with its logprob when that choice's request asked for them.

    Rows whose choice processes nothing are sampled from the logits as they are; only
    the others are copied and processed.
    """
    if len(states) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(states)} states")
    processed = logits
    rows = [i for i, s in enumerate(states) if s.processes_logits]
    if rows:
        processed = logits.float().clone()
        for i in rows:
            states[i].process(processed[i])
    tokens = (sampler or Sampler()).sample(
        processed, [s.params for s in states], [s.generator for s in states]
    )
    logprobs = _logprobs(logits, tokens, states)
    for state, token in zip(states, tokens, strict=True):
        state.accept(token)
    return [Sampled(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]


def sample_first_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generated: Sequence[int] = (),
    *,
    tokenizer: Any = None,
    eos_token_ids: Iterable[int] = (),
    sampler: Sampler | None = None,
) -> list[Sampled]:
    """Each of the request's `n` choices' next token after a prefill, from the prompt's
    last row of logits `[vocab]`; `generated` are the prompt's last tokens that were
    output already (a re-planned request resumes after them)."""
    states = [
        ChoiceState.rebuild(
            params, generated, index=i, tokenizer=tokenizer, eos_token_ids=eos_token_ids
        )
        for i in range(params.n)
    ]
    return sample_choices(logits[None].expand(params.n, -1), states, sampler)


def _logprobs(
    logits: torch.Tensor, tokens: list[int], states: Sequence[ChoiceState]
) -> list[TokenLogprob | None]:
    """The chosen tokens' logprobs and top alternatives, from the raw distribution."""
    out: list[TokenLogprob | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows])).view(-1).tolist()
    top_k = max(states[i].params.logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if top_k:
        values, ids = logp.topk(min(top_k, logp.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        top = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        out[i] = TokenLogprob(token_id=tokens[i], logprob=chosen[j], top=top)
    return out
