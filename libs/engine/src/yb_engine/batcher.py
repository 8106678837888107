"""Continuous batching for a decode engine, as a narrow synchronous interface.

The engine calls `add` when a request's prompt KV has landed in its pages, and `step`
in a loop; each `step` runs one decode step for every running request and returns what
each produced. No threads, no clock inside: tests drive it step by step, and the
service wraps it in whatever loop or executor it likes (like vLLM v1's scheduler).

Policy decisions, stated once:

- **The first token.** Prefill samples the first token; `add` takes it. The next `step`
  reports it (as that request's first `TokenOutput`) and, in the same step, feeds it to
  the model, reporting the second token too. A request's outputs are always in order,
  and no step is spent on a token that is already known.
- **Choices.** A request with `n` > 1 decodes as n choices (`TokenOutput.index`), each
  finishing on its own. They share the prompt's full pages (refcounted: freed when the
  last choice holding one ends); choices 1..n-1 get their own copy of the last, partly
  filled prompt page before they write to it.
- **Admission.** At most `max_batch_size` choices decode together; more wait, higher
  `priority` first, then first in first out, with their KV parked in their pages
  (their first token is reported anyway, so time to first token does not depend on a
  free slot).
- **Running out of KV pages.** A choice that needs a new page when none is free does
  not wait (a decode engine cannot make room by recomputing, and waiting requests that
  hold pages could deadlock each other). The running choice of lowest priority, the
  newest among those, is finished with `finish_reason="kv_exhausted"` and a message,
  and its pages go to the others; repeated until the page is found or the one asking
  is that victim. Nothing is ever written to a page the choice does not own.
- **Sampling state is rebuilt, not received** (see `choice_sampling`): from the
  parameters and the tokens generated before (`generated_tokens` of a resumed request,
  then the first token prefill drew), the batcher derives the random stream's
  position, the penalties' counts and the grammar's parse, so a request gives the
  tokens one engine running it whole would.
- **Resuming** (`generated_tokens` = k): the prompt's last k tokens are output the
  client has. They are replayed through the detokenizer and the stop filter without
  being reported, and they count towards `max_tokens`.
- **Pages are owned from `add` on.** The batcher frees a request's pages when it finishes
  for any reason, including `abort`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from yb_core.protocol import SamplingParams, TokenLogprob
from yb_engine.choice_sampling import ChoiceState, sample_choices
from yb_engine.kv_cache import OutOfPages, PageAllocator
from yb_engine.runner import DecodeSeq, ModelRunner
from yb_engine.sampling import Sampler
from yb_text.detokenize import IncrementalDetokenizer, StopStringFilter

FinishReason = Literal["stop", "length", "abort", "kv_exhausted"]


class TokenOutput(msgspec.Struct, frozen=True, gc=False):
    """One request's news from one step.

    `token_id` is the generated token; None on an output that only reports an end
    (abort, kv_exhausted), which carries no new token. `text_delta` is the text to
    append (it may be empty while a character or a possible stop string is incomplete,
    and never contains a stop string). `message` explains abnormal ends.
    """

    request_id: str
    token_id: int | None
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None = None
    message: str | None = None
    #: The choice (0..n-1) this output is about.
    index: int = 0
    #: The token's logprob, when the request asked for them.
    logprob: TokenLogprob | None = None


@dataclass(eq=False)
class _Request:
    """One choice of a request being decoded."""

    request_id: str
    index: int
    order: int
    priority: int
    prompt_len: int  # the client's prompt: without a resumed request's output
    block_table: list[int]
    params: SamplingParams
    state: ChoiceState
    detok: IncrementalDetokenizer
    stops: StopStringFilter
    last_token: int
    first_logprob: TokenLogprob | None
    num_generated: int = 1  # the first token, sampled by prefill, counts
    first_reported: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def next_position(self) -> int:
        """Where the last generated token is fed (its KV written) by the next step."""
        return self.prompt_len + self.num_generated - 1


class DecodeBatcher:
    """Continuous batching over a `ModelRunner`; see the module doc for the policies."""

    def __init__(
        self,
        runner: ModelRunner,
        allocator: PageAllocator,
        tokenizer: Any,
        max_batch_size: int,
        sampler: Sampler | None = None,
    ) -> None:
        if max_batch_size <= 0:
            raise ValueError("max_batch_size must be positive")
        self.runner = runner
        self.allocator = allocator
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.sampler = sampler or Sampler()
        self.block_size = runner.cache.block_size
        self.max_position = runner.arch.max_position
        self.eos_token_ids = frozenset(runner.arch.eos_token_ids)
        self._requests: dict[tuple[str, int], _Request] = {}
        self._running: list[_Request] = []
        self._waiting: list[_Request] = []
        # Prompt pages that several choices of one request read, and how many do.
        self._page_refs: dict[int, int] = {}
        self._pending: list[TokenOutput] = []
        # Requests left out of the steps, pages kept (a test's failpoint holds them).
        self._parked: set[str] = set()
        self._order = itertools.count()
        self.last_step_seconds = 0.0

    # -- introspection ----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the decode batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests holding KV, waiting for a batch slot."""
        return len(self._waiting)

    @property
    def kv_pages_used(self) -> int:
        """Pages held by this batcher's requests (running and waiting; a shared page
        once)."""
        return len({p for r in self._requests.values() for p in r.block_table})

    def has_work(self) -> bool:
        """Whether `step` would do or report anything (a parked request does not)."""
        return bool(self._pending) or any(
            r.request_id not in self._parked for r in self._requests.values()
        )

    def copies_needed(self, prompt_len: int, n: int) -> int:
        """Pages `add` needs besides the prompt's for `n` choices: a copy of the last,
        partly filled prompt page for each choice but the first."""
        return (n - 1) if n > 1 and prompt_len % self.block_size else 0

    # -- requests ---------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        block_table: list[int],
        first_token: int,
        params: SamplingParams,
        *,
        first_tokens: list[int] | None = None,
        first_logprobs: list[TokenLogprob] | None = None,
        generated_tokens: int = 0,
        priority: int = 0,
        copy_pages: list[int] | None = None,
    ) -> None:
        """Take over a prefilled request: its prompt KV is in `block_table`'s pages.

        `first_tokens` are the `params.n` choices' first tokens (`[first_token]` when
        None), `first_logprobs` their logprobs when asked. The last `generated_tokens`
        of `prompt_token_ids` are output the client already has. `copy_pages` are the
        pages set aside for the choices' copies of the last prompt page
        (`copies_needed`; allocated here when None).

        From here on the batcher owns all those pages (and frees them when the
        request ends). On a ValueError nothing is taken over.
        """
        if any(key[0] == request_id for key in self._requests):
            raise ValueError(f"request {request_id!r} is already being decoded")
        firsts = list(first_tokens) if first_tokens else [first_token]
        n = params.n
        if len(firsts) != n:
            raise ValueError(f"{len(firsts)} first tokens for n = {n}")
        if first_logprobs and len(first_logprobs) != n:
            raise ValueError(f"{len(first_logprobs)} first logprobs for n = {n}")
        if not 0 <= generated_tokens < len(prompt_token_ids):
            raise ValueError(f"generated_tokens {generated_tokens} out of range")
        if generated_tokens and n > 1:
            raise ValueError("a request with n > 1 cannot resume")
        if params.max_tokens < generated_tokens + 1:
            raise ValueError("max_tokens must leave room for the first token (it counts)")
        prompt_len = len(prompt_token_ids)
        if len(block_table) * self.block_size < prompt_len:
            raise ValueError(
                f"{len(block_table)} pages of {self.block_size} cannot hold {prompt_len} tokens"
            )
        original = prompt_token_ids[: prompt_len - generated_tokens]
        generated = prompt_token_ids[prompt_len - generated_tokens :]
        states = [
            ChoiceState.rebuild(
                params,
                [*generated, first],
                index=i,
                tokenizer=self.tokenizer,
                eos_token_ids=self.eos_token_ids,
            )
            for i, first in enumerate(firsts)
        ]
        tables = self._choice_tables(prompt_len, block_table, n, copy_pages)
        for i, (first, state, table) in enumerate(zip(firsts, states, tables, strict=True)):
            detok = IncrementalDetokenizer(self.tokenizer, original)
            stops = StopStringFilter(params.stop)
            # The client has these tokens' text already: replayed for the state they
            # leave (an incomplete character, a held-back stop prefix), not reported.
            for token in generated:
                stops.feed(detok.push(token))
            req = _Request(
                request_id=request_id,
                index=i,
                order=next(self._order),
                priority=priority,
                prompt_len=len(original),
                block_table=table,
                params=params,
                state=state,
                detok=detok,
                stops=stops,
                last_token=first,
                first_logprob=first_logprobs[i] if first_logprobs else None,
                num_generated=generated_tokens + 1,
            )
            self._requests[req.key] = req
            self._waiting.append(req)

    def _choice_tables(
        self, prompt_len: int, block_table: list[int], n: int, copy_pages: list[int] | None
    ) -> list[list[int]]:
        """Each choice's block table: the prompt's full pages shared, the partly
        filled last one copied for choices 1..n-1 (its KV in every layer)."""
        if n == 1:
            return [list(block_table)]
        copies = self.copies_needed(prompt_len, n)
        if copy_pages is None:
            try:
                copy_pages = self.allocator.allocate(copies)
            except OutOfPages as exc:
                raise ValueError(f"no pages for {n} choices: {exc}") from exc
        elif len(copy_pages) != copies:
            raise ValueError(f"{len(copy_pages)} copy pages for {copies} copies")
        full = prompt_len // self.block_size
        shared = block_table[:full]
        for page in shared:
            self._page_refs[page] = n
        tables = [list(block_table)]
        for copy in copy_pages:
            self.runner.cache.copy_page(block_table[full], copy)
            tables.append([*shared, copy])
        while len(tables) < n:
            tables.append(list(shared))
        return tables

    def abort(self, request_id: str) -> bool:
        """End a request now and free its pages; the next `step` reports it.

        False if the request is unknown or already finished.
        """
        choices = [r for r in self._requests.values() if r.request_id == request_id]
        for req in choices:
            self._finish(req)
            self._pending.append(TokenOutput(request_id, None, "", True, "abort", index=req.index))
        return bool(choices)

    def discard(self, request_id: str) -> bool:
        """End a request now and free its pages, reporting nothing (its client reads
        another attempt of it). False if the request is unknown."""
        choices = [r for r in self._requests.values() if r.request_id == request_id]
        for req in choices:
            self._finish(req)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return bool(choices)

    def park(self, request_id: str) -> bool:
        """Leave a running request out of the steps until `unpark`; it keeps its pages,
        its KV and its batch slot, and `abort` still ends it. False if unknown."""
        if not any(key[0] == request_id for key in self._requests):
            return False
        self._parked.add(request_id)
        return True

    def unpark(self, request_id: str) -> None:
        """Let a parked request step again (nothing if it is not parked)."""
        self._parked.discard(request_id)

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """Report new first tokens, run one decode step, report what it produced."""
        started = time.perf_counter()
        outputs, self._pending = self._pending, []
        for req in list(self._requests.values()):
            if not req.first_reported:
                req.first_reported = True
                outputs.append(self._emit(req, req.last_token, req.first_logprob, counted=False))
        if self._waiting and len(self._running) < self.max_batch_size:
            self._waiting.sort(key=lambda r: (-r.priority, r.order))
            free = self.max_batch_size - len(self._running)
            self._running += self._waiting[:free]
            del self._waiting[:free]
        batch = self._reserve_pages(outputs)
        if batch:
            logits = self.runner.decode(
                [DecodeSeq(r.block_table, r.next_position, r.last_token) for r in batch]
            )
            sampled = sample_choices(logits, [r.state for r in batch], self.sampler)
            for req, (token, logprob) in zip(batch, sampled, strict=True):
                outputs.append(self._emit(req, token, logprob))
        self.last_step_seconds = time.perf_counter() - started
        return outputs

    def _reserve_pages(self, outputs: list[TokenOutput]) -> list[_Request]:
        """Give every running request a page for its next position, oldest first."""
        batch: list[_Request] = []
        for req in list(self._running):
            if req.key not in self._requests or req.request_id in self._parked:
                continue  # finished as a victim earlier in this loop, or parked
            need = req.next_position // self.block_size + 1
            while len(req.block_table) < need:
                try:
                    req.block_table.extend(self.allocator.allocate(1))
                except OutOfPages as exc:
                    victim = max(self._running, key=lambda r: (-r.priority, r.order))
                    outputs.append(self._exhausted(victim, exc))
                    if victim is req:
                        break
            if req.key in self._requests:
                batch.append(req)
        return [r for r in batch if r.key in self._requests]

    def _exhausted(self, req: _Request, exc: OutOfPages) -> TokenOutput:
        text, _ = req.stops.feed(req.detok.flush())
        text += req.stops.flush()
        self._finish(req)
        message = (
            f"KV cache exhausted after {req.num_generated} tokens: no free page for "
            f"position {req.next_position + 1} ({exc})"
        )
        return TokenOutput(
            req.request_id, None, text, True, "kv_exhausted", message, index=req.index
        )

    def _emit(
        self,
        req: _Request,
        token: int,
        logprob: TokenLogprob | None,
        *,
        counted: bool = True,
    ) -> TokenOutput:
        """Account for a generated token and decide whether the request is done.

        `counted=False` is the first token, which `add` already counted.
        """
        if counted:
            req.num_generated += 1
        req.last_token = token
        params = req.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        text, stopped = req.stops.feed("" if is_eos else req.detok.push(token))
        reason: FinishReason | None = None
        if is_eos or stopped or req.state.grammar_finished:
            reason = "stop"
        elif req.num_generated >= params.max_tokens or req.next_position >= self.max_position:
            reason = "length"
        if reason is None:
            return TokenOutput(req.request_id, token, text, False, index=req.index, logprob=logprob)
        if not stopped:
            tail, stopped = req.stops.feed(req.detok.flush())
            text += tail
            if not stopped:
                text += req.stops.flush()
        self._finish(req)
        return TokenOutput(
            req.request_id, token, text, True, reason, index=req.index, logprob=logprob
        )

    def _finish(self, req: _Request) -> None:
        del self._requests[req.key]
        if not any(key[0] == req.request_id for key in self._requests):
            self._parked.discard(req.request_id)
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        pages, req.block_table = req.block_table, []
        own = []
        for page in pages:
            refs = self._page_refs.get(page)
            if refs is None:
                own.append(page)
            elif refs > 1:
                self._page_refs[page] = refs - 1
            else:
                del self._page_refs[page]
                own.append(page)
        self.allocator.free(own)
