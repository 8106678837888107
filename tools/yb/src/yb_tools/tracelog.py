"""A recorded log from a request trace, with the real conductor in the loop.

Benchmarks and tests need logs shaped like production ones — many instances, deep
shared prefixes, block events, heartbeats, completions — without a cluster. This
module plays the cluster around a live `Conductor`: each admission from a Mooncake
trace (`yb_tools.traces`) is decided by the conductor, and the engines' answers
follow at the times its own estimates give, perturbed by seeded noise:

- a prefill instance runs its jobs one at a time; when a job ends, the prompt's
  blocks are stored in its host's kvstore (an LRU of fixed capacity, whose
  evictions are logged too) — which is how transfers replicate hot prefixes;
- the decode side commits the KV, and the request finishes after its output at the
  estimated TBT;
- every instance sends a load report every second;
- a planned replication of a hot prefix is carried out a second later.

Everything is deterministic for a given trace and seed, and the decisions in the log
are the conductor's, exactly as a live conductor records them, so a replay of the
result must reproduce every one.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from yb_conductor.conductor import Conductor
from yb_conductor.cost_model import CostModel
from yb_conductor.replay import LogRecord
from yb_conductor.settings import configured_event
from yb_core import events as ev
from yb_core.config import ConductorConfig
from yb_tools.sim.kvstore import SimKvstore
from yb_tools.traces import TRACE_BLOCK_TOKENS, TraceRecord


@dataclass(frozen=True, slots=True)
class TraceLogCluster:
    """The cluster a `TraceLog` plays: host i runs prefill-i and kvstore-i."""

    prefill: int = 64
    decode: int = 16
    kvstore_blocks: int = 50_000
    max_batch: int = 128
    decode_kv_blocks: int = 400_000


Action = Callable[[], None]


class TraceLog:
    """Builds the log; `records` grows as `run` goes."""

    def __init__(
        self,
        *,
        cluster: TraceLogCluster | None = None,
        cfg: ConductorConfig | None = None,
        cost: CostModel | None = None,
        seed: int = 0,
        speedup: float = 1.0,
        slo: ev.Slo | None = None,
        low_priority_share: float = 0.2,
        report_interval_s: float = 1.0,
    ) -> None:
        self.cluster = cluster or TraceLogCluster()
        self.cfg = cfg or ConductorConfig()
        self.conductor = Conductor(cfg=self.cfg, cost=cost)
        self.cost = cost or self.conductor.policy.cost
        self.rng = random.Random(seed)
        self.speedup = speedup
        self.slo = slo or ev.Slo(ttft_s=30.0, tbt_s=0.2)
        self.low_priority_share = low_priority_share
        self.report_interval_s = report_interval_s
        self.records: list[LogRecord] = []
        self._future: list[tuple[float, int, ev.AnyEvent | Action]] = []
        self._counter = 0
        self._seq = 0
        self._engine_free: dict[str, float] = {}
        self._kvstores: dict[str, SimKvstore] = {}
        self._host_of: dict[str, str] = {}
        self._host_of_kvstore: dict[str, str] = {}
        self._requests: dict[str, TraceRecord] = {}
        self._next_report = math.inf

    # --- plumbing ------------------------------------------------------------------------

    def emit(self, event: ev.AnyEvent) -> None:
        """Append an event to the log, let the conductor fold it, log its outputs."""
        self._seq += 1
        self.records.append(LogRecord(seq=self._seq, event=event, subject=ev.subject_for(event)))
        outputs = self.conductor.apply(self._seq, event)
        for out in outputs:
            self._seq += 1
            self.records.append(LogRecord(seq=self._seq, event=out, subject=ev.subject_for(out)))
            self.conductor.apply(self._seq, out)
            if isinstance(out, ev.RequestScheduled):
                self._run_request(out)
            elif isinstance(out, ev.ReplicationPlanned):
                # The target kvstore copies the prefix over (about a second later).
                host = self._host_of_kvstore.get(out.target_instance)
                if host is not None:
                    at = out.time + 1.0
                    self.later(at, partial(self._store, host, list(out.block_hashes), at))

    def later(self, at: float, item: ev.AnyEvent | Action) -> None:
        """Queue an engine event (or an action) for time `at`."""
        self._counter += 1
        heapq.heappush(self._future, (at, self._counter, item))

    def advance(self, t: float) -> None:
        """Emit every queued event and heartbeat due by `t`, in time order."""
        while True:
            due_future = self._future[0][0] if self._future else math.inf
            due_report = self._next_report
            if min(due_future, due_report) > t:
                return
            if due_report <= due_future:
                self._reports(due_report)
                self._next_report = due_report + self.report_interval_s
                continue
            item = heapq.heappop(self._future)[2]
            if callable(item):
                item()
            else:
                self.emit(item)

    # --- the cluster ---------------------------------------------------------------------

    def start(self, t: float = 0.0) -> None:
        """Instances come up (and the conductor records its settings)."""
        topo = self.cluster
        self.emit(configured_event(self.cfg, self.cost, "conductor-0", time=t))
        # Engines as the cost model's profile measured them: priced by it unchanged.
        tp = self.cost.tensor_parallel
        degree, lanes = tp.degree, tp.transfer_lanes
        for i in range(topo.prefill):
            host = f"host-{i}"
            kv = SimKvstore(f"kvstore-{i}", f"host-{i}", topo.kvstore_blocks)
            self._kvstores[host] = kv
            self._host_of_kvstore[kv.instance_id] = host
            self._host_of[f"prefill-{i}"] = host
            self.emit(
                ev.InstanceUp(
                    time=t, instance_id=kv.instance_id, role="kvstore", host=host, epoch=1,
                    kv_capacity_blocks=topo.kvstore_blocks, block_size=TRACE_BLOCK_TOKENS,
                )
            )  # fmt: skip
            self.emit(kv.cleared(t))
            self.emit(
                ev.InstanceUp(
                    time=t, instance_id=f"prefill-{i}", role="prefill", host=host,
                    max_batch_size=1, block_size=TRACE_BLOCK_TOKENS, tensor_parallel=degree,
                    transfer_lanes=lanes,
                )
            )  # fmt: skip
        for j in range(topo.decode):
            self.emit(
                ev.InstanceUp(
                    time=t, instance_id=f"decode-{j}", role="decode", host=f"host-{j}",
                    max_batch_size=topo.max_batch, kv_capacity_blocks=topo.decode_kv_blocks,
                    block_size=TRACE_BLOCK_TOKENS, tensor_parallel=degree, transfer_lanes=lanes,
                )
            )  # fmt: skip
        self._next_report = t + self.report_interval_s

    def fill_pool(self, blocks_per_host: int, t: float = 0.0) -> None:
        """Store `blocks_per_host` unrelated blocks in every kvstore (keys outside the
        trace's), so that the index holds as many blocks as a production pool."""
        if not self.records:
            self.start(t)
        base = 1 << 40
        for i, kv in enumerate(self._kvstores.values()):
            first = base + i * blocks_per_host
            for start in range(first, first + blocks_per_host, 10_000):
                keys = list(range(start, min(start + 10_000, first + blocks_per_host)))
                for event in kv.store(keys, t):
                    self.emit(event)

    def _reports(self, t: float) -> None:
        state = self.conductor.state
        for inst in list(state.instances.values()):
            if inst.instance_id.startswith("conductor"):
                continue
            self.emit(
                ev.LoadReport(
                    time=t,
                    instance_id=inst.instance_id,
                    role=inst.role,
                    queued_requests=inst.prefill_requests_in_flight,
                    running_requests=inst.decoding_requests,
                    kv_used_blocks=state.index.blocks_held(inst.instance_id),
                )
            )

    def admit(self, i: int, req: TraceRecord, t: float) -> None:
        """One trace request arrives at `t`."""
        rid = f"req-{i}"
        self._requests[rid] = req
        priority = -1 if self.rng.random() < self.low_priority_share else 0
        self.emit(
            ev.RequestAdmitted(
                time=t,
                request_id=rid,
                gateway_id="gw-0",
                model="",
                block_size=TRACE_BLOCK_TOKENS,
                block_hashes=list(req.hash_ids),
                prompt_tokens=max(1, req.input_length),
                max_tokens=max(1, req.output_length),
                priority=priority,
                slo=self.slo,
                deadline=t + 600.0,
            )
        )

    def _run_request(self, d: ev.RequestScheduled) -> None:
        rid, pid, did = d.request_id, d.prefill_instance, d.decode_instance
        req = self._requests.pop(rid, None)
        t = d.time
        work = (d.estimates.transfer_s + d.estimates.prefill_s) * self.rng.uniform(0.85, 1.15)
        start = max(t, self._engine_free.get(pid, t))
        end = start + work
        self._engine_free[pid] = end
        self.later(
            start,
            ev.RequestProgress(
                time=start, request_id=rid, instance_id=pid, stage="prefill_started"
            ),
        )
        host = self._host_of.get(pid)
        if host is not None and req is not None:
            self.later(end, partial(self._store, host, req.hash_ids, end))
        for instance, stage in ((did, "kv_committed"), (pid, "prefill_done")):
            self.later(
                end,
                ev.RequestProgress(
                    time=end, request_id=rid, instance_id=instance,
                    stage=stage,  # type: ignore[arg-type]
                    computed_tokens=d.computed_tokens,
                ),
            )  # fmt: skip
        out_tokens = max(1, req.output_length) if req else 1
        tbt = d.estimates.tbt_s * self.rng.uniform(0.9, 1.1)
        done = end + out_tokens * tbt
        self.later(
            done,
            ev.RequestFinished(
                time=done, request_id=rid, instance_id=did, outcome="completed",
                prompt_tokens=d.prompt_tokens, output_tokens=out_tokens,
                ttft_s=end - t, tbt_mean_s=tbt, attempt=0,
            ),
        )  # fmt: skip

    def _store(self, host: str, keys: list[int], t: float) -> None:
        kv = self._kvstores.get(host)
        if kv is not None:
            for event in kv.store(keys, t):
                self.emit(event)

    def run(self, trace: Iterable[TraceRecord], *, drain: bool = True) -> list[LogRecord]:
        """Play the trace (admissions at `timestamp / speedup`); returns the log."""
        if not self.records:
            self.start()
        last = 0.0
        for i, req in enumerate(trace):
            t = req.timestamp / 1000.0 / self.speedup
            self.advance(t)
            self.admit(i, req, t)
            last = t
        if drain:
            self.advance(last + 60.0)
            while self._future:
                self.advance(self._future[0][0])
        return self.records
