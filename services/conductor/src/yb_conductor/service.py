"""The conductor process: reads the log in order, decides, records its decisions.

On start it restores the latest snapshot (if any) and reads the log from there to
rebuild its state; decisions recomputed for admissions already decided are checked
against the recorded ones instead of being published again.

Every conductor folds the log; only the one holding the lease (`lease.Lease`)
publishes. A standby keeps folding — its state, and the decisions it would make,
are always those of the active one — and when the lease lapses it takes it, reads
up to the log's end, and goes live: it records its settings in the log
(`ConductorConfigured`, so that replays decide with them), publishes the decisions
the old one had not (de-duplicated by request id if it had), and from then on
decides every new admission. The active conductor snapshots its state every
`snapshot_every_events` events into a JetStream object store.

The active conductor also says what the fold concluded about failures: an instance
silent past the heartbeat timeout is declared dead (`InstanceDown`), and the
requests it orphaned — and those of a gateway that died or restarted — are
cancelled (`RequestCancelled`), which every engine obeys by freeing them. Both are
de-duplicated by message id, so a standby that takes over and says it again is
harmless.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js.object_store import ObjectStore
from prometheus_client import Gauge

from yb_conductor import snapshot
from yb_conductor.conductor import Conductor, Output
from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.lease import Lease
from yb_conductor.metrics import ConductorMetrics
from yb_conductor.settings import configured_event
from yb_shared import events as ev
from yb_shared.bus import Bus, BusError, EventReader
from yb_shared.config import YbConfig
from yb_shared.service import Service
from yb_shared.telemetry import get_logger

log = get_logger(__name__)

# A decision older than this when found unpublished after a restart is not sent: its
# gateway has given up on it.
STALE_DECISION_S = 30.0
#: Decisions whose publish may be in flight at once (see `_publish_output`).
_PUBLISH_WINDOW = 256
SNAPSHOT_OBJECT = "conductor-snapshot"


class ConductorService(Service):
    """Runs one `Conductor` against the live event stream."""

    role = "conductor"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg)
        self.cost: CostModel = load_cost_model(cfg.conductor.cost_model)
        self.conductor = Conductor(cfg=cfg.conductor, cost=self.cost)
        self.bus: Bus | None = None
        self.lease: Lease | None = None
        self._store: ObjectStore | None = None
        self._reader: EventReader | None = None
        self._active = False
        self._live_from = 0
        self._live = False
        self._since_snapshot = 0
        self._snapshotting = False
        # Decisions on their way to the log, oldest first (see `_publish_output`).
        self._publishing: collections.deque[asyncio.Task[None]] = collections.deque()
        self.restored_from_seq = 0
        self.m = ConductorMetrics(self.metrics)
        # What the fold believes about each instance, for operators and fault tests
        # (a dead kvstore's blocks must leave the index): refreshed on a timer.
        self._m_alive = Gauge(
            "yb_conductor_instance_alive",
            "1 while the conductor counts the instance as alive",
            ["instance"],
            registry=self.metrics,
        )
        self._m_index = Gauge(
            "yb_conductor_index_blocks",
            "Blocks the global index places on the instance",
            ["instance"],
            registry=self.metrics,
        )

    @property
    def active(self) -> bool:
        """Whether this conductor holds the lease and publishes decisions."""
        return self._active and self._live

    async def start(self) -> None:
        """Connect, restore, take the lease if free, and start following the log."""
        self.serve_metrics()
        self.bus = await self.connect_bus()
        ccfg = self.cfg.conductor
        js = self.bus.jetstream
        try:
            self._store = await js.create_object_store(
                bucket=ccfg.snapshot_bucket, replicas=self.cfg.nats.replicas
            )
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("snapshot_store_unavailable", error=repr(exc))
        await self._restore()
        self.lease = Lease(
            js,
            f"{ccfg.snapshot_bucket}_lease",
            self.instance_id,
            ccfg.lease_ttl_s,
            replicas=self.cfg.nats.replicas,
        )
        await self.lease.open()
        await self.bus.publish(
            ev.InstanceUp(
                instance_id=self.instance_id,
                role="conductor",
                host=self.cfg.host,
                metrics_address=self.metrics_address,
            )
        )
        await self._try_lead()
        self._reader = await self.bus.read_ordered(start_seq=self.conductor.last_seq + 1)
        self.tasks.spawn("follow-log", self._follow())
        self.tasks.spawn("lease", self._hold_lease())
        self.tasks.spawn("instance-gauges", self._export_instances())
        log.info(
            "conductor_following",
            from_seq=self.conductor.last_seq + 1,
            active=self._active,
            live_from_seq=self._live_from,
        )

    async def _restore(self) -> None:
        if self._store is None:
            return
        try:
            result = await self._store.get(SNAPSHOT_OBJECT)
        except nats.js.errors.ObjectNotFoundError:
            return
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("snapshot_read_failed", error=repr(exc))
            return
        try:
            snap = snapshot.decode(result.data or b"")
        except snapshot.SnapshotError as exc:
            log.warning("snapshot_unusable", error=str(exc))
            return
        self.conductor = snapshot.restore(snap)
        self.restored_from_seq = snap.last_seq
        log.info("snapshot_restored", last_seq=snap.last_seq)

    async def _try_lead(self) -> None:
        assert self.bus is not None and self.lease is not None
        if self._active or not await self.lease.acquire():
            return
        # Leading starts once the log is read up to its end as of now.
        self._live_from = await self.bus.last_sequence()
        self._active = True
        log.info("conductor_leading", live_from_seq=self._live_from)

    async def _hold_lease(self) -> None:
        assert self.lease is not None
        period = max(0.05, self.cfg.conductor.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(period)
            if self._active:
                if not await self.lease.renew():
                    log.warning("conductor_standing_down")
                    self._active = False
                    self._live = False
                    self.m.active.set(0)
            else:
                await self._try_lead()

    async def _follow(self) -> None:
        assert self._reader is not None and self.bus is not None
        while True:
            item = await self._reader.next(timeout_s=0.25)
            if item is None:
                if (
                    self._active
                    and not self._live
                    and self.conductor.last_seq
                    >= min(self._live_from, await self.bus.last_sequence())
                ):
                    # Caught up (or the log ended below `live_from`: a failed publish).
                    await self._go_live()
                continue
            started = time.perf_counter()
            outputs = self.conductor.apply(item.seq, item.event)
            self.m.applied.inc()
            if self._live:
                if outputs:
                    self.m.decided(outputs, time.perf_counter() - started)
                for out in outputs:
                    await self._publish_output(out)
                await self._publish_wants()
            elif self._active and item.seq >= self._live_from:
                await self._go_live()
            match item.event:
                case ev.InstanceUp() | ev.InstanceDown() | ev.LoadReport():
                    self.m.instances_changed(self.conductor)
                case ev.RequestFinished():
                    self.m.collect_outcomes(self.conductor)
                case _:
                    pass
            if self.conductor.divergences:
                self._report_divergences()
            self._since_snapshot += 1
            if self._live and self._since_snapshot >= self.cfg.conductor.snapshot_every_events:
                self._snapshot()

    def _snapshot(self) -> None:
        """Take a snapshot now (consistent: the fold is not running) and upload it in
        the background; one upload at a time."""
        if self._store is None or self._snapshotting:
            return
        self._since_snapshot = 0
        data = snapshot.encode(snapshot.take(self.conductor))
        self._snapshotting = True
        self.tasks.spawn("snapshot-upload", self._upload(data, self.conductor.last_seq))

    async def _upload(self, data: bytes, seq: int) -> None:
        assert self._store is not None
        try:
            await self._store.put(SNAPSHOT_OBJECT, data)
            log.info("snapshot_saved", last_seq=seq, bytes=len(data))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("snapshot_save_failed", error=repr(exc))
        finally:
            self._snapshotting = False

    async def _go_live(self) -> None:
        assert self.bus is not None
        self._live = True
        self.m.active.set(1)
        now = self.conductor.state.now
        pending = list(self.conductor.unrecorded.values())
        log.info("conductor_live", last_seq=self.conductor.last_seq, unpublished=len(pending))
        # Settings first: the fold adopts them where they land in the log.
        await self._publish(
            configured_event(self.cfg.conductor, self.cost, self.instance_id, time=now or 0.0)
        )
        for decision in pending:
            if decision.time >= now - STALE_DECISION_S:
                await self._publish_output(decision)
        await self._publish_wants()

    def _report_divergences(self) -> None:
        for divergence in self.conductor.divergences:
            self.m.divergences.inc()
            log.warning(
                "decision_divergence",
                seq=divergence.seq,
                request_id=divergence.request_id,
                recorded=str(divergence.recorded),
                recomputed=str(divergence.recomputed),
            )
        self.conductor.divergences.clear()

    async def _publish_output(self, out: Output) -> None:
        """Publish a decision without waiting for its ack before the next event.

        A burst of admissions would otherwise be decided one JetStream round trip
        apart, and a request refused late is not refused "at once". The fold has
        already counted the decision, so only the I/O is in flight, for up to
        `_PUBLISH_WINDOW` decisions. They normally reach the log in the order made (a
        task writes its message before it waits); a retried one may land later, which
        is harmless: every consumer, replay included, matches a decision to its
        request by id.
        """
        while len(self._publishing) >= _PUBLISH_WINDOW:
            await self._publishing.popleft()
        while self._publishing and self._publishing[0].done():
            self._publishing.popleft()
        name = f"publish:{getattr(out, 'request_id', type(out).__name__)}"
        self._publishing.append(self.tasks.spawn(name, self._publish(out)))

    async def _publish(self, event: ev.AnyEvent) -> None:
        assert self.bus is not None
        try:
            await self.bus.publish(event)
        except BusError as exc:
            # The gateway times out and answers 503; the admission stays in the log and
            # a conductor that catches up later publishes the decision if still fresh.
            log.error(
                "publish_failed",
                type=type(event).__name__,
                request_id=getattr(event, "request_id", ""),
                error=str(exc),
            )

    async def _publish_wants(self) -> None:
        """Publish what the fold wants the log to say: resync requests, instances
        found dead, orphaned requests to cancel (in that order: a request is
        cancelled after the instance it waited for is declared down)."""
        await self._request_resyncs()
        await self._declare_dead()
        await self._cancel_orphans()

    async def _declare_dead(self) -> None:
        assert self.bus is not None
        state = self.conductor.state
        dead = state.declared_dead
        while dead:
            instance_id = next(iter(dead))
            reason = dead.pop(instance_id)
            inst = state.instances.get(instance_id)
            if inst is None or inst.alive:
                continue  # back meanwhile (a standby's backlog)
            log.warning("instance_declared_dead", instance=instance_id, reason=reason)
            try:
                await self.bus.publish(
                    ev.InstanceDown(instance_id=instance_id, reason=reason, time=state.now)
                )
            except BusError as exc:
                log.warning("instance_down_publish_failed", instance=instance_id, error=str(exc))

    async def _cancel_orphans(self) -> None:
        assert self.bus is not None
        state = self.conductor.state
        wanted = state.cancel_wanted
        while wanted:
            request_id = next(iter(wanted))
            reason = wanted.pop(request_id)
            if request_id not in state.placements:
                continue  # finished meanwhile
            log.warning("request_orphaned", request_id=request_id, reason=reason)
            try:
                await self.bus.publish(
                    ev.RequestCancelled(request_id=request_id, reason=reason, time=state.now)
                )
            except BusError as exc:
                log.warning("cancel_publish_failed", request_id=request_id, error=str(exc))

    async def _export_instances(self) -> None:
        """Refresh the per-instance gauges from the fold, twice a second."""
        while True:
            state = self.conductor.state
            for inst in list(state.instances.values()):
                self._m_alive.labels(inst.instance_id).set(1 if inst.alive else 0)
                self._m_index.labels(inst.instance_id).set(
                    state.index.blocks_held(inst.instance_id)
                )
            await asyncio.sleep(0.5)

    async def _request_resyncs(self, reason: str = "gap or new epoch in block events") -> None:
        assert self.bus is not None
        wanted = self.conductor.state.resync_wanted
        while wanted:
            instance_id = next(iter(wanted))
            del wanted[instance_id]
            request = ev.ResyncRequested(
                instance_id=instance_id,
                requester=self.instance_id,
                reason=reason,
                time=self.conductor.state.now,
            )
            try:
                # Unique per occurrence: the event time alone repeats when the event
                # that voided the index again carried no newer time (a second gap
                # from a host whose clock is behind), and JetStream would drop it.
                await self.bus.publish(
                    request, msg_id=f"{ev.message_id_for(request)}:at:{self.conductor.last_seq}"
                )
            except BusError as exc:
                log.warning("resync_request_failed", instance=instance_id, error=str(exc))

    async def stop(self) -> None:
        """Stop following the log, hand the lease over, close the bus; idempotent."""
        if self._publishing:
            # Decisions already made still reach the log (each publish has its deadline).
            await asyncio.gather(*self._publishing, return_exceptions=True)
            self._publishing.clear()
        await self.tasks.shutdown()
        self._active = self._live = False
        self.m.active.set(0)
        if self.lease is not None:
            await self.lease.release()
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
