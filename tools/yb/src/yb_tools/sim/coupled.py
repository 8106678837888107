"""The paper's vLLM baseline (`coupled`): instances that prefill and decode their own
requests, with chunked prefill piggybacked on decode steps.

Each of the cluster's `prefill + decode` instances runs steps one after another. A
step decodes one token for every request in its batch and, beside them, computes
prompt chunks from its queue (by priority, then arrival): SARATHI's chunked prefill
as `shared/engine` runs it ("Prefill inside decode's batch"). A step takes the cost
model's decode step of its batch plus each chunk's prefill time (`prefill_s` of the
chunk on top of the prompt's tokens already in pages). Chunks are bounded so that the
step stays within the TBT SLO: the first chunk of a step is at least one block (a
prompt always advances), later ones only what still fits; with nothing decoding
there is no stream to protect and the head prompt runs whole. A prompt's first token
comes at the end of the step that computed its last chunk, so its TTFT holds every
step it waited through and every chunk; it joins the batch the next step and leaves
after `output_tokens - 1` decode steps.

Each instance has its own prefix cache: the blocks of prompts it prefilled, in its
own KV room (`decode_kv_tokens`, else the profile's: vLLM's cache lives in the GPU's
memory; no global pool, no transfers), evicted LRU. A request is routed at arrival
to the instance whose cache holds the longest prefix of it, ties to the least loaded
(fewest requests queued or running, then the lowest index); its cached prefix is
looked up again when its first chunk starts, and costs nothing to load. A prompt
starts only when the instance has KV room (prompt + output tokens) and a batch slot;
otherwise it waits, and a request whose prefill has not started `request_timeout_s`
after arrival is cancelled. There is no conductor and no early rejection. Everything
is deterministic in virtual time (the `jitter` parameter does not apply).

Every coupled instance spans the same devices (`prefill_tp` = `decode_tp`, the
profile's by default), timed by the cost model at that degree, with the KV room of
that degree.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

from yb_conductor.cost_model import CostModel
from yb_conductor.piggyback import chunk_within
from yb_tools.sim.job import Job
from yb_tools.sim.kvstore import SimKvstore
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import LoadSeries, PolicyResult, summarize
from yb_tools.sim.simulator import Progress, block_size_for, decode_kv_tokens, engine_costs
from yb_tools.sim.workload import TraceItem, draw_priorities

COUPLED_POLICY = "coupled"


class _Prompt:
    """A prompt being prefilled: its job, tokens done (cached or computed)."""

    __slots__ = ("done", "job", "started")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.done = 0
        self.started = False


class CoupledInstance:
    """One coupled instance: its queue, the prompts it prefills, its decode batch."""

    __slots__ = (
        "batch",
        "busy",
        "cache",
        "ctx",
        "finishing",
        "index",
        "kv_reserved",
        "prefilling",
        "queue",
        "queued",
        "steps",
    )

    def __init__(self, index: int, cache: SimKvstore) -> None:
        self.index = index
        self.cache = cache
        # A heap of (-priority, arrival index, job): prompts not started yet.
        self.queue: list[tuple[int, int, Job]] = []
        self.queued = 0
        # Prompts holding KV room, being prefilled chunk by chunk, in start order.
        self.prefilling: deque[_Prompt] = deque()
        self.finishing: list[tuple[int, int, Job]] = []
        self.batch = 0
        self.ctx = 0
        self.steps = 0
        self.kv_reserved = 0
        self.busy = False

    @property
    def load(self) -> int:
        """Requests queued, prefilling or decoding."""
        return len(self.queue) + len(self.prefilling) + self.batch


class CoupledSimulation:
    """The trace on `prefill + decode` coupled instances; `run()` once."""

    def __init__(
        self, items: list[TraceItem], params: SimParams, cost: CostModel, *, label: str = ""
    ) -> None:
        self.items = items
        self.params = params
        params.check_degrees()
        prefill_tp, decode_tp = params.degrees(cost)
        if prefill_tp != decode_tp:
            raise ValueError(
                "the coupled baseline's instances each prefill and decode, at one degree: "
                f"tensor parallel {prefill_tp} for prefill and {decode_tp} for decode"
            )
        self.bs = bs = block_size_for(params, cost)
        self.cost = cost = engine_costs(params, cost)[1]
        self.label = label or COUPLED_POLICY
        self.kv_capacity = decode_kv_tokens(params, cost, bs)
        n = params.prefill + params.decode
        self.instances = [
            CoupledInstance(
                i, SimKvstore(f"coupled-{i}", f"host-{i}", max(1, self.kv_capacity // bs))
            )
            for i in range(n)
        ]
        priorities = draw_priorities(len(items), params.priority_mix, params.seed)
        self.jobs = [Job(item, priority=p) for item, p in zip(items, priorities, strict=True)]
        # (time, sequence, instance index): the end of that instance's running step.
        self.heap: list[tuple[float, int, int]] = []
        self.hseq = 0
        self.last_exit = 0.0
        self.steps_run = 0
        # What the running step of each instance does, applied when it ends:
        # (decoding batch, [(prompt, chunk tokens)]).
        self.plans: list[tuple[int, list[tuple[_Prompt, int]]]] = [(0, []) for _ in range(n)]

    def run(self, progress: Progress | None = None) -> PolicyResult:
        """Play the whole trace and every request to its end; the figures."""
        wall = time.perf_counter()
        items = self.items
        n = len(items)
        every = max(1, n // 200)
        heap = self.heap
        i = 0
        while True:
            arrival = items[i].arrival if i < n else math.inf
            if heap and heap[0][0] <= arrival:
                t, _, k = heapq.heappop(heap)
                self._step_done(self.instances[k], t)
            elif i < n:
                self._arrive(self.jobs[i], arrival)
                i += 1
                if progress is not None and (i % every == 0 or i == n):
                    progress(i, n)
            else:
                break
        p = self.params
        return summarize(
            self.jobs,
            label=self.label,
            admission="none",
            block_size=self.bs,
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
            ttft_slo_s=p.ttft_slo_s,
            tbt_slo_s=p.tbt_slo_s,
            simulated_s=self.last_exit,
            wall_s=time.perf_counter() - wall,
            decisions=n,
            events=self.steps_run,
            conductor_s=0.0,
            load=LoadSeries(interval_s=0.0),
        )

    # --- routing ------------------------------------------------------------------------

    def _arrive(self, job: Job, t: float) -> None:
        keys = self._prefix_keys(job.item)
        best = max(self.instances, key=lambda inst: (inst.cache.prefix(keys), -inst.load))
        job.prefill = job.decode = best.index
        best.queued += 1
        heapq.heappush(best.queue, (-job.priority, best.queued, job))
        if not best.busy:
            self._start_step(best, t)

    def _prefix_keys(self, item: TraceItem) -> list[int]:
        # The block holding the last prompt token is always computed (it yields the
        # first token), as on a prefill instance.
        return item.keys[: (item.prompt_tokens - 1) // self.bs]

    # --- steps --------------------------------------------------------------------------

    def _admit(self, inst: CoupledInstance, t: float) -> None:
        """Start queued prompts while KV room and batch slots allow."""
        timeout = self.params.request_timeout_s
        max_batch = self.params.decode_max_batch
        while inst.queue:
            job = inst.queue[0][2]
            item = job.item
            if t - item.arrival > timeout:
                heapq.heappop(inst.queue)
                job.fate = "timed_out"
                job.reason = "timeout: prefill not started in time"
                self.last_exit = t
                continue
            need = item.prompt_tokens + item.output_tokens
            fits = inst.kv_reserved + need <= self.kv_capacity
            room = inst.batch + len(inst.prefilling) < max_batch
            # An idle instance takes a prompt even past its KV room (it could never
            # start otherwise), as the disaggregated decode does not: its KV is its own.
            if not (room and (fits or (inst.batch == 0 and not inst.prefilling))):
                return
            heapq.heappop(inst.queue)
            inst.kv_reserved += need
            inst.prefilling.append(_Prompt(job))

    def _start_step(self, inst: CoupledInstance, t: float) -> None:
        """Plan and time the next step of `inst` at `t` (idle if nothing to do)."""
        self._admit(inst, t)
        cost = self.cost
        slo = self.params.tbt_slo_s
        batch = inst.batch
        step = cost.tbt_s(batch, inst.ctx) if batch else 0.0
        chunks: list[tuple[_Prompt, int]] = []
        for prompt in inst.prefilling:
            job = prompt.job
            if not prompt.started:
                prompt.started = True
                cached = inst.cache.prefix(self._prefix_keys(job.item)) * self.bs
                inst.cache.touch(job.item.keys[: cached // self.bs])
                prompt.done = cached
                job.reused_local = cached // self.bs
                job.prefill_start = t
            left = job.item.prompt_tokens - prompt.done
            if batch == 0 and not chunks:
                chunk = left
            else:
                chunk = self._chunk(slo - step, prompt.done, left, first=not chunks)
            if chunk <= 0:
                break
            seconds = cost.prefill_s(chunk, prompt.done)
            job.prefill_s += seconds
            step += seconds
            chunks.append((prompt, chunk))
        if step <= 0.0:
            inst.busy = False
            return
        inst.busy = True
        self.plans[inst.index] = (batch, chunks)
        self.hseq += 1
        heapq.heappush(self.heap, (t + step, self.hseq, inst.index))

    def _chunk(self, budget_s: float, done: int, left: int, *, first: bool) -> int:
        """The largest chunk (tokens, at most `left`) whose prefill on top of `done`
        fits `budget_s`; the first chunk of a step is at least one block."""
        floor = min(left, self.bs) if first else 0
        return max(chunk_within(self.cost, budget_s, done, left), floor)

    def _step_done(self, inst: CoupledInstance, t: float) -> None:
        self.steps_run += 1
        batch, chunks = self.plans[inst.index]
        if batch:
            inst.steps += 1
            inst.ctx += batch
        finishing = inst.finishing
        while finishing and finishing[0][0] <= inst.steps:
            job = heapq.heappop(finishing)[2]
            item = job.item
            job.finish_time = t
            job.fate = "completed"
            inst.batch -= 1
            inst.ctx -= item.prompt_tokens + item.output_tokens
            inst.kv_reserved -= item.prompt_tokens + item.output_tokens
            self.last_exit = t
        for prompt, chunk in chunks:
            prompt.done += chunk
            job = prompt.job
            item = job.item
            if prompt.done < item.prompt_tokens:
                continue
            inst.prefilling.remove(prompt)
            job.prefill_end = t
            inst.cache.store(item.keys[: item.prompt_tokens // self.bs], t)
            if item.output_tokens <= 1:
                job.finish_time = t
                job.fate = "completed"
                inst.kv_reserved -= item.prompt_tokens + item.output_tokens
                self.last_exit = t
                continue
            job.join_time = t
            job.join_step = inst.steps
            heapq.heappush(finishing, (inst.steps + item.output_tokens - 1, item.index, job))
            inst.batch += 1
            inst.ctx += item.prompt_tokens + 1
        self._start_step(inst, t)
