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
- **Pre-emptible requests** (`add(preemptible=True)`: a line of the Batch API) give
  their slot up to a waiting request of a higher priority: the running one of lowest
  priority, the newest among those, goes back to waiting with its KV in its pages,
  and takes a slot again as any waiting request does, continuing where it stopped.
  One paused `MAX_PAUSED_S` in all is not paused again, and waits ahead of every
  other for the next slot: its client (a gateway) would otherwise stop waiting for
  its next token (`gateway.token_idle_timeout_s`).
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
- **Prompts inside the decode batch** (`add_prompt`, SARATHI's piggybacked prefill): a
  request may come with its prompt instead of its KV. Each step then runs the running
  requests' decode tokens and one chunk of the oldest pending prompt (highest priority
  first) in one forward pass. With `tbt_slo_s` and requests running, the chunk is the
  largest whose predicted step time (`step_time`, a model learnt from this batcher's own
  steps) stays within the SLO, at least one token so the prompt always progresses;
  otherwise it is `max_chunk_tokens`. After the last chunk the
  choices' first tokens are sampled as a prefill engine samples them
  (`sample_first_tokens`) and the request continues exactly as a hand-off through `add`,
  its first tokens reported in that same step. All its pages are allocated at
  `add_prompt`; a cached prefix arrives in pages the caller filled, and only the rest is
  computed. The caller may ask to keep some of its full blocks' pages once computed
  (`keep_blocks`, to store them in the pool): the step that computes the last chunk
  then holds them for the caller too (refcounted with the request), `take_kept`
  hands them over and `release_kept` gives them back, whether the request still runs
  or ended meanwhile.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import torch

from yb_core.protocol import SamplingParams, TokenLogprob
from yb_engine.choice_sampling import ChoiceState, sample_choices, sample_first_tokens
from yb_engine.kv_cache import OutOfPages, PageAllocator
from yb_engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from yb_engine.sampling import Sampler
from yb_text.detokenize import IncrementalDetokenizer, StopStringFilter

FinishReason = Literal["stop", "length", "abort", "kv_exhausted"]

#: A pre-emptible request's pauses, in all, after which it pauses no more.
MAX_PAUSED_S = 30.0


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
    preemptible: bool = False
    paused_s: float = 0.0  # in pauses that ended
    paused_since: float | None = None  # the pause under way

    def paused_for(self, now: float) -> float:
        """Seconds paused in all, the pause under way included."""
        since = self.paused_since
        return self.paused_s + (now - since if since is not None else 0.0)

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def next_position(self) -> int:
        """Where the last generated token is fed (its KV written) by the next step."""
        return self.prompt_len + self.num_generated - 1


