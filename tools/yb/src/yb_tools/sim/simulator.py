"""One policy on one simulated cluster: a discrete-event loop in virtual time around
the real conductor.

The simulator plays the cluster the way production does: every instance announces
itself (`InstanceUp`) and reports its load every second (`LoadReport`, the
heartbeat); kvstores log what they store and evict (`Block*`); each trace request is
admitted (`RequestAdmitted`) and the conductor's decision is obeyed — a rejection
ends the request, a placement sends it to the chosen prefill instance, whose start,
end and hand-off to the chosen decode instance are logged (`RequestProgress`), and
the request's end (`RequestFinished`, or `RequestCancelled` on timeout) releases its
load. Each decision is logged back to the conductor as the live service does, so the
log replays. The conductor decides exactly as it would live: `Conductor.apply` is
the production code path, fed in event-time order.

Prefill and decode instances span the devices `SimParams.degrees` gives them: each
announces its degree and lanes, and is timed by the cost model at them
(`engine_costs`), which is what the conductor prices it with.

A batch backlog (`SimParams.batch_lines`, `yb_tools.sim.batch`) is tried from the
heap: each try is admitted as a batch line (`RequestAdmitted.batch`), a refused one
tried again after the gateway worker's back-off until its deadline. The run's
`PolicyResult` is over the interactive requests only; the backlog's figures are
`Simulation.batch_result`.

Events are a heap of (time, sequence, kind, ...); arrivals come straight from the
sorted trace. Nothing here reads the wall clock except to measure itself.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from yb_conductor.conductor import Conductor, Output
from yb_conductor.cost_model import CostModel
from yb_conductor.policy import placement_policy
from yb_conductor.replay import LogRecord
from yb_conductor.settings import configured_event, with_overrides
from yb_core import events as ev
from yb_core.config import FLEX_TTFT_FACTOR, ConductorConfig
from yb_tools.sim.batch import BatchLine, BatchResult, backlog, summarize_batch
from yb_tools.sim.decode import SimDecode
from yb_tools.sim.job import Job
from yb_tools.sim.kvstore import SimKvstore
from yb_tools.sim.params import SimParams, lanes_at, stage_layers
from yb_tools.sim.prefill import SimPrefill
from yb_tools.sim.results import LoadSeries, PolicyResult, summarize
from yb_tools.sim.workload import TraceItem, draw_priorities

# Kinds of heap events.
(
    _PREFILL_DONE,
    _DECODE_WAKE,
    _REPORT,
    _SAMPLE,
    _REPLICATE,
    _INSTANCE_UP,
    _BATCH_TRY,
    _PAUSE,
) = range(8)

# An engine's state in an elastic run (`SimParams.max_instances`).
_DOWN, _STARTING, _UP, _DRAINING = "down", "starting", "up", "draining"

# (requests arrived, requests in the trace)
Progress = Callable[[int, int], None]

DEFAULT_DECODE_KV_TOKENS = 1 << 20


def block_size_for(params: SimParams, cost: CostModel) -> int:
    """The block size a run uses: the parameter, else the cost model's, else 512."""
    return params.block_size or cost.block_size or 512


def engine_costs(params: SimParams, cost: CostModel) -> tuple[CostModel, CostModel]:
    """The cost model of a prefill and of a decode instance, each at its degree and
    lanes (`SimParams.degrees`, `lanes_at`)."""
    prefill_tp, decode_tp = params.degrees(cost)
    return (
        cost.at_degree(prefill_tp, lanes_at(cost, prefill_tp)),
        cost.at_degree(decode_tp, lanes_at(cost, decode_tp)),
    )


def decode_kv_tokens(params: SimParams, decode_cost: CostModel, block_size: int) -> int:
    """KV room of one decode instance, tokens: the parameter, else the cost model's at
    the decode degree, else `DEFAULT_DECODE_KV_TOKENS`. ValueError when the model's
    weights leave the decode degree less than a block."""
    if params.decode_kv_tokens:
        return params.decode_kv_tokens
    room = decode_cost.decode.kv_capacity_tokens
    if room and room < block_size:
        raise ValueError(
            f"{decode_cost.name} at tensor parallel {decode_cost.tensor_parallel.degree} "
            f"leaves {room} tokens of KV room, less than a block of {block_size}: its "
            "weights do not fit beside a request"
        )
    return room or DEFAULT_DECODE_KV_TOKENS


