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
- **Admission.** At most `max_batch_size` requests decode together; more wait, first in
  first out, with their KV parked in their pages (their first token is reported anyway,
  so time to first token does not depend on a free slot).
- **Running out of KV pages.** A request that needs a new page when none is free does
  not wait (a decode engine cannot make room by recomputing, and waiting requests that
  hold pages could deadlock each other). The newest running request is finished with
  `finish_reason="kv_exhausted"` and a message, and its pages go to the older ones,
  which are closer to done; repeated until the page is found or the one asking is the
  newest. Nothing is ever written to a page the request does not own.
- **Seeds.** Prefill samples the first token with `new_generator(params)`; the
  batcher makes its own generator from the same seed and skips that one draw, so a
  seeded request gives the same tokens as a single generator drawing all of them.
- **Pages are owned from `add` on.** The batcher frees a request's pages when it finishes
  for any reason, including `abort`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch

from yb_core.protocol import SamplingParams
from yb_engine.kv_cache import OutOfPages, PageAllocator
from yb_engine.runner import DecodeSeq, ModelRunner
from yb_engine.sampling import Sampler, new_generator, skip_draws
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


@dataclass(eq=False)
class _Request:
    request_id: str
    order: int
    prompt_len: int
    block_table: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stops: StopStringFilter
    last_token: int
    num_generated: int = 1  # the first token, sampled by prefill, counts
    first_reported: bool = False

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
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
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
        """Pages held by this batcher's requests (running and waiting)."""
        return sum(len(r.block_table) for r in self._requests.values())

    def has_work(self) -> bool:
        """Whether `step` would do or report anything (a parked request does not)."""
        return bool(self._pending) or len(self._requests) > len(self._parked)

    # -- requests ---------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        block_table: list[int],
        first_token: int,
        params: SamplingParams,
    ) -> None:
        """Take over a prefilled request: its prompt KV is in `block_table`'s pages.

        From here on the batcher owns those pages (and frees them when the request
        ends). On a ValueError nothing is taken over.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already being decoded")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1 (the first token counts)")
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("empty prompt")
        if len(block_table) * self.block_size < prompt_len:
            raise ValueError(
                f"{len(block_table)} pages of {self.block_size} cannot hold {prompt_len} tokens"
            )
        generator = new_generator(params)
        skip_draws(generator, 1)  # prefill drew the first token from the same seed
        req = _Request(
            request_id=request_id,
            order=next(self._order),
            prompt_len=prompt_len,
            block_table=list(block_table),
            params=params,
            generator=generator,
            detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            stops=StopStringFilter(params.stop),
            last_token=first_token,
        )
        self._requests[request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its pages; the next `step` reports it.

        False if the request is unknown or already finished.
        """
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req)
        self._pending.append(TokenOutput(request_id, None, "", True, "abort"))
        return True

    def park(self, request_id: str) -> bool:
        """Leave a running request out of the steps until `unpark`; it keeps its pages,
        its KV and its batch slot, and `abort` still ends it. False if unknown."""
        if request_id not in self._requests:
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
                outputs.append(self._emit(req, req.last_token, counted=False))
        while self._waiting and len(self._running) < self.max_batch_size:
            self._running.append(self._waiting.popleft())
        batch = self._reserve_pages(outputs)
        if batch:
            logits = self.runner.decode(
                [DecodeSeq(r.block_table, r.next_position, r.last_token) for r in batch]
            )
            tokens = self.sampler.sample(
                logits, [r.params for r in batch], [r.generator for r in batch]
            )
            for req, token in zip(batch, tokens, strict=True):
                outputs.append(self._emit(req, token))
        self.last_step_seconds = time.perf_counter() - started
        return outputs

    def _reserve_pages(self, outputs: list[TokenOutput]) -> list[_Request]:
        """Give every running request a page for its next position, oldest first."""
        batch: list[_Request] = []
        for req in list(self._running):
            if req.request_id not in self._requests or req.request_id in self._parked:
                continue  # finished as a victim earlier in this loop, or parked
            need = req.next_position // self.block_size + 1
            while len(req.block_table) < need:
                try:
                    req.block_table.extend(self.allocator.allocate(1))
                except OutOfPages as exc:
                    victim = max(self._running, key=lambda r: r.order)
                    outputs.append(self._exhausted(victim, exc))
                    if victim is req:
                        break
            if req.request_id in self._requests:
                batch.append(req)
        return [r for r in batch if r.request_id in self._requests]

    def _exhausted(self, req: _Request, exc: OutOfPages) -> TokenOutput:
        text, _ = req.stops.feed(req.detok.flush())
        text += req.stops.flush()
        self._finish(req)
        message = (
            f"KV cache exhausted after {req.num_generated} tokens: no free page for "
            f"position {req.next_position + 1} ({exc})"
        )
        return TokenOutput(req.request_id, None, text, True, "kv_exhausted", message)

    def _emit(self, req: _Request, token: int, *, counted: bool = True) -> TokenOutput:
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
        if is_eos or stopped:
            reason = "stop"
        elif req.num_generated >= params.max_tokens or req.next_position >= self.max_position:
            reason = "length"
        if reason is None:
            return TokenOutput(req.request_id, token, text, False)
        if not stopped:
            tail, stopped = req.stops.feed(req.detok.flush())
            text += tail
            if not stopped:
                text += req.stops.flush()
        self._finish(req)
        return TokenOutput(req.request_id, token, text, True, reason)

    def _finish(self, req: _Request) -> None:
        del self._requests[req.request_id]
        self._parked.discard(req.request_id)
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        pages, req.block_table = req.block_table, []
        self.allocator.free(pages)