class StepTimeModel:
    """Seconds one step takes as a function of the tokens it feeds, learnt from the
    engine's own steps: a least-squares line `seconds = fixed + per_token * tokens`.

    Steps are kept by size class (1, 2-3, 4-7, 8-15, ... tokens), the last `window` of
    each, and the line is fitted through each class's median tokens and 90th-percentile
    seconds (nearest rank): a step predicted within a TBT SLO keeps within it nine times
    in ten, the percentile the gateway judges a request's TBT at. Classes keep what
    large chunks cost while many plain decode steps go by, and the percentile keeps the
    odd step slowed by something else (a shared CPU, a collection) from bending it.
    Until the steps span two classes, or when the fitted line does not rise, the time is
    taken as proportional to the tokens: that overestimates what extra tokens cost (the
    fixed cost of a step is charged per token), so chunks start small and the steps
    they add teach the line. With no step seen, there is no prediction (None).
    """

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError("the step-time window needs at least 1 step")
        self.window = window
        self._classes: dict[int, deque[tuple[int, float]]] = {}
        self._fit: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """Account for a step that fed `tokens` tokens and took `seconds`."""
        if tokens > 0:
            steps = self._classes.setdefault(tokens.bit_length(), deque(maxlen=self.window))
            steps.append((tokens, seconds))
            self._fit = None

    @property
    def num_steps(self) -> int:
        """Steps the model is fitted on."""
        return sum(len(steps) for steps in self._classes.values())

    def coefficients(self) -> tuple[float, float] | None:
        """`(fixed_s, per_token_s)` of the line in use; None before any step."""
        if not self._classes:
            return None
        if self._fit is None:
            self._fit = self._least_squares()
        return self._fit

    def predict(self, tokens: int) -> float | None:
        """Predicted seconds of a step feeding `tokens` tokens; None before any step."""
        fit = self.coefficients()
        if fit is None:
            return None
        fixed, per_token = fit
        return fixed + per_token * tokens

    def max_tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may feed and still be predicted to take at most
        `seconds` (0 when not even one fits); None before any step."""
        fit = self.coefficients()
        if fit is None:
            return None
        fixed, per_token = fit
        # The epsilon keeps a step predicted at exactly `seconds` from rounding down.
        return max(0, int((seconds - fixed) / per_token + 1e-6))

    def _least_squares(self) -> tuple[float, float]:
        points = [
            (statistics.median(t for t, _ in steps), _percentile_90([s for _, s in steps]))
            for steps in self._classes.values()
        ]
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in points)
        if var_t > 0:
            per_token = sum((t - mean_t) * (s - mean_s) for t, s in points) / var_t
            fixed = mean_s - per_token * mean_t
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, max(mean_s / mean_t, 1e-9)


def _percentile_90(values: list[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


@dataclass(eq=False)
class _Prompt:
    """A request whose prompt is being computed in the decode batch, chunk by chunk."""

    request_id: str
    order: int
    priority: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generated_tokens: int
    block_table: list[int]
    copy_pages: list[int]
    computed: int  # tokens whose KV is in the pages
    chunks: list[int] = field(default_factory=list)  # each chunk's size, in order
    keep_blocks: list[int] = field(default_factory=list)  # held for the caller once computed


class DecodeBatcher:
    """Continuous batching over a `ModelRunner`; see the module doc for the policies."""

    def __init__(
        self,
        runner: ModelRunner,
        allocator: PageAllocator,
        tokenizer: Any,
        max_batch_size: int,
        sampler: Sampler | None = None,
        *,
        tbt_slo_s: float | None = None,
        max_chunk_tokens: int = 512,
        step_time: StepTimeModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`tbt_slo_s` bounds the prompt chunk of a step while requests run (None: no
        bound); `max_chunk_tokens` bounds it always; `step_time` is the step-time model
        (a fresh one by default); `clock` times pre-emptible requests' pauses."""
        if max_batch_size <= 0:
            raise ValueError("max_batch_size must be positive")
        if tbt_slo_s is not None and tbt_slo_s <= 0:
            raise ValueError("tbt_slo_s must be positive")
        if max_chunk_tokens <= 0:
            raise ValueError("max_chunk_tokens must be positive")
        self.tbt_slo_s = tbt_slo_s
        self.max_chunk_tokens = max_chunk_tokens
        self.step_time = step_time or StepTimeModel()
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
        # Prompt pages that several holders read (a request's choices, the caller
        # keeping a computed prompt's blocks), and how many do.
        self._page_refs: dict[int, int] = {}
        # Computed prompts' pages held for the caller (`keep_blocks`), not yet taken:
        # block index -> page, by request id.
        self._kept: dict[str, dict[int, int]] = {}
        self._pending: list[TokenOutput] = []
        # Requests left out of the steps, pages kept (a test's failpoint holds them).
        self._parked: set[str] = set()
        self._order = itertools.count()
        # Prompts being computed inside the decode steps, by request id.
        self._prompts: dict[str, _Prompt] = {}
        self.last_step_seconds = 0.0
        self.clock = clock
        #: Pre-emptible requests paused so far (`_give_way`).
        self.preemptions = 0

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
    def num_prefilling(self) -> int:
        """Requests whose prompt is being computed inside the decode steps."""
        return len(self._prompts)

    @property
    def kv_pages_used(self) -> int:
        """Pages held by this batcher's requests (running, waiting and prefilling; a
        shared page once)."""
        decoding = {p for r in self._requests.values() for p in r.block_table}
        prefilling = {p for r in self._prompts.values() for p in r.block_table + r.copy_pages}
        return len(decoding | prefilling)

    def has_work(self) -> bool:
        """Whether `step` would do or report anything (a parked request does not)."""
        return bool(self._pending) or any(rid not in self._parked for rid in self._request_ids())

    def _request_ids(self) -> set[str]:
        return {key[0] for key in self._requests} | set(self._prompts)

    def prompt_chunks(self, request_id: str) -> list[int]:
        """The sizes of the chunks a prefilling request's prompt was computed in so far."""
        return list(self._prompts[request_id].chunks)

    def predicted_step_seconds(self, extra_tokens: int = 0) -> float | None:
        """The step-time model's prediction for the next step with `extra_tokens` more
        tokens than the running requests' (None before any step)."""
        return self.step_time.predict(self._batch_tokens() + extra_tokens)

    def predicted_prompt_seconds(self, num_tokens: int) -> float | None:
        """Predicted time from `add_prompt` to the first token of a prompt with
        `num_tokens` tokens to compute, at the present load: the prompts already
        pending go first, then its chunks, each a step beside the decode tokens of the
        requests running now. None before any step."""
        if num_tokens <= 0:
            raise ValueError("a prompt computes at least one token")
        decode_tokens = self._batch_tokens()
        budget = self._chunk_budget(decode_tokens)
        left = num_tokens + sum(
            len(p.prompt_token_ids) - p.computed for p in self._prompts.values()
        )
        seconds = 0.0
        while left > 0:
            chunk = min(budget, left)
            step = self.step_time.predict(decode_tokens + chunk)
            if step is None:
                return None
            seconds += step
            left -= chunk
        return seconds

    def prompt_chunk_budget(self) -> int:
        """Prompt tokens the next step would compute: `max_chunk_tokens` bounded, while
        requests run and `tbt_slo_s` is set, by the step-time model (at least one; with
        no step seen yet, one page)."""
        return self._chunk_budget(self._batch_tokens())

    def _chunk_budget(self, decode_tokens: int) -> int:
        if self.tbt_slo_s is None or decode_tokens == 0:
            return self.max_chunk_tokens
        fit = self.step_time.max_tokens_within(self.tbt_slo_s)
        if fit is None:
            return min(self.block_size, self.max_chunk_tokens)
        return max(1, min(self.max_chunk_tokens, fit - decode_tokens))

    def _batch_tokens(self) -> int:
        """Decode tokens the next step feeds: the running choices and those a free slot
        would admit, parked ones left out."""
        running = sum(1 for r in self._running if r.request_id not in self._parked)
        free = max(0, self.max_batch_size - len(self._running))
        waiting = sum(1 for r in self._waiting if r.request_id not in self._parked)
        return running + min(free, waiting)

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
        preemptible: bool = False,
    ) -> None:
        """Take over a prefilled request: its prompt KV is in `block_table`'s pages.

        `first_tokens` are the `params.n` choices' first tokens (`[first_token]` when
        None), `first_logprobs` their logprobs when asked. The last `generated_tokens`
        of `prompt_token_ids` are output the client already has. `copy_pages` are the
        pages set aside for the choices' copies of the last prompt page
        (`copies_needed`; allocated here when None). A `preemptible` request gives
        its slot up to a waiting request of a higher priority (module docstring).

        From here on the batcher owns all those pages (and frees them when the
        request ends). On a ValueError nothing is taken over.
        """
        self._check_new(request_id, len(prompt_token_ids), params, generated_tokens)
        firsts = list(first_tokens) if first_tokens else [first_token]
        n = params.n
        if len(firsts) != n:
            raise ValueError(f"{len(firsts)} first tokens for n = {n}")
        if first_logprobs and len(first_logprobs) != n:
            raise ValueError(f"{len(first_logprobs)} first logprobs for n = {n}")
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
                preemptible=preemptible,
            )
            self._requests[req.key] = req
            self._waiting.append(req)

    def add_prompt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cached_pages: list[int] | None = None,
        num_cached_tokens: int = 0,
        generated_tokens: int = 0,
        priority: int = 0,
        keep_blocks: Sequence[int] = (),
    ) -> None:
        """Take a request with its prompt, to be computed inside the next steps (see
        the module doc); its first tokens are reported by the step that computes the
        prompt's last chunk.

        `keep_blocks` (indices of the prompt's full blocks): the step that computes
        the prompt holds those blocks' pages for the caller as well (`take_kept`,
        then `release_kept`). A prompt that ends before it is computed keeps
        nothing.

        `cached_pages` hold the KV of the prompt's first `num_cached_tokens` tokens (a
        prefix found in the pool, loaded by the caller); only the rest is computed. The
        other pages the prompt needs, and the choices' copies of its last page, are
        allocated now. The last `generated_tokens` of `prompt_token_ids` are output the
        client already has, as for `add`.

        Raises ValueError when the request cannot run here (among others: a prompt
        longer than `max_position`, or needing more pages than the whole pool has), and
        `OutOfPages` when the pages it needs are not free now. Either way nothing is
        taken over; otherwise the batcher owns `cached_pages` and the new pages.
        """
        cached = list(cached_pages or [])
        prompt_len = len(prompt_token_ids)
        self._check_new(request_id, prompt_len, params, generated_tokens)
        if prompt_len > self.max_position:
            raise ValueError(
                f"a prompt of {prompt_len} tokens exceeds the model's {self.max_position}"
            )
        if not 0 <= num_cached_tokens < prompt_len:
            raise ValueError(
                f"num_cached_tokens {num_cached_tokens} must be in [0, {prompt_len}): "
                "the prompt's last token is computed for its logits"
            )
        cache = self.runner.cache
        if len(cached) != cache.pages_for(num_cached_tokens):
            raise ValueError(f"{len(cached)} cached pages for {num_cached_tokens} cached tokens")
        full = prompt_len // self.block_size
        if any(not 0 <= i < full for i in keep_blocks) or len(set(keep_blocks)) != len(keep_blocks):
            raise ValueError(f"blocks to keep {list(keep_blocks)} are not distinct of [0, {full})")
        copies = self.copies_needed(prompt_len, params.n)
        needed = cache.pages_for(prompt_len) + copies
        if needed > self.allocator.num_pages:
            raise ValueError(
                f"a prompt of {prompt_len} tokens (n = {params.n}) needs {needed} KV pages "
                f"of {self.block_size} tokens; this engine has {self.allocator.num_pages} in all"
            )
        fresh = self.allocator.allocate(needed - len(cached))
        split = len(fresh) - copies
        self._prompts[request_id] = _Prompt(
            request_id=request_id,
            order=next(self._order),
            priority=priority,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            generated_tokens=generated_tokens,
            block_table=cached + fresh[:split],
            copy_pages=fresh[split:],
            computed=num_cached_tokens,
            keep_blocks=list(keep_blocks),
        )

    def _check_new(
        self, request_id: str, prompt_len: int, params: SamplingParams, generated_tokens: int
    ) -> None:
        """What `add` and `add_prompt` both refuse."""
        if request_id in self._request_ids():
            raise ValueError(f"request {request_id!r} is already being decoded")
        if not 0 <= generated_tokens < prompt_len:
            raise ValueError(f"generated_tokens {generated_tokens} out of range")
        if generated_tokens and params.n > 1:
            raise ValueError("a request with n > 1 cannot resume")
        if params.max_tokens < generated_tokens + 1:
            raise ValueError("max_tokens must leave room for the first token (it counts)")

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

    def take_kept(self) -> dict[str, dict[int, int]]:
        """The pages held for the caller (`keep_blocks`) of the prompts computed since
        the last call, by request id, each by its block's index in the prompt; from
        now on the caller's to `release_kept`."""
        kept, self._kept = self._kept, {}
        return kept

    def release_kept(self, pages: Sequence[int]) -> None:
        """Give back pages `take_kept` handed over (freed once nobody holds them)."""
        self._unref(pages)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its pages; the next `step` reports it.

        False if the request is unknown or already finished.
        """
        prompt = self._drop_prompt(request_id)
        if prompt is not None:
            self._pending += [
                TokenOutput(request_id, None, "", True, "abort", index=i)
                for i in range(prompt.params.n)
            ]
            return True
        choices = [r for r in self._requests.values() if r.request_id == request_id]
        for req in choices:
            self._finish(req)
            self._pending.append(TokenOutput(request_id, None, "", True, "abort", index=req.index))
        return bool(choices)

    def discard(self, request_id: str) -> bool:
        """End a request now and free its pages, reporting nothing (its client reads
        another attempt of it). False if the request is unknown."""
        dropped = self._drop_prompt(request_id) is not None
        choices = [r for r in self._requests.values() if r.request_id == request_id]
        for req in choices:
            self._finish(req)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return dropped or bool(choices)

    def _drop_prompt(self, request_id: str) -> _Prompt | None:
        """End a prefilling request and free its pages; None if it is not one."""
        prompt = self._prompts.pop(request_id, None)
        if prompt is not None:
            self._parked.discard(request_id)
            self.allocator.free(prompt.block_table + prompt.copy_pages)
        return prompt

    def park(self, request_id: str) -> bool:
        """Leave a running request out of the steps until `unpark`; it keeps its pages,
        its KV and its batch slot, and `abort` still ends it. False if unknown."""
        if request_id not in self._request_ids():
            return False
        self._parked.add(request_id)
        return True

    def unpark(self, request_id: str) -> None:
        """Let a parked request step again (nothing if it is not parked)."""
        self._parked.discard(request_id)

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """Report new first tokens, run one decode step (with a chunk of a pending
        prompt when there is one), report what it produced."""
        started = time.perf_counter()
        outputs, self._pending = self._pending, []
        self._report_first_tokens(outputs)
        self._admit_waiting()
        batch = self._reserve_pages(outputs)
        seqs = [DecodeSeq(r.block_table, r.next_position, r.last_token) for r in batch]
        prompt = self._next_prompt()
        chunk = None
        if prompt is not None:
            chunk = self._next_chunk(prompt, self._chunk_budget(len(batch)))
            logits, prompt_logits = self.runner.mixed(seqs, chunk)
        elif batch:
            logits = self.runner.decode(seqs)
        if batch:
            sampled = sample_choices(logits, [r.state for r in batch], self.sampler)
            for req, (token, logprob) in zip(batch, sampled, strict=True):
                outputs.append(self._emit(req, token, logprob))
        if prompt is not None and chunk is not None:
            prompt.computed = chunk.end
            prompt.chunks.append(len(chunk.token_ids))
            if prompt_logits is not None:
                self._start_decoding(prompt, prompt_logits, outputs)
        self.last_step_seconds = time.perf_counter() - started
        fed = len(batch) + (len(chunk.token_ids) if chunk is not None else 0)
        self.step_time.observe(fed, self.last_step_seconds)
        return outputs

    def _admit_waiting(self) -> None:
        """Fill the free slots from the waiting requests: pre-emptible ones overdue
        for a slot first, then higher priority, then first come; pre-emptible running
        ones give way first to the waiting of a higher priority (`_give_way`)."""
        if not self._waiting:
            return
        now = self.clock()

        def rank(r: _Request) -> tuple[bool, int, int]:
            overdue = r.preemptible and r.paused_for(now) >= MAX_PAUSED_S
            return (not overdue, -r.priority, r.order)

        self._waiting.sort(key=rank)
        self._give_way(now)
        free = self.max_batch_size - len(self._running)
        if free <= 0:
            return
        admitted, self._waiting = self._waiting[:free], self._waiting[free:]
        for req in admitted:
            if req.paused_since is not None:
                req.paused_s += now - req.paused_since
                req.paused_since = None
        self._running += admitted

    def _give_way(self, now: float) -> None:
        """The waiting requests that the free slots leave out take the slots of
        running pre-emptible requests of a lower priority (not yet paused
        `MAX_PAUSED_S`): the lowest priority, the newest among those, goes back to
        waiting, its KV kept in its pages."""
        free = self.max_batch_size - len(self._running)
        for waiting in self._waiting[max(free, 0) :]:
            victims = [
                r
                for r in self._running
                if r.preemptible
                and r.priority < waiting.priority
                and r.paused_for(now) < MAX_PAUSED_S
            ]
            if not victims:
                return
            victim = max(victims, key=lambda r: (-r.priority, r.order))
            self._running.remove(victim)
            victim.paused_since = now
            self._waiting.append(victim)
            self.preemptions += 1

    def _report_first_tokens(self, outputs: list[TokenOutput]) -> None:
        for req in list(self._requests.values()):
            if not req.first_reported:
                req.first_reported = True
                outputs.append(self._emit(req, req.last_token, req.first_logprob, counted=False))

    def _next_prompt(self) -> _Prompt | None:
        """The prompt the next chunk is cut from: highest priority, then oldest."""
        ready = [p for p in self._prompts.values() if p.request_id not in self._parked]
        return min(ready, key=lambda p: (-p.priority, p.order), default=None)

    def _next_chunk(self, prompt: _Prompt, budget: int) -> PrefillChunk:
        end = min(len(prompt.prompt_token_ids), prompt.computed + budget)
        return PrefillChunk(
            token_ids=prompt.prompt_token_ids[prompt.computed : end],
            block_table=prompt.block_table,
            start=prompt.computed,
            wants_logits=end == len(prompt.prompt_token_ids),
        )

    def _start_decoding(
        self, prompt: _Prompt, logits: torch.Tensor, outputs: list[TokenOutput]
    ) -> None:
        """Sample a computed prompt's first tokens as a prefill engine does, hand the
        request to decoding as `add` takes a hand-off, and report those tokens now."""
        del self._prompts[prompt.request_id]
        ids, k = prompt.prompt_token_ids, prompt.generated_tokens
        try:
            sampled = sample_first_tokens(
                logits,
                prompt.params,
                ids[len(ids) - k :] if k else [],
                tokenizer=self.tokenizer,
                eos_token_ids=self.eos_token_ids,
                sampler=self.sampler,
            )
            self.add(
                prompt.request_id,
                ids,
                prompt.block_table,
                sampled[0].token_id,
                prompt.params,
                first_tokens=[s.token_id for s in sampled],
                first_logprobs=[s.logprob for s in sampled if s.logprob is not None] or None,
                generated_tokens=k,
                priority=prompt.priority,
                copy_pages=prompt.copy_pages,
            )
        except ValueError as exc:  # a resumed request's tokens its grammar refuses
            self.allocator.free(prompt.block_table + prompt.copy_pages)
            self._parked.discard(prompt.request_id)
            outputs += [
                TokenOutput(prompt.request_id, None, "", True, "abort", str(exc), index=i)
                for i in range(prompt.params.n)
            ]
            return
        if prompt.keep_blocks:
            # Before the first tokens are reported: one that ends the request frees
            # its pages then, and these must outlive it.
            kept = {i: prompt.block_table[i] for i in prompt.keep_blocks}
            for page in kept.values():
                self._page_refs[page] = self._page_refs.get(page, 1) + 1
            self._kept[prompt.request_id] = kept
        self._report_first_tokens(outputs)

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
        self._unref(pages)

    def _unref(self, pages: Sequence[int]) -> None:
        """One holder less for each of `pages`; free those nobody else holds."""
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