class Simulation:
    """The cluster, the conductor, and the loop; `run()` once."""

    def __init__(
        self,
        items: list[TraceItem],
        params: SimParams,
        cost: CostModel,
        *,
        policy: str,
        admission: str = "predicted",
        label: str = "",
        record_log: bool = False,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.items = items
        self.params = params
        self.cost = cost
        self.label = label or policy
        self.admission = admission
        self.bs = bs = block_size_for(params, cost)
        params.check_degrees()
        self.prefill_tp, self.decode_tp = params.degrees(cost)
        self.prefill_cost, self.decode_cost = engine_costs(params, cost)
        # Simulated engines run exactly at the cost model's speed, each on its own
        # hardware: nothing to learn (`learn_speed` would only add rounding noise to
        # the published figures); `settings` may still turn it on.
        base = ConductorConfig(
            seed=params.seed, request_timeout_s=params.request_timeout_s, learn_speed=False
        )
        self.cfg = with_overrides(
            base, {**(settings or {}), "policy": policy, "admission": admission}
        )
        # The policy is built here and the logged settings are not re-adopted: peer
        # policies take parameters the settings do not carry.
        policy_impl = placement_policy(self.cfg, cost)
        self.conductor = Conductor(policy_impl, cfg=self.cfg, cost=cost, adopt_logged_config=False)
        self.records: list[LogRecord] | None = [] if record_log else None
        self.rng = random.Random(params.seed)
        self.slo = ev.Slo(ttft_s=params.ttft_slo_s, tbt_s=params.tbt_slo_s)
        pool_blocks = max(1, params.pool_tokens_at(cost) // bs)
        # Elastic pools (the planner on): every instance the budget allows exists,
        # those beyond the starting split down until the planner adds them.
        self.elastic = self.cfg.planner
        budget = params.max_instances or params.prefill + params.decode
        prefill_slots = max(params.prefill, params.hosts, budget if self.elastic else 0)
        decode_slots = max(params.decode, budget if self.elastic else 0)
        self.kvstores = [
            SimKvstore(f"kvstore-{i}", f"host-{i}", pool_blocks, params.eviction)
            for i in range(prefill_slots)
        ]
        self.kvstore_by_id = {kv.instance_id: kv for kv in self.kvstores}
        self.prefills = [
            SimPrefill(f"prefill-{i}", kv.host, kv) for i, kv in enumerate(self.kvstores)
        ]
        self.prefill_index = {p.instance_id: i for i, p in enumerate(self.prefills)}
        params.check_groups()
        # (group, [start, end) layers) of each prefill instance in a group.
        self.stage_of: dict[str, tuple[str, tuple[int, int]]] = {}
        first = 0
        for g, size in enumerate(params.prefill_groups):
            members = self.prefills[first : first + size]
            spans = stage_layers(size, params.model_layers)
            for member, span in zip(members, spans, strict=True):
                self.stage_of[member.instance_id] = (f"group-{g}", span)
            lead = members[0]
            lead.shares = [(end - start) / params.model_layers for start, end in spans]
            lead.hosts = [m.host for m in members]
            first += size
        self.decode_kv_tokens = decode_kv_tokens(params, self.decode_cost, bs)
        self.decodes = [
            SimDecode(
                f"decode-{j}",
                self.decode_cost,
                kv_capacity=self.decode_kv_tokens,
                max_batch=params.decode_max_batch,
                tbt_slo_s=params.tbt_slo_s,
                enforce_slo=params.decode_admission == "reject",
                block_size=bs,
            )
            for j in range(decode_slots)
        ]
        self.decode_index = {d.instance_id: j for j, d in enumerate(self.decodes)}
        # The pool on each decode instance's host, which its piggybacked prompts' blocks
        # go into: with piggybacking on, decode j shares kvstore j mod n's host;
        # otherwise it sits on a host of its own and stores nothing.
        self.decode_pools: list[SimKvstore | None] = [
            self.kvstores[j % len(self.kvstores)] if params.piggyback and self.kvstores else None
            for j in range(decode_slots)
        ]
        # Each engine's state, when it started holding its devices (`_hold`), the
        # role a moved one restarts in, and the instance-seconds held so far.
        self.engine_state: dict[str, str] = {}
        for i, pf in enumerate(self.prefills):
            self.engine_state[pf.instance_id] = _UP if i < params.prefill else _DOWN
        for j, d in enumerate(self.decodes):
            self.engine_state[d.instance_id] = _UP if j < params.decode else _DOWN
        self.held_since: dict[str, float] = {
            i: 0.0 for i, state in self.engine_state.items() if state == _UP
        }
        self.held_s = 0.0
        self.restart_as: dict[str, str] = {}
        self.draining: set[str] = set()
        self.epochs: dict[str, int] = {}
        self.plans: list[ev.PoolPlanned] = []
        self.pool_actions = 0
        priorities = draw_priorities(len(items), params.priority_mix, params.seed)
        self.jobs: list[Job] = [
            Job(item, priority=priority) for item, priority in zip(items, priorities, strict=True)
        ]
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.hseq = 0
        self.seq = 0
        self.now = 0.0
        self.open = 0
        self.last_exit = 0.0
        self.arrived = 0
        self.decisions = 0
        self.conductor_s = 0.0
        self.load = LoadSeries(interval_s=params.sample_interval_s)
        # The batch backlog: its lines, every try's job, the lines waiting for a try.
        self.batch_lines: list[BatchLine] = (
            backlog(
                items, params.batch_lines, params.batch_window_s, block_size=bs, seed=params.seed
            )
            if params.batch_lines > 0
            else []
        )
        self.batch_jobs: list[Job] = []
        self.batch_waiting = 0
        # Lines not started yet: a worker slot (`batch_concurrency`) frees for each.
        self.batch_queue: deque[BatchLine] = deque(self.batch_lines)
        self.batch_slo = ev.Slo(ttft_s=params.ttft_slo_s * FLEX_TTFT_FACTOR, tbt_s=params.tbt_slo_s)
        self.batch_result: BatchResult | None = None
        # A generator of its own: a backlog must not shift the run's other draws.
        self.batch_rng = random.Random(f"batch-retry:{params.seed}")
        # Prefill engines pause a batch line's prefill between layers for work of a
        # higher priority, as the real ones do, when the conductor prices it so.
        self.preempt = self.cfg.batch_preemption

    # --- plumbing -------------------------------------------------------------------------

    def emit(self, event: ev.AnyEvent) -> list[Output]:
        """Log an event: the conductor folds it (and answers, for an admission)."""
        self.seq += 1
        if self.records is not None:
            self.records.append(LogRecord(seq=self.seq, event=event, subject=ev.subject_for(event)))
        started = time.perf_counter()
        out = self.conductor.apply(self.seq, event)
        self.conductor_s += time.perf_counter() - started
        if out and isinstance(plan := out[-1], ev.PoolPlanned):
            # The planner decides on any event: its decision is logged back and
            # carried out here, whoever emitted the event.
            out.pop()
            self.emit(plan)
            self._actuate(plan)
        return out

    def _push(self, t: float, kind: int, a: int, b: object) -> None:
        self.hseq += 1
        heapq.heappush(self.heap, (t, self.hseq, kind, a, b))

    # --- the run --------------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> PolicyResult:
        """Play the whole trace and every request to its end; the figures."""
        wall = time.perf_counter()
        self._start_cluster()
        items = self.items
        n = len(items)
        every = max(1, n // 200)
        heap = self.heap
        pop = heapq.heappop
        i = 0
        if self.params.report_interval_s > 0:
            self._push(self.params.report_interval_s, _REPORT, 0, None)
        if self.params.sample_interval_s > 0:
            self._push(0.0, _SAMPLE, 0, None)
        slots = self.params.batch_concurrency or len(self.batch_lines)
        for _ in range(min(slots, len(self.batch_lines))):
            self._next_line(0.0)
        while True:
            arrival = items[i].arrival if i < n else math.inf
            # A batch line's try waits for the interactive arrivals of its instant: it
            # takes only the capacity they leave.
            if heap and (
                heap[0][0] < arrival or (heap[0][0] == arrival and heap[0][2] != _BATCH_TRY)
            ):
                t, _, kind, a, b = pop(heap)
                self.now = t
                if kind == _PREFILL_DONE:
                    assert isinstance(b, Job)
                    if b.done_at == t and self.prefills[a].current is b:
                        self._prefill_done(a, b, t)
                elif kind == _PAUSE:
                    assert isinstance(b, Job)
                    self._pause(a, b, t)
                elif kind == _DECODE_WAKE:
                    if self.decodes[a].version == b:
                        self._decode_wake(a, t)
                elif kind == _REPORT:
                    self._report(t)
                elif kind == _SAMPLE:
                    self._sample(t)
                elif kind == _INSTANCE_UP:
                    assert isinstance(b, str)
                    self._instance_up(a, b, t)
                elif kind == _BATCH_TRY:
                    self.batch_waiting -= 1
                    self._batch_try(self.batch_lines[a], t)
                else:
                    assert isinstance(b, list)
                    self._replicated(a, b, t)
                if self.draining:
                    self._stop_drained(t)
            elif i < n:
                self.now = arrival
                self._arrive(self.jobs[i], arrival)
                i += 1
                self.arrived = i
                if progress is not None and (i % every == 0 or i == n):
                    progress(i, n)
            else:
                break
        wall_s = time.perf_counter() - wall
        p = self.params
        for instance_id in list(self.held_since):
            self._release(instance_id, self.last_exit)
        result = summarize(
            self.jobs,
            label=self.label,
            admission=self.admission,
            block_size=self.bs,
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
            ttft_slo_s=p.ttft_slo_s,
            tbt_slo_s=p.tbt_slo_s,
            simulated_s=self.last_exit,
            wall_s=wall_s,
            decisions=self.decisions,
            events=self.seq,
            conductor_s=self.conductor_s,
            load=self.load,
        )
        result.instance_hours = self.held_s / 3600.0
        result.pool_actions = self.pool_actions
        if self.batch_lines:
            self.batch_result = self._batch_summary()
        return result

    def _batch_summary(self) -> BatchResult:
        """Each line's fate from its last try, and the backlog's figures."""
        for line in self.batch_lines:
            if line.fate or not line.jobs:
                continue
            job = line.jobs[-1]
            if job.fate == "completed":
                line.end = job.finish_time
                line.fate = "completed" if job.finish_time <= line.deadline else "late"
            else:
                line.fate = "failed"
        return summarize_batch(
            self.batch_lines,
            self.jobs,
            prefill_instances=self.params.prefill,
            run_end=self.last_exit,
        )

    def _left(self, t: float, job: Job) -> None:
        """A request left the system at `t` (finished, rejected or cancelled); a batch
        line's try that ended other than refused ends its line."""
        self.open -= 1
        self.last_exit = t
        if job.line >= 0 and job.fate != "rejected":
            self._next_line(t)

    def _next_line(self, t: float) -> None:
        """A worker slot is free at `t`: the next line not started yet is tried."""
        if self.batch_queue:
            self.batch_waiting += 1
            self._push(t, _BATCH_TRY, self.batch_queue.popleft().index, None)

    def _busy(self) -> bool:
        return self.arrived < len(self.items) or self.open > 0 or self.batch_waiting > 0

    def _start_cluster(self) -> None:
        emit = self.emit
        emit(configured_event(self.cfg, self.cost, "conductor-sim"))
        bs = self.bs
        for kv in self.kvstores:
            emit(
                ev.InstanceUp(
                    instance_id=kv.instance_id, role="kvstore", host=kv.host, epoch=1,
                    block_size=bs, kv_capacity_blocks=kv.capacity,
                )
            )  # fmt: skip
            emit(kv.cleared(0.0))
        for p, pf in enumerate(self.prefills):
            if self.engine_state[pf.instance_id] == _UP:
                self._announce_prefill(p, 0.0)
        for j, d in enumerate(self.decodes):
            if self.engine_state[d.instance_id] == _UP:
                self._announce_decode(j, 0.0)

    def _announce_prefill(self, p: int, t: float) -> None:
        pf = self.prefills[p]
        bs = self.bs
        epoch = self.epochs[pf.instance_id] = self.epochs.get(pf.instance_id, 0) + 1
        group, (start, end) = self.stage_of.get(pf.instance_id, ("", (0, 0)))
        self.emit(
            ev.InstanceUp(
                time=t, instance_id=pf.instance_id, role="prefill", host=pf.host, epoch=epoch,
                block_size=bs, max_batch_size=1, group=group, layer_start=start,
                layer_end=end, num_layers=self.params.model_layers if group else 0,
                chunk_tokens=self.params.chunk_tokens if group else 0,
                tensor_parallel=self.prefill_tp,
                transfer_lanes=self.prefill_cost.tensor_parallel.transfer_lanes,
            )
        )  # fmt: skip

    def _announce_decode(self, j: int, t: float) -> None:
        d = self.decodes[j]
        bs = self.bs
        epoch = self.epochs[d.instance_id] = self.epochs.get(d.instance_id, 0) + 1
        self.emit(
            ev.InstanceUp(
                time=t, instance_id=d.instance_id, role="decode", host=self._decode_host(j),
                epoch=epoch, block_size=bs, max_batch_size=d.max_batch,
                kv_capacity_blocks=d.kv_capacity // bs, piggyback=self.params.piggyback,
                tensor_parallel=self.decode_tp,
                transfer_lanes=self.decode_cost.tensor_parallel.transfer_lanes,
            )
        )  # fmt: skip

    # --- elastic pools --------------------------------------------------------------------

    def _actuate(self, plan: ev.PoolPlanned) -> None:
        """Carry out the planner's actions, as `yb up --elastic` does."""
        self.plans.append(plan)
        t = plan.time
        for action in plan.actions:
            if action.action == "add":
                self.pool_actions += self._start_engine(action.role, t)
            elif self.engine_state.get(action.instance_id) == _UP:
                self.pool_actions += 1
                if action.action == "move":
                    self.restart_as[action.instance_id] = action.role
                self.engine_state[action.instance_id] = _DRAINING
                self.draining.add(action.instance_id)
                self.emit(
                    ev.InstanceDraining(
                        time=t, instance_id=action.instance_id, reason=plan.reason,
                        deadline=t + self.params.request_timeout_s,
                    )
                )  # fmt: skip
                self._stop_drained(t)

    def _start_engine(self, role: str, t: float) -> int:
        """Start a stopped engine of `role`: up `start_s` from `t`. 0 when every
        engine of the role is held already (the budget is the actuator's too)."""
        ids = [e.instance_id for e in (self.prefills if role == "prefill" else self.decodes)]
        for index, instance_id in enumerate(ids):
            if self.engine_state[instance_id] == _DOWN:
                self.engine_state[instance_id] = _STARTING
                self.held_since[instance_id] = t
                self._push(t + self.params.start_s, _INSTANCE_UP, index, role)
                return 1
        return 0

    def _instance_up(self, index: int, role: str, t: float) -> None:
        if role == "prefill":
            instance_id = self.prefills[index].instance_id
            self.engine_state[instance_id] = _UP
            self._announce_prefill(index, t)
        else:
            instance_id = self.decodes[index].instance_id
            self.engine_state[instance_id] = _UP
            self._announce_decode(index, t)

    def _stop_drained(self, t: float) -> None:
        """Stop the draining engines that hold no work any more."""
        instances = self.conductor.state.instances
        for instance_id in sorted(self.draining):
            inst = instances.get(instance_id)
            if inst is not None and (inst.prefill_queue or inst.assigned):
                continue
            p = self.prefill_index.get(instance_id)
            if p is not None and self.prefills[p].in_flight:
                continue
            self.draining.discard(instance_id)
            self.engine_state[instance_id] = _DOWN
            self.emit(ev.InstanceDown(time=t, instance_id=instance_id, reason="drained"))
            self._release(instance_id, t)
            role = self.restart_as.pop(instance_id, "")
            if role:
                self._start_engine(role, t)

    def _release(self, instance_id: str, t: float) -> None:
        since = self.held_since.pop(instance_id, None)
        if since is not None:
            self.held_s += max(0.0, t - since)

    # --- requests -------------------------------------------------------------------------

    def _batch_try(self, line: BatchLine, t: float) -> None:
        """Try `line` again at `t` (a request of its own), unless it is due."""
        if t >= line.deadline:
            line.fate, line.end = "timed_out", t
            self._next_line(t)
            return
        job = Job(
            line.try_item(t, len(self.items) + len(self.batch_jobs)), priority=-1, line=line.index
        )
        line.jobs.append(job)
        self.batch_jobs.append(job)
        self._arrive(job, t)

    def _batch_refused(self, job: Job, retry_after_s: float, t: float) -> None:
        """A try of a batch line was refused: the next one after the back-off, or the
        line timed out when its deadline is no further away than that."""
        line = self.batch_lines[job.line]
        line.held += 1
        wait = line.wait_s(retry_after_s, self.batch_rng.random())
        if line.deadline - t > wait:
            self.batch_waiting += 1
            self._push(t + wait, _BATCH_TRY, line.index, None)
        else:
            line.fate, line.end = "timed_out", t
            self._next_line(t)

    def _arrive(self, job: Job, t: float) -> None:
        item = job.item
        self.open += 1
        batch = job.line >= 0
        deadline = t + self.params.request_timeout_s
        if batch:
            deadline = min(deadline, self.batch_lines[job.line].deadline)
        admitted = ev.RequestAdmitted(
            time=t,
            request_id=item.request_id,
            gateway_id="sim",
            model="",
            block_size=self.bs,
            block_hashes=item.keys,
            prompt_tokens=item.prompt_tokens,
            max_tokens=max(self.params.max_tokens, item.output_tokens)
            if self.params.max_tokens
            else item.output_tokens,
            slo=self.batch_slo if batch else self.slo,
            deadline=deadline,
            priority=job.priority,
            service_tier="flex" if batch else "",
            batch=batch,
            batch_deadline=self.batch_lines[job.line].deadline if batch else 0.0,
        )
        for out in self.emit(admitted):
            # The live service publishes the decision; the conductor sees it again.
            self.emit(out)
            if isinstance(out, ev.RequestScheduled):
                self.decisions += 1
                self._schedule(job, out, t)
            elif isinstance(out, ev.RequestRejected):
                self.decisions += 1
                job.fate = "rejected"
                job.reason = out.reason
                self._left(t, job)
                if batch:
                    self._batch_refused(job, out.retry_after_s, t)
            elif isinstance(out, ev.ReplicationPlanned):
                self._replicate(out, t)
            elif isinstance(out, ev.RetentionPlanned) and out.instance_id in self.kvstore_by_id:
                self.kvstore_by_id[out.instance_id].advise(out, t)

    def _schedule(self, job: Job, d: ev.RequestScheduled, t: float) -> None:
        job.decode = self.decode_index[d.decode_instance]
        job.plan = d.reuse
        job.estimated_work_s = d.estimates.transfer_s + d.estimates.prefill_s
        if d.piggyback:
            self._piggyback(job, t)
            return
        p = self.prefill_index[d.prefill_instance]
        job.prefill = p
        job.stages = len(d.prefill_stages)
        inst = self.prefills[p]
        if inst.current is None:
            self._start(p, job, t)
        else:
            inst.push(job)
            self._pause_later(p, t)

    def _pause_later(self, p: int, t: float) -> None:
        """Work of a higher priority than the batch line prefilling on `p` waits: the
        line pauses once the layer it is computing ends (its next step), after at
        least one step of its run (when it would not end first)."""
        inst = self.prefills[p]
        job = inst.current
        if not self.preempt or job is None or job.line < 0 or job.step_s <= 0.0:
            return
        if not inst.queue or -inst.queue[0][0] <= job.priority:
            return
        if job.pause_at >= t:
            return  # paused at the next boundary already
        steps = max(1, math.ceil((t - job.compute_from) / job.step_s - 1e-9))
        at = job.compute_from + steps * job.step_s
        if at < job.done_at - 1e-9:
            job.pause_at = at
            self._push(at, _PAUSE, p, job)

    def _pause(self, p: int, job: Job, t: float) -> None:
        """Pause `job` (a batch line's prefill) on `p` at a layer boundary, if work
        of a higher priority still waits, and start that work; the line keeps its
        place ahead of the rest of its priority."""
        inst = self.prefills[p]
        if inst.current is not job or job.pause_at != t:
            return
        job.pause_at = -1.0
        if not inst.queue or -inst.queue[0][0] <= job.priority:
            return
        job.left_s = job.done_at - t
        job.runs.append((job.prefill_start if not job.runs else job.compute_from, t))
        job.done_at = -1.0
        inst.current = None
        inst.push_back(job)
        while inst.queue and not self._start(p, inst.pop(), t):
            pass

    def _resume(self, p: int, job: Job, t: float) -> None:
        """Resume a paused batch line's prefill on `p` at `t`."""
        inst = self.prefills[p]
        job.compute_from = t
        job.done_at = t + job.left_s
        job.left_s = 0.0
        inst.current = job
        inst.busy_until = job.done_at
        self._push(job.done_at, _PREFILL_DONE, p, job)

    def _start(self, p: int, job: Job, t: float) -> bool:
        """Start `job` on prefill `p` at `t` (resume it, when paused); False if it
        had timed out instead."""
        inst = self.prefills[p]
        if job.left_s > 0.0:
            self._resume(p, job, t)
            return True
        item = job.item
        if t - item.arrival > self.params.request_timeout_s:
            job.fate = "timed_out"
            job.reason = "timeout: prefill not started in time"
            self._left(t, job)
            self.emit(ev.RequestCancelled(time=t, request_id=item.request_id, reason="timeout"))
            return False
        if self.params.decode_admission != "queue":
            # The prefill's first step reserves the request's KV on its decode instance
            # (`ReserveKV`), which refuses at once when it has no room.
            d = self.decodes[job.decode]
            refusal = d.kv_refusal(job, t)
            if refusal:
                self._decode_rejected(job, d, refusal, t)
                return False
            d.reserve(job)
            if d.batch:
                # Fewer pages free: the batch may run out of them sooner.
                self._wake_later(job.decode)
        self.emit(
            ev.RequestProgress(
                time=t, request_id=item.request_id, instance_id=inst.instance_id,
                stage="prefill_started",
            )
        )  # fmt: skip
        bs = self.bs
        keys = item.keys[: (item.prompt_tokens - 1) // bs]
        kv = inst.kvstore
        local = kv.prefix(keys)
        pulled = 0
        source: SimKvstore | None = None
        for run in job.plan:
            holder = self.kvstore_by_id.get(run.source_instance)
            if holder is None or holder is kv:
                continue
            end = run.first_block + run.num_blocks
            if end <= local + pulled:
                continue
            have = holder.prefix(keys[:end])
            if have > local + pulled:
                pulled, source = have - local, holder
        cost = self.prefill_cost
        if local:
            kv.touch(keys[:local])
        if pulled and source is not None:
            source.touch(keys[local : local + pulled])
        cached = (local + pulled) * bs
        new = item.prompt_tokens - cached
        if inst.shares:
            # Each stage loads its share of every block; the slowest stage's load
            # counts. Then the pipeline.
            work = 0.0
            for share, host in zip(inst.shares, inst.hosts, strict=True):
                load = cost.load_s(local, bs, "dram", host != inst.host, share) if local else 0.0
                if pulled:
                    load += cost.load_s(pulled, bs, "dram", True, share)
                work = max(work, load)
            work += cost.pipeline_prefill_s(new, cached, inst.shares, self.params.chunk_tokens)
        else:
            work = cost.load_s(local, bs, "dram", remote=False) if local else 0.0
            if pulled:
                work += cost.load_s(pulled, bs, "dram", remote=True)
            compute = cost.prefill_s(new, cached)
            work += compute
            if job.line >= 0 and new > 0:
                # One layer of one engine chunk: how far apart the points it may
                # hold at are.
                chunk = min(new, self.params.preempt_tokens)
                job.step_s = compute * chunk / new / self.params.model_layers
        jitter = self.params.jitter
        scale = 1.0 + jitter * (2.0 * self.rng.random() - 1.0) if jitter else 1.0
        work *= scale
        job.step_s *= scale
        job.prefill_start = t
        job.prefill_s = work
        job.reused_local = local
        job.reused_remote = pulled
        job.compute_from = t + work - (compute * scale if job.step_s > 0.0 else 0.0)
        job.done_at = t + work
        inst.current = job
        inst.busy_until = t + work
        self._push(t + work, _PREFILL_DONE, p, job)
        return True

    def _decode_host(self, j: int) -> str:
        """The host of decode instance `j` (see `decode_pools`)."""
        pool = self.decode_pools[j]
        return pool.host if pool is not None else f"decode-host-{j}"

    def _piggyback(self, job: Job, t: float) -> None:
        """The decode instance takes the prompt into its batch: it loads the plan's
        blocks from the pool (when the source still holds them; over the network
        unless from its host's kvstore), then computes the rest in its steps."""
        d = self.decodes[job.decode]
        item = job.item
        job.piggyback = True
        refusal = d.refusal(job, t)
        if refusal:
            self._decode_rejected(job, d, refusal, t)
            return
        bs = self.bs
        keys = item.keys[: (item.prompt_tokens - 1) // bs]
        cached = 0
        remote = True
        for run in job.plan:
            holder = self.kvstore_by_id.get(run.source_instance)
            if holder is not None:
                cached = max(cached, holder.prefix(keys[: run.first_block + run.num_blocks]))
                holder.touch(keys[:cached])
                remote = holder is not self.decode_pools[job.decode]
        load = self.decode_cost.load_s(cached, bs, "dram", remote=remote) if cached else 0.0
        if remote:
            job.reused_remote = cached
        else:
            job.reused_local = cached
        job.prefill_start = t
        d.add_prompt(job, t + load, cached * bs)
        self._wake_later(job.decode)

    def _prefill_done(self, p: int, job: Job, t: float) -> None:
        inst = self.prefills[p]
        inst.current = None
        item = job.item
        job.prefill_end = t
        self._store_prompt(inst.kvstore, item, t)
        self._prefill_done_event(job, inst.instance_id, t)
        self._to_decode(job, t)
        while inst.queue and not self._start(p, inst.pop(), t):
            pass

    def _store_prompt(self, kv: SimKvstore, item: TraceItem, t: float) -> None:
        """A computed prompt's full blocks into the pool `kv` (its engine's host's),
        as the engine puts them there when its prefill ends at `t`."""
        for event in kv.store(item.keys[: item.prompt_tokens // self.bs], t):
            self.emit(event)

    def _prefill_done_event(self, job: Job, instance_id: str, t: float) -> None:
        """Log that `job`'s prefill ended on `instance_id`, with what it reused."""
        item = job.item
        cached = (job.reused_local + job.reused_remote) * self.bs
        self.emit(
            ev.RequestProgress(
                time=t, request_id=item.request_id, instance_id=instance_id,
                stage="prefill_done", computed_tokens=item.prompt_tokens - cached,
                reused_tokens=cached,
            )
        )  # fmt: skip

    def _to_decode(self, job: Job, t: float) -> None:
        d = self.decodes[job.decode]
        item = job.item
        refusal = d.refusal(job, t)
        if refusal:
            # Under `engine` only a full batch is left here (its KV is reserved and the
            # TBT is no reason): the engine's batcher parks the request until a slot frees.
            never_fits = d.prompt_pages(job) > d.page_capacity
            if self.params.decode_admission != "reject" and not never_fits:
                if job.kv_held:
                    # Its KV landed in the pages reserved for it: committed now, parked.
                    self._committed(job, d, t)
                d.wait(job, t)
                return
            d.release(job)
            self._decode_rejected(job, d, refusal, t)
            return
        self._committed(job, d, t)
        if item.output_tokens <= 1:
            d.release(job)
            job.finish_time = t
            self._finished(job, d, t)
            return
        d.admit(job, t)
        self._wake_later(job.decode)

    def _decode_rejected(self, job: Job, d: SimDecode, refusal: str, t: float) -> None:
        """The decode instance refused `job` (its prefill, if any, wasted)."""
        job.fate = "decode_rejected"
        job.reason = refusal
        self._left(t, job)
        self.emit(
            ev.RequestFinished(
                time=t, request_id=job.item.request_id, instance_id=d.instance_id,
                outcome="rejected", reason=refusal, prompt_tokens=job.item.prompt_tokens, attempt=0,
            )
        )  # fmt: skip

    def _committed(self, job: Job, d: SimDecode, t: float) -> None:
        self.emit(
            ev.RequestProgress(
                time=t, request_id=job.item.request_id, instance_id=d.instance_id,
                stage="kv_committed",
            )
        )  # fmt: skip

    def _finished(self, job: Job, d: SimDecode, t: float) -> None:
        item = job.item
        job.fate = "completed"
        self._left(t, job)
        self.emit(
            ev.RequestFinished(
                time=t, request_id=item.request_id, instance_id=d.instance_id,
                outcome="completed", prompt_tokens=item.prompt_tokens,
                output_tokens=item.output_tokens, ttft_s=job.ttft_s, tbt_mean_s=job.tbt_s,
                attempt=0,
            )
        )  # fmt: skip

    def _kv_exhausted(self, job: Job, d: SimDecode, t: float) -> None:
        """The decode instance ended `job` mid-stream for lack of KV pages. The engine
        reports it as the live service does (completed, reason `kv_exhausted`, with
        the tokens it had); the run counts it as failed."""
        item = job.item
        job.fate = "kv_exhausted"
        job.reason = f"kv_exhausted: after {job.generated} of {item.output_tokens} tokens"
        self._left(t, job)
        gaps = job.generated - 1
        start = job.parked_at if job.parked_at >= 0 else job.join_time
        self.emit(
            ev.RequestFinished(
                time=t, request_id=item.request_id, instance_id=d.instance_id,
                outcome="completed", reason=ev.CUT_SHORT_REASON, prompt_tokens=item.prompt_tokens,
                output_tokens=job.generated, ttft_s=job.ttft_s,
                tbt_mean_s=(t - start) / gaps if gaps > 0 else 0.0, attempt=0,
            )
        )  # fmt: skip

    def _wake_later(self, j: int) -> None:
        d = self.decodes[j]
        at = d.next_wake()
        if at < math.inf:
            self._push(at, _DECODE_WAKE, j, d.version)

    def _decode_wake(self, j: int, t: float) -> None:
        d = self.decodes[j]
        done, joined, started, prompted, ended = d.wake(t)
        for job in done:
            self._finished(job, d, t)
        # Requests that waited for room took their place now.
        for job in joined:
            if not job.kv_held:
                self._committed(job, d, t)
        pool = self.decode_pools[j]
        for job in prompted:
            item = job.item
            job.prefill_end = t
            job.prefill_s = t - job.prefill_start
            if pool is not None:
                self._store_prompt(pool, item, t)
            self._prefill_done_event(job, d.instance_id, t)
            self._committed(job, d, t)
            if item.output_tokens <= 1:
                job.finish_time = t
                self._finished(job, d, t)
        # After their joins and first tokens are logged.
        for job in ended:
            self._kv_exhausted(job, d, t)
        for job in started:
            self.emit(
                ev.RequestProgress(
                    time=t, request_id=job.item.request_id, instance_id=d.instance_id,
                    stage="prefill_started",
                )
            )  # fmt: skip
        self._wake_later(j)

    # --- replication, reports, samples -----------------------------------------------------

    def _replicate(self, plan: ev.ReplicationPlanned, t: float) -> None:
        target = self.kvstore_by_id.get(plan.target_instance)
        if target is None:
            return
        keys = list(plan.block_hashes)
        at = t + self.cost.load_s(len(keys), self.bs, "dram", remote=True)
        self._push(at, _REPLICATE, self.kvstores.index(target), keys)

    def _replicated(self, k: int, keys: list[int], t: float) -> None:
        for event in self.kvstores[k].store(keys, t):
            self.emit(event)

    def _report(self, t: float) -> None:
        emit = self.emit
        serving = (_UP, _DRAINING)
        for kv, pf in zip(self.kvstores, self.prefills, strict=True):
            emit(
                ev.LoadReport(
                    time=t, instance_id=kv.instance_id, role="kvstore",
                    kv_used_blocks=len(kv.blocks), kv_total_blocks=kv.capacity,
                    dram_blocks=len(kv.blocks),
                )
            )  # fmt: skip
            if self.engine_state[pf.instance_id] not in serving:
                continue
            emit(
                ev.LoadReport(
                    time=t, instance_id=pf.instance_id, role="prefill",
                    queued_requests=len(pf.queue),
                    running_requests=1 if pf.current is not None else 0,
                )
            )  # fmt: skip
        for d in self.decodes:
            if self.engine_state[d.instance_id] not in serving:
                continue
            emit(
                ev.LoadReport(
                    time=t, instance_id=d.instance_id, role="decode",
                    queued_requests=len(d.waiting), running_requests=d.running,
                    kv_used_blocks=d.used_pages(t), kv_total_blocks=d.page_capacity,
                    last_step_s=d.step_s(),
                )
            )  # fmt: skip
        if self._busy():
            self._push(t + self.params.report_interval_s, _REPORT, 0, None)

    def _sample(self, t: float) -> None:
        load = self.load
        backlog = 0.0
        in_flight = 0
        state = self.engine_state
        prefills = [pf for pf in self.prefills if state[pf.instance_id] in (_UP, _DRAINING)]
        decodes = [d for d in self.decodes if state[d.instance_id] in (_UP, _DRAINING)]
        for pf in prefills:
            if pf.current is not None and pf.busy_until > t:
                backlog += pf.busy_until - t
            backlog += math.fsum(job.estimated_work_s for job in pf.queued())
            in_flight += pf.in_flight
        slo = self.params.tbt_slo_s
        ratio = math.fsum(d.step_s() for d in decodes) / (max(1, len(decodes)) * slo)
        load.t.append(round(t, 3))
        load.prefill_backlog_s.append(round(backlog / max(1, len(prefills)), 4))
        load.prefill_in_flight.append(in_flight)
        load.decode_tbt_ratio.append(round(ratio, 4))
        load.decode_running.append(sum(d.running for d in decodes))
        if self._busy():
            self._push(t + self.params.sample_interval_s, _SAMPLE, 0, None)


def with_bandwidth(cost: CostModel, gbps: float) -> CostModel:
    """The cost model with host-to-host DRAM bandwidth `gbps` (0: unchanged)."""
    if gbps <= 0:
        return cost
    transfer = msgspec.structs.replace(cost.transfer, dram_remote_gbps=gbps)
    return msgspec.structs.replace(cost, transfer=transfer)
