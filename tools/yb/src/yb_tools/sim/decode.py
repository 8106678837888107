"""A decode instance as the simulator plays it: continuous batching in closed form.

Every step decodes one token for each request in the batch and takes the cost
model's `tbt_s(batch, context)`; the context grows by the batch size each step. A
request whose KV arrives joins at the next step boundary and leaves after its
`output_tokens - 1` steps (the prefill produced its first token).

Stepping thousands of times per simulated second would dominate the simulator, so
nothing is stepped: between two changes of the batch, the time of `n` steps is the
closed form `CostModel.decode_steps_s`, and the instance only wakes (one event) at
the boundary where a request finishes or a pending one joins. `t0`, `steps`,
`batch`, `ctx` describe the batch at the last boundary it was materialized at.

Requests waiting for room (parked at a full batch, or any without room under the
`queue` decode admission) are admitted by priority (larger first), then arrival, as
the real batcher admits the requests it parked when its batch slots were short.

KV pages, as the engine holds them: a request sets aside only its prompt's pages
(`ceil(prompt / block_size)`) when its prefill starts (`ReserveKV`, refused when
they are not free), and while it decodes takes one more page each time its tokens
cross a page boundary: in the step that writes position `p` it holds `p //
block_size + 1` pages, so after `s` steps in the batch it holds `ceil((prompt + s +
1) / block_size)`, prompt plus the tokens generated so far. Nobody knows a request's
output length beforehand. The batch's pages at step `n` are a sum of floors, one
per member, each growing by a page every `block_size` steps at its own phase
(`(prompt - join step) mod block_size`); the phases are kept sorted, so the pages
gained over any span of steps, and the first step at which they would exceed the
free pages, are found in closed form (`_gained`, `_overflow_step`) and the instance
wakes there as at any other boundary. At a boundary where the batch needs more
pages than are free, the engine's rule applies: the running request of lowest
priority, the newest among those, is ended (`kv_exhausted`: it fails mid-stream)
and its pages freed, until the rest fit. Requests not in the batch (reserved while
their prefill runs, parked for a slot, piggybacked prompts being computed) hold
their prompt's pages and are never ended.

Piggybacked prompts (`add_prompt`): a prompt placed on the instance itself waits
until its prefix is loaded, then, one prompt at a time, is computed in chunks inside
the decode steps (`yb_conductor.piggyback`): each step decodes the batch and computes
one chunk, as large as fits the TBT SLO beside the batch's own step (at least one
block, so a prompt always advances). While a prompt is computed the instance steps
one step at a time (its steps are no longer alike); the step that computes the last
chunk yields the first token and the request joins the batch there.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque

from yb_conductor.cost_model import CostModel
from yb_conductor.piggyback import chunk_within
from yb_tools.sim.job import Job


class SimDecode:
    """One decode instance: KV room, batch room, and the batch in flight."""

    __slots__ = (
        "active",
        "active_done",
        "added",
        "batch",
        "batch_pages",
        "block_size",
        "cost",
        "ctx",
        "enforce_slo",
        "exhausted",
        "finishing",
        "held_pages",
        "instance_id",
        "kv_capacity",
        "max_batch",
        "page_capacity",
        "pending",
        "pending_ctx",
        "phases",
        "prompts",
        "step_chunk",
        "step_s_now",
        "steps",
        "t0",
        "tbt_slo_s",
        "version",
        "waiting",
        "waits",
        "wake_n",
    )

    def __init__(
        self,
        instance_id: str,
        cost: CostModel,
        *,
        kv_capacity: int,
        max_batch: int,
        tbt_slo_s: float,
        enforce_slo: bool,
        block_size: int = 1,
    ) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        # Piggybacked prompts: (ready at, cached tokens, job) waiting, in order; the
        # one being computed, its tokens done, and the current step's chunk and time.
        self.prompts: deque[tuple[float, int, Job]] = deque()
        self.active: Job | None = None
        self.active_done = 0
        self.step_chunk = 0
        self.step_s_now = 0.0
        self.cost = cost
        self.kv_capacity = kv_capacity
        self.max_batch = max_batch
        self.tbt_slo_s = tbt_slo_s
        self.enforce_slo = enforce_slo
        self.t0 = 0.0
        self.steps = 0
        self.batch = 0
        self.ctx = 0
        self.page_capacity = kv_capacity // block_size
        # Pages held outside the batch (prompts' pages: reserved, pending, parked,
        # piggybacked); the batch's pages at step `steps`, and its members' phases.
        self.held_pages = 0
        self.batch_pages = 0
        self.phases: list[int] = []
        # Requests taken so far (the engine's order), and how many were ended for
        # lack of KV pages.
        self.added = 0
        self.exhausted = 0
        self.finishing: list[tuple[int, int, Job]] = []
        self.pending: list[Job] = []
        self.pending_ctx = 0
        # A heap of (-priority, arrival number, job): the next to admit first.
        self.waiting: list[tuple[int, int, Job]] = []
        self.waits = 0
        # A wake is valid only while `version` is the one it was scheduled with.
        self.version = 0
        self.wake_n = 0

    # --- time ---------------------------------------------------------------------------

    def _span(self, n: int) -> float:
        return self.cost.decode_steps_s(self.batch, self.ctx, n)

    def _boundary_after(self, t: float) -> tuple[int, float]:
        """The first step boundary at or after `t`: (steps after t0, its time)."""
        if self.active is not None:
            # One step at a time while a prompt is computed.
            return (0, self.t0) if t <= self.t0 else (1, self.t0 + self.step_s_now)
        if self.batch == 0 or t <= self.t0:
            return 0, self.t0 if t <= self.t0 else t
        target = t - self.t0
        guess = self._invert(target)
        if guess:
            # The closed form lands on the boundary or next to it (rounding).
            n = guess
            while n > 1 and self._span(n - 1) >= target:
                n -= 1
            while self._span(n) < target:
                n += 1
            return n, self.t0 + self._span(n)
        hi = 1
        while self._span(hi) < target:
            hi *= 2
        lo = hi // 2
        # The smallest n in (lo, hi] with span(n) >= target.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._span(mid) < target:
                lo = mid
            else:
                hi = mid
        return hi, self.t0 + self._span(hi)

    def _invert(self, target: float) -> int:
        """The step count whose span first reaches `target`, solved in closed form
        when a step's time is linear in the context (0: not solvable here)."""
        d = self.cost.decode
        if d.floor_s or (d.kv_capacity_tokens and d.per_util_sq_s):
            return 0
        beta = d.per_context_token_s
        if d.kv_capacity_tokens and d.per_util_s:
            beta += d.per_util_s / d.kv_capacity_tokens
        first = d.base_s + d.per_seq_s * self.batch + beta * self.ctx
        growth = beta * self.batch
        # span(n) = n * first + growth * n * (n - 1) / 2 = target
        if growth <= 0.0:
            return max(1, math.ceil(target / first)) if first > 0 else 0
        a, b = growth / 2.0, first - growth / 2.0
        root = (-b + math.sqrt(b * b + 4.0 * a * target)) / (2.0 * a)
        return max(1, math.ceil(root))

    def next_wake(self) -> float:
        """When this instance must be woken next (inf: nothing to do); bumps `version`."""
        self.version += 1
        if self.active is not None:
            self.wake_n = 1
            return self.t0 + self.step_s_now
        wake = math.inf
        n_wake = 0
        if self.prompts:
            n_wake, wake = self._boundary_after(self.prompts[0][0])
        if self.finishing and self.batch:
            n = self.finishing[0][0] - self.steps
            at = self.t0 + self._span(n)
            if at < wake:
                wake, n_wake = at, n
        if self.pending:
            n, t = self._boundary_after(self.pending[-1].prefill_end)
            if t < wake:
                wake, n_wake = t, n
        if self.batch:
            # Pages running out before the next finish (at it, the finish comes first).
            n = self._overflow_step() - self.steps
            if n < self.finishing[0][0] - self.steps:
                at = self.t0 + self._span(n)
                if at < wake:
                    wake, n_wake = at, n
        self.wake_n = n_wake
        return wake

    # --- KV pages -----------------------------------------------------------------------

    def prompt_pages(self, job: Job) -> int:
        """The pages `job`'s prompt fills (all it reserves)."""
        return -(-job.item.prompt_tokens // self.block_size)

    def _member_pages(self, job: Job, step: int) -> int:
        """The pages a batch member holds for the step after boundary `step`."""
        return (job.item.prompt_tokens + step - job.join_step) // self.block_size + 1

    def _gained(self, n: int) -> int:
        """The pages the batch gains from step `steps` to step `steps + n`."""
        if n <= 0 or not self.phases:
            return 0
        bs = self.block_size
        full, r = divmod(n, bs)
        gained = full * len(self.phases)
        if r:
            # Boundary `steps + d` gives a page to the members of phase
            # `-(steps + d) mod bs`: for d in 1..r, a cyclic run of r phases.
            phases = self.phases
            lo = -(self.steps + r) % bs
            hi = -(self.steps + 1) % bs
            if lo <= hi:
                gained += bisect.bisect_right(phases, hi) - bisect.bisect_left(phases, lo)
            else:
                gained += len(phases) - bisect.bisect_left(phases, lo)
                gained += bisect.bisect_right(phases, hi)
        return gained

    def _overflow_step(self) -> int:
        """The first boundary after `steps` at which the batch needs more pages than
        are free (the batch unchanged till then)."""
        phases = self.phases
        b = len(phases)
        bs = self.block_size
        room = max(0, self.page_capacity - self.held_pages - self.batch_pages)
        full, idx = divmod(room, b)
        # The (idx + 1)-th page the batch takes in a span of `bs` steps: boundaries
        # steps + 1, + 2, ... serve phases s, s - 1, ... (cyclically).
        s = -(self.steps + 1) % bs
        at_or_below = bisect.bisect_right(phases, s)
        if idx < at_or_below:
            offset = s - phases[at_or_below - 1 - idx] + 1
        else:
            offset = s + bs - phases[b - 1 - (idx - at_or_below)] + 1
        return self.steps + full * bs + offset

    def _steps_at(self, t: float) -> int:
        """The batch's step count at time `t` (its last boundary at or before `t`)."""
        if not self.batch or self.active is not None or t <= self.t0:
            return self.steps
        n, bt = self._boundary_after(t)
        if bt > t and n:
            n -= 1
        return self.steps + n

    def used_pages(self, t: float) -> int:
        """The pages in use at `t`: prompts held, and the batch's as it stands then."""
        return self.held_pages + self.batch_pages + self._gained(self._steps_at(t) - self.steps)

    def _end_for_pages(self, t: float) -> list[Job]:
        """The engine's rule when the batch needs more pages than are free: end the
        running request of lowest priority, newest among those, until the rest fit."""
        ended: list[Job] = []
        while self.batch and self.held_pages + self.batch_pages > self.page_capacity:
            entry = max(self.finishing, key=lambda e: (-e[2].priority, e[2].decode_order))
            self.finishing.remove(entry)
            heapq.heapify(self.finishing)
            job = entry[2]
            item = job.item
            done = self.steps - job.join_step
            job.generated = done + 1
            job.finish_time = t
            self.batch -= 1
            self.ctx -= item.prompt_tokens + 1 + done
            self.batch_pages -= self._member_pages(job, self.steps)
            self._drop_phase(job)
            self.exhausted += 1
            ended.append(job)
        return ended

    def _phase(self, job: Job) -> int:
        return (job.item.prompt_tokens - job.join_step) % self.block_size

    def _drop_phase(self, job: Job) -> None:
        phases = self.phases
        del phases[bisect.bisect_left(phases, self._phase(job))]

    # --- requests -----------------------------------------------------------------------

    def context_at(self, t: float) -> int:
        """The batch's context at time `t` (the last boundary before it)."""
        if not self.batch:
            return 0
        if self.active is not None:
            return self.ctx
        n, bt = self._boundary_after(t)
        if bt > t and n:
            n -= 1
        return self.ctx + self.batch * n

    def kv_refusal(self, job: Job, t: float) -> str:
        """Why the instance has no pages for `job`'s prompt at `t` ("" if it has)."""
        need = self.used_pages(t) + self.prompt_pages(job)
        if need > self.page_capacity:
            return f"decode_kv_full: {need} > {self.page_capacity} KV pages"
        return ""

    def reserve(self, job: Job) -> None:
        """Set `job`'s prompt pages aside now (its prefill starts: `ReserveKV`)."""
        self.held_pages += self.prompt_pages(job)
        job.kv_held = True

    def release(self, job: Job) -> None:
        """Give back the pages `reserve` set aside for `job` (it will not decode here)."""
        if job.kv_held:
            self.held_pages -= self.prompt_pages(job)
            job.kv_held = False

    def refusal(self, job: Job, t: float) -> str:
        """Why the instance cannot take `job` now ("" if it can); the KV room is not
        judged again for a job whose KV is reserved already."""
        item = job.item
        if not job.kv_held and (kv := self.kv_refusal(job, t)):
            return kv
        batch = self.batch + len(self.pending) + 1
        if batch > self.max_batch:
            return f"decode_batch_full: batch {batch} > {self.max_batch}"
        if self.enforce_slo:
            ctx = self.context_at(t) + self.pending_ctx + item.prompt_tokens + 1
            tbt = self.cost.tbt_s(batch, ctx)
            if tbt > self.tbt_slo_s:
                return f"decode_tbt_slo: step {tbt:.4f}s at batch {batch} > {self.tbt_slo_s}s"
        return ""

    def admit(self, job: Job, t: float) -> None:
        """Take `job` (its KV arrived at `t`): it joins at the next step boundary, or at
        once when the instance is idle."""
        item = job.item
        if not job.kv_held:
            self.held_pages += self.prompt_pages(job)
        self.added += 1
        job.decode_order = self.added
        if self.batch == 0 and not self.pending and self.active is None:
            self.t0 = t
            self._join(job, t)
            return
        self.pending.append(job)
        self.pending_ctx += item.prompt_tokens + 1

    def add_prompt(self, job: Job, ready_at: float, cached_tokens: int) -> None:
        """Take `job`'s prompt into the batch (its prefix loaded by `ready_at`): its KV
        is reserved now, its chunks computed after the prompts before it."""
        self.held_pages += self.prompt_pages(job)
        self.prompts.append((ready_at, cached_tokens, job))

    def wait(self, job: Job, t: float) -> None:
        """Park `job` from `t` until there is room (its KV stays reserved if it was)."""
        job.parked_at = t
        self.added += 1
        job.decode_order = self.added
        self.waits += 1
        heapq.heappush(self.waiting, (-job.priority, self.waits, job))

    def _join(self, job: Job, t: float) -> None:
        """`job` (its prompt's pages held) joins the batch at this boundary."""
        item = job.item
        job.join_time = t
        job.join_step = self.steps
        heapq.heappush(self.finishing, (self.steps + item.output_tokens - 1, item.index, job))
        self.batch += 1
        self.ctx += item.prompt_tokens + 1
        self.held_pages -= self.prompt_pages(job)
        self.batch_pages += self._member_pages(job, self.steps)
        bisect.insort(self.phases, self._phase(job))

    def wake(self, t: float) -> tuple[list[Job], list[Job], list[Job], list[Job], list[Job]]:
        """At the boundary scheduled by the last `next_wake`: finish and join, take
        the batch's pages for the next step, and advance the piggybacked prompts.
        Returns the requests that finished (at `t`), those that waited for room and
        joined, the prompts whose computing started, those whose last chunk was
        computed (their first token: a prompt with one token to give finishes there,
        the others joined the batch), and those ended for lack of KV pages."""
        n = self.wake_n
        if self.batch:
            self.batch_pages += self._gained(n)
            self.steps += n
            self.ctx += self.batch * n
        self.t0 = t
        prompted: list[Job] = []
        active = self.active
        if active is not None:
            self.active_done += self.step_chunk
            if self.active_done >= active.item.prompt_tokens:
                self.active = None
                prompted.append(active)
        done: list[Job] = []
        finishing = self.finishing
        while finishing and finishing[0][0] <= self.steps:
            job = heapq.heappop(finishing)[2]
            item = job.item
            job.finish_time = t
            self.batch -= 1
            self.ctx -= item.prompt_tokens + item.output_tokens
            self.batch_pages -= self._member_pages(job, self.steps)
            self._drop_phase(job)
            done.append(job)
        for job in self.pending:
            self._join(job, t)
        self.pending.clear()
        self.pending_ctx = 0
        for job in prompted:
            item = job.item
            if item.output_tokens <= 1:
                self.held_pages -= self.prompt_pages(job)
            else:
                self.added += 1
                job.decode_order = self.added
                self._join(job, t)
        joined: list[Job] = []
        while self.waiting and not self.refusal(self.waiting[0][2], t):
            job = heapq.heappop(self.waiting)[2]
            if not job.kv_held:
                self.held_pages += self.prompt_pages(job)
            self._join(job, t)
            joined.append(job)
        ended = self._end_for_pages(t)
        started: list[Job] = []
        if self.active is None and self.prompts and self.prompts[0][0] <= t:
            _, cached, job = self.prompts.popleft()
            self.active, self.active_done = job, cached
            started.append(job)
        if self.active is not None:
            self._plan_step()
        return done, joined, started, prompted, ended

    def _plan_step(self) -> None:
        """The next step's chunk of the active prompt and its time: as large as fits
        the TBT SLO beside the batch's step, at least one block."""
        assert self.active is not None
        cost = self.cost
        done = self.active_done
        left = self.active.item.prompt_tokens - done
        decode_s = cost.tbt_s(self.batch, self.ctx) if self.batch else 0.0
        chunk = chunk_within(cost, self.tbt_slo_s - decode_s, done, left)
        chunk = max(chunk, min(left, self.block_size))
        self.step_chunk = chunk
        self.step_s_now = decode_s + cost.prefill_s(chunk, done)

    @property
    def running(self) -> int:
        """Requests in the batch (and about to join it)."""
        return self.batch + len(self.pending)

    def step_s(self) -> float:
        """The current step time (0 when idle)."""
        if self.active is not None:
            return self.step_s_now
        return self.cost.tbt_s(self.batch, self.ctx) if self.batch else 0.0
