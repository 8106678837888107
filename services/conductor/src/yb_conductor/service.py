"""The conductor process: reads the log in order, decides, records its decisions.

On start it reads the whole log from the beginning (a snapshot will shorten that in
a later step) to rebuild its state; decisions recomputed for admissions already
decided are checked against the recorded ones instead of being published again. Once
it has caught up with the log's end as it was at start, every new admission is
decided and its decision published to the log, where the gateway picks it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import Counter, Gauge, Histogram

from yb_conductor.conductor import Conductor
from yb_conductor.policy import make_policy
from yb_shared import events as ev
from yb_shared.bus import Bus, BusError, EventReader
from yb_shared.config import YbConfig
from yb_shared.service import Service
from yb_shared.telemetry import get_logger

log = get_logger(__name__)

# A decision older than this when found unpublished after a restart is not sent: its
# gateway has given up on it.
STALE_DECISION_S = 30.0


class ConductorService(Service):
    """Runs one `Conductor` against the live event stream."""

    role = "conductor"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg)
        self.conductor = Conductor(
            make_policy(cfg.conductor.policy),
            heartbeat_timeout_s=cfg.conductor.heartbeat_timeout_s,
        )
        self.bus: Bus | None = None
        self._reader: EventReader | None = None
        self._live_from = 0
        self._live = False
        self._decisions = Counter(
            "yb_conductor_decisions_total",
            "Decisions made, by outcome",
            ["outcome"],
            registry=self.metrics,
        )
        self._latency = Histogram(
            "yb_conductor_decision_seconds",
            "Time to fold an admission and decide",
            registry=self.metrics,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self._applied = Counter(
            "yb_conductor_events_applied_total", "Events folded", registry=self.metrics
        )
        self._instances = Gauge(
            "yb_conductor_live_instances", "Live instances by role", ["role"], registry=self.metrics
        )
        self._divergences = Counter(
            "yb_conductor_divergences_total",
            "Recorded decisions this conductor would have made differently",
            registry=self.metrics,
        )

    async def start(self) -> None:
        """Connect, set up the stream, and start following the log."""
        self.serve_metrics()
        self.bus = await Bus.connect(self.cfg.nats, self.instance_id)
        await self.bus.ensure_stream()
        self._live_from = await self.bus.last_sequence()
        self._live = self._live_from == 0
        self._reader = await self.bus.read_ordered()
        await self.bus.publish(
            ev.InstanceUp(
                instance_id=self.instance_id,
                role="conductor",
                host=self.cfg.host,
                metrics_address=self.metrics_address,
            )
        )
        self.tasks.spawn("follow-log", self._follow())
        log.info("conductor_following", live_from_seq=self._live_from)

    async def _follow(self) -> None:
        assert self._reader is not None and self.bus is not None
        while True:
            item = await self._reader.next(timeout_s=1.0)
            if item is None:
                if not self._live:
                    # The log ended below `live_from` (a publish that failed): go live.
                    await self._go_live()
                continue
            started = time.perf_counter()
            decisions = self.conductor.apply(item.seq, item.event)
            self._applied.inc()
            if decisions:
                self._latency.observe(time.perf_counter() - started)
            if self._live:
                for decision in decisions:
                    await self._publish_decision(decision)
                await self._request_resyncs()
            elif item.seq >= self._live_from:
                await self._go_live()
            if isinstance(item.event, ev.InstanceUp | ev.InstanceDown | ev.LoadReport):
                for role in ("prefill", "decode", "kvstore"):
                    self._instances.labels(role).set(len(self.conductor.state.live(role)))

    async def _go_live(self) -> None:
        self._live = True
        now = self.conductor.state.now
        pending = list(self.conductor.unrecorded.values())
        log.info("conductor_live", last_seq=self.conductor.last_seq, unpublished=len(pending))
        for decision in pending:
            if decision.time >= now - STALE_DECISION_S:
                await self._publish_decision(decision)
        for divergence in self.conductor.divergences:
            self._divergences.inc()
            log.warning(
                "decision_divergence",
                seq=divergence.seq,
                request_id=divergence.request_id,
                recorded=str(divergence.recorded),
                recomputed=str(divergence.recomputed),
            )
        self.conductor.divergences.clear()

    async def _publish_decision(self, decision: ev.RequestScheduled | ev.RequestRejected) -> None:
        assert self.bus is not None
        outcome = "scheduled" if isinstance(decision, ev.RequestScheduled) else "rejected"
        self._decisions.labels(outcome).inc()
        try:
            await self.bus.publish(decision)
        except BusError as exc:
            # The gateway times out and answers 503; the admission stays in the log and
            # a conductor that catches up later publishes the decision if still fresh.
            log.error("decision_publish_failed", request_id=decision.request_id, error=str(exc))

    async def _request_resyncs(self) -> None:
        assert self.bus is not None
        wanted = self.conductor.state.resync_wanted
        while wanted:
            instance_id = wanted.pop()
            try:
                await self.bus.publish(
                    ev.ResyncRequested(
                        instance_id=instance_id,
                        requester=self.instance_id,
                        reason="gap or new epoch in block events",
                        time=self.conductor.state.now,
                    )
                )
            except BusError as exc:
                log.warning("resync_request_failed", instance=instance_id, error=str(exc))

    async def stop(self) -> None:
        """Stop following the log and close the bus; idempotent."""
        await self.tasks.shutdown()
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self.bus is not None:
            bus, self.bus = self.bus, None
            with contextlib.suppress(TimeoutError, BusError):
                await asyncio.wait_for(
                    bus.publish(ev.InstanceDown(instance_id=self.instance_id, reason="stopped")),
                    timeout=2.0,
                )
            await bus.close()
