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

The log is bounded (by age and by bytes: `NatsConfig`), so its head goes. What
stands in for it is the snapshot, taken every `snapshot_every_events` events and
every eighth of the stream's byte limit, whichever comes first, so the retained log
reaches back to the latest snapshot with room to spare. A conductor that starts, or
a standby whose reader falls behind the trimmed head, restores the latest snapshot
when it covers everything that is gone (snapshot `last_seq` >= the log's
`first_seq` - 1) and reads on from there. When none does (no snapshot store, or a
conductor that was down while the log turned over), it says so loudly
(`event_log_gap` logged as an error, `yb_conductor_log_gap_events_total` counts the
events it never saw) and does the safe thing: it folds what remains on top of what
it had, and asks every block holder it knows for a full inventory, since the index
missed their stores and evictions. Instances whose announcement was trimmed and
that it never knew stay unknown until they announce again (a restart).

Settings recorded in the log (`ConductorConfigured`) that this conductor cannot
read stop it (`recorded_settings_unreadable` logged as an error, naming the event,
and the process exits non-zero): deciding on with other settings than recorded
would publish decisions no replay reproduces, so it refuses rather than guess. A
snapshot whose settings cannot be read is unusable like a corrupt one: the
conductor reads the log instead.

The active conductor also says what the fold concluded about failures: an instance
silent past the heartbeat timeout is declared dead (`InstanceDown`), and the
requests it orphaned — and those of a gateway that died or restarted — are
cancelled (`RequestCancelled`), which every engine obeys by freeing them. Both are
de-duplicated by message id, so a standby that takes over and says it again is
harmless. A request that a dead engine orphaned while its gateway lives is cancelled
only once `state.REPLAN_GRACE_S` of event time went by without its gateway re-planning
or ending it: a cancel logged before the re-plan would end the new attempt too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import nats.errors
import nats.js.errors
from nats.js.object_store import ObjectStore
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from prometheus_client import Gauge

from yb_conductor import snapshot
from yb_conductor.conductor import Conductor, Output
from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.lease import Lease
from yb_conductor.metrics import ConductorMetrics
from yb_conductor.settings import RecordedSettingsError, configured_event
from yb_conductor.state import BLOCK_HOLDER_ROLES, HEARTBEAT_ROLES
from yb_core import events as ev
from yb_core.bus import Bus, BusError, EventReader, LoggedEvent
from yb_core.config import YbConfig
from yb_core.service import Service
from yb_core.telemetry import extract_context, get_logger, tracer

log = get_logger(__name__)
_tracer = tracer(__name__)

# A decision older than this when found unpublished after a restart is not sent: its
# gateway has given up on it.
STALE_DECISION_S = 30.0
#: Decisions whose publish may be in flight at once (see `_publish_output`).
_PUBLISH_WINDOW = 256
SNAPSHOT_OBJECT = "conductor-snapshot"
#: A snapshot at least every 1/N of the stream's byte limit (see the docstring).
SNAPSHOT_BYTES_FRACTION = 8
#: How long reading the snapshot may take (re-reads after a rewrite included) before
#: the conductor gives up on it and reads the log instead: generous, since a large
#: snapshot on a loaded machine is slow, but finite.
SNAPSHOT_READ_TIMEOUT_S = 60.0
#: How often a snapshot read checks whether the object was rewritten under it.
_REWRITE_CHECK_S = 1.0


async def read_snapshot(
    store: ObjectStore | None, *, timeout_s: float = SNAPSHOT_READ_TIMEOUT_S
) -> snapshot.Snapshot | None:
    """The latest snapshot in `store`, or None (none yet, unreadable, unusable, not
    read within `timeout_s`: each logged, since the caller then reads more of the
    log, or cannot). A snapshot rewritten while it is read is read again."""
    if store is None:
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    rewrites = 0
    try:
        async with asyncio.timeout_at(deadline):
            while (result := await _get_unless_rewritten(store)) is None:
                rewrites += 1
    except nats.js.errors.ObjectNotFoundError:
        return None
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        log.warning("snapshot_read_failed", error=repr(exc))
        return None
    except TimeoutError:
        log.warning(
            "snapshot_read_timed_out",
            timeout_s=timeout_s,
            rewritten_while_read=rewrites,
            why="the object store did not deliver the snapshot's chunks in time",
        )
        return None
    try:
        return snapshot.decode(result.data or b"")
    except snapshot.SnapshotError as exc:
        log.warning("snapshot_unusable", error=str(exc))
        return None


async def _get_unless_rewritten(store: ObjectStore) -> ObjectStore.ObjectResult | None:
    """`store.get(SNAPSHOT_OBJECT)`, or None when the object was rewritten during it.

    nats-py's `get` reads the chunks of the version the object's meta named when it
    started, and waits for them with no deadline; a `put` of the same name meanwhile
    (the active conductor snapshots while a standby or a test reads) purges those
    chunks, so the `get` would wait for ever (a third of the gets racing a put loop
    did). So while the read runs, the meta is checked every `_REWRITE_CHECK_S`: once
    it names another version, the read is abandoned and the caller reads the new one.
    A check that fails (a slow server) proves nothing and the read goes on; the
    caller's deadline bounds it all. An abandoned read leaves its ordered consumer
    to the server's inactivity cleanup (nats-py does not unsubscribe on cancel).
    """
    version = (await store.get_info(SNAPSHOT_OBJECT)).nuid
    read = asyncio.ensure_future(store.get(SNAPSHOT_OBJECT))
    try:
        while True:
            done, _ = await asyncio.wait({read}, timeout=_REWRITE_CHECK_S)
            if done:
                return read.result()
            try:
                now = (await store.get_info(SNAPSHOT_OBJECT)).nuid
            except nats.js.errors.ObjectNotFoundError:
                return None  # deleted under the read: the caller's next try says so
            except (nats.errors.Error, nats.js.errors.Error):
                continue
            if now != version:
                return None
    finally:
        if not read.done():
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read


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
        self._bytes_since_snapshot = 0
        # Snapshot at least this often in log bytes (an eighth of the stream's byte
        # limit, read at start), so the log always reaches back to the latest one.
        self._snapshot_bytes = 0
        self._snapshotting = False
        # The log's first sequence when a gap was last reported: the reader's jump
        # up to it is that gap, not another.
        self._gap_reported_to = 0
        # A gap was found: ask every block holder for an inventory on going live.
        self._resync_all = False
        # Decisions on their way to the log, oldest first (see `_publish_output`).
        self._publishing: collections.deque[asyncio.Task[None]] = collections.deque()
        self.restored_from_seq = 0
        self.metrics = ConductorMetrics(self.registry)
        # What the fold believes about each instance, for operators and fault tests
        # (a dead kvstore's blocks must leave the index): refreshed on a timer.
        self._m_alive = Gauge(
            "yb_conductor_instance_alive",
            "1 while the conductor counts the engine or kvstore as alive (the roles "
            "that heartbeat; gateways and conductors are not placement targets)",
            ["instance"],
            registry=self.registry,
        )
        self._m_index = Gauge(
            "yb_conductor_index_blocks",
            "Blocks the global index places on the instance",
            ["instance"],
            registry=self.registry,
        )

    @property
    def active(self) -> bool:
        """Whether this conductor holds the lease and publishes decisions."""
        return self._active and self._live

    @property
    def snapshot_uploading(self) -> bool:
        """Whether a snapshot is being uploaded now (`yb_conductor_snapshot_seq` moves
        when it is stored)."""
        return self._snapshotting

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
        extent = await self.bus.log_extent()
        if extent.max_bytes > 0:
            self._snapshot_bytes = max(1, extent.max_bytes // SNAPSHOT_BYTES_FRACTION)
        if not extent.reaches(self.conductor.last_seq + 1):
            self._log_gap(extent.first_seq)
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

    async def _restore(self) -> bool:
        """Adopt the latest snapshot if it is ahead of the fold; True if adopted."""
        snap = await read_snapshot(self._store)
        if snap is None or snap.last_seq <= self.conductor.last_seq:
            return False
        try:
            self.conductor = snapshot.restore(snap)
        except snapshot.SnapshotError as exc:
            log.warning("snapshot_unusable", error=str(exc))
            return False
        self.restored_from_seq = snap.last_seq
        self.metrics.snapshot_seq.set(snap.last_seq)
        log.info("snapshot_restored", last_seq=snap.last_seq)
        return True

    def _log_gap(self, first_seq: int) -> None:
        """The log no longer holds `last_seq + 1 .. first_seq - 1` and no snapshot
        covers them: say so, and ask every block holder for its inventory (see the
        module docstring)."""
        if self.conductor.last_seq < self._gap_reported_to:
            # Nothing folded since the last report: the same gap, grown meanwhile
            # (the log kept turning over while the reader opened).
            self.metrics.log_gap_events.inc(max(0, first_seq - self._gap_reported_to))
            self._gap_reported_to = max(self._gap_reported_to, first_seq)
            return
        missing = first_seq - 1 - self.conductor.last_seq
        self._gap_reported_to = first_seq
        self._resync_all = True
        holders = self._want_inventories()
        log.error(
            "event_log_gap",
            folded_up_to=self.conductor.last_seq,
            log_starts_at=first_seq,
            missing_events=missing,
            snapshot_seq=self.restored_from_seq,
            resyncs=len(holders),
            why="trimmed by the stream's limits (nats.max_bytes, nats.max_age_s) "
            "before this conductor read it, and no snapshot reaches back that far",
        )
        self.metrics.log_gap_events.inc(missing)

    def _want_inventories(self) -> list[str]:
        """Mark every live block holder the fold knows for an inventory resync.

        Published once this conductor is live (`_publish_wants`); a standby's wants
        wait for it to take over, as every want does. Called when a gap is found
        (the holders known then) and again on going live (those the retained log
        announced since).
        """
        state = self.conductor.state
        holders = [
            i.instance_id
            for i in state.instances.values()
            if i.alive and i.role in BLOCK_HOLDER_ROLES
        ]
        for instance_id in holders:
            state.resync_wanted[instance_id] = None
        return holders

    async def _bridge_gap(self, item_seq: int) -> bool:
        """The reader jumped from the fold's `last_seq` to `item_seq`: if events were
        trimmed under it (not merely skipped as undecodable), restore the latest
        snapshot when it covers them and reopen the reader after it (True), or
        report the gap and fold on (False)."""
        assert self.bus is not None and self._reader is not None
        extent = await self.bus.log_extent()
        if extent.reaches(self.conductor.last_seq + 1):
            return False  # nothing trimmed: the reader skipped an undecodable event
        if await self._restore() and self.conductor.last_seq + 1 >= extent.first_seq:
            log.warning(
                "log_trimmed_restored_snapshot",
                log_starts_at=extent.first_seq,
                snapshot_seq=self.conductor.last_seq,
            )
            await self._reader.close()
            self._reader = await self.bus.read_ordered(start_seq=self.conductor.last_seq + 1)
            return True
        self._log_gap(min(item_seq, extent.first_seq))
        return False

    async def _try_lead(self) -> None:
        assert self.bus is not None and self.lease is not None
        if self._active or not await self.lease.acquire():
            return
        # Leading starts once the log is read up to its end as of now.
        try:
            live_from = await self.bus.last_sequence()
        except BusError as exc:
            # NATS did not say where the log ends (a leader election, an overloaded
            # server): the lease stays held and the next renewal period tries again.
            # Raising here would end the lease task, and with it this instance's
            # renewals and its every later chance to lead.
            log.warning("conductor_lead_deferred", error=str(exc))
            return
        self._live_from = live_from
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
                    self.metrics.active.set(0)
            else:
                await self._try_lead()

    async def _follow(self) -> None:
        assert self._reader is not None and self.bus is not None
        while True:
            item = await self._reader.next(timeout_s=0.25)
            if item is None:
                if self._live and self._snapshot_due():
                    # One came due while an upload was running: take it now rather
                    # than at the next event, which may be long in coming while
                    # the log keeps trimming.
                    self._snapshot()
                if (
                    self._active
                    and not self._live
                    and self.conductor.last_seq
                    >= min(self._live_from, await self.bus.last_sequence())
                ):
                    # Caught up (or the log ended below `live_from`: a failed publish).
                    await self._go_live()
                continue
            if item.seq > self.conductor.last_seq + 1 and await self._bridge_gap(item.seq):
                continue  # restored from a snapshot; the reader starts after it
            started = time.perf_counter()
            try:
                outputs = self.conductor.apply(item.seq, item.event)
            except RecordedSettingsError as exc:
                log.error(
                    "recorded_settings_unreadable",
                    seq=item.seq,
                    error=str(exc),
                    why="deciding with other settings than the log records would not "
                    "replay; this conductor stops",
                )
                raise
            self.metrics.applied.inc()
            if self._live:
                # Counted only live: a conductor catching up on the log would count
                # failures its predecessor already counted.
                self.metrics.folded(item.event, self.conductor)
                if outputs:
                    self.metrics.decided(outputs, time.perf_counter() - started)
                    await self._publish_outputs(item, outputs, started)
                await self._publish_wants()
            elif self._active and item.seq >= self._live_from:
                await self._go_live()
            match item.event:
                case ev.InstanceUp() | ev.InstanceDown() | ev.InstanceDraining() | ev.LoadReport():
                    self.metrics.instances_changed(self.conductor)
                case ev.RequestFinished():
                    self.metrics.collect_outcomes(self.conductor)
                case _:
                    pass
            if self.conductor.divergences:
                self._report_divergences()
            self._since_snapshot += 1
            self._bytes_since_snapshot += item.size
            if self._live and self._snapshot_due():
                self._snapshot()

    def _snapshot_due(self) -> bool:
        """Whether enough of the log went by since the last snapshot (events or bytes)."""
        return self._since_snapshot >= self.cfg.conductor.snapshot_every_events or bool(
            self._snapshot_bytes and self._bytes_since_snapshot >= self._snapshot_bytes
        )

    def _snapshot(self) -> None:
        """Take a snapshot now (consistent: the fold is not running) and upload it in
        the background; one upload at a time."""
        if self._store is None or self._snapshotting:
            return
        self._since_snapshot = 0
        self._bytes_since_snapshot = 0
        data = snapshot.encode(snapshot.take(self.conductor))
        self._snapshotting = True
        self.tasks.spawn("snapshot-upload", self._upload(data, self.conductor.last_seq))

    async def _upload(self, data: bytes, seq: int) -> None:
        assert self._store is not None
        try:
            await self._store.put(SNAPSHOT_OBJECT, data)
            self.metrics.snapshot_seq.set(seq)
            log.info("snapshot_saved", last_seq=seq, bytes=len(data))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("snapshot_save_failed", error=repr(exc))
        finally:
            self._snapshotting = False

    async def _go_live(self) -> None:
        assert self.bus is not None
        self._live = True
        self.metrics.active.set(1)
        now = self.conductor.state.now
        pending = list(self.conductor.unrecorded.values())
        log.info("conductor_live", last_seq=self.conductor.last_seq, unpublished=len(pending))
        if self._resync_all:
            self._resync_all = False
            self._want_inventories()
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
            self.metrics.divergences.inc()
            log.warning(
                "decision_divergence",
                seq=divergence.seq,
                request_id=divergence.request_id,
                recorded=str(divergence.recorded),
                recomputed=str(divergence.recomputed),
            )
        self.conductor.divergences.clear()

    async def _publish_outputs(
        self, item: LoggedEvent, outputs: list[Output], started: float
    ) -> None:
        """Publish what the fold made of `item` (applied from `started`, a
        `perf_counter` reading), under the decision's span when it is an admission."""
        span = _decision_span(item, outputs, started)
        # Current while the publishes start: the decision's copy in the log carries
        # its trace context, as the admission's does.
        with trace.use_span(
            span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            for out in outputs:
                await self._publish_output(out)

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
        waiting = state.cancel_not_before
        for request_id in list(wanted):
            if state.now < waiting.get(request_id, 0.0):
                continue  # its gateway may still re-plan it: asked again after each event
            reason = wanted.pop(request_id, "")
            waiting.pop(request_id, None)
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
                if inst.role not in HEARTBEAT_ROLES:
                    # A gateway or a conductor sends no heartbeat to the log, so the
                    # fold stops counting it after heartbeat_timeout_s; a 0 for it
                    # would read as a death on the liveness panel.
                    continue
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
        self.metrics.active.set(0)
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


def _decision_span(item: LoggedEvent, outputs: list[Output], started: float) -> trace.Span:
    """The span of the decision on an admission, ended at once (`INVALID_SPAN` for
    outputs of any other event).

    Its parent is the gateway's admission span, whose context came with the event
    in the log's headers. It is made here, in the live service, after the fold:
    the fold itself (`Conductor.apply`, which replays run) knows nothing of traces,
    so a replay emits no span and decides exactly as before. Its times are the
    fold's: from `started` (a `perf_counter` reading) to now.
    """
    if not isinstance(item.event, ev.RequestAdmitted | ev.RequestReplanned):
        return trace.INVALID_SPAN
    now_ns = time.time_ns()
    span = _tracer.start_span(
        "conductor decide",
        context=extract_context(item.headers),
        start_time=now_ns - int((time.perf_counter() - started) * 1e9),
    )
    if span.is_recording():
        span.set_attributes(_decision_attributes(item.seq, outputs))
        for output in outputs:
            explain = getattr(output, "explain", None)
            if explain is not None:
                _add_candidates(span, explain)
    span.end(end_time=now_ns)
    return span


def _decision_attributes(seq: int, outputs: list[Output]) -> dict[str, AttributeValue]:
    """What a trace shows of a decision: the choice, the path, the estimates."""
    attributes: dict[str, AttributeValue] = {"yb.seq": seq}
    for output in outputs:
        match output:
            case ev.RequestScheduled():
                attributes |= {
                    "yb.request_id": output.request_id,
                    "yb.attempt": output.attempt,
                    "yb.decision": "scheduled",
                    "yb.policy": output.policy,
                    "yb.prefill_instance": output.prefill_instance,
                    "yb.decode_instance": output.decode_instance,
                    "yb.prompt_tokens": output.prompt_tokens,
                    "yb.computed_tokens": output.computed_tokens,
                    "yb.reused_blocks": output.reused_blocks,
                    "yb.reuse": [
                        f"{plan.source_instance}/{plan.tier}:{plan.first_block}+{plan.num_blocks}"
                        for plan in output.reuse
                    ],
                    **_estimate_attributes(output.estimates),
                }
                if output.explain is not None:
                    attributes["yb.path"] = output.explain.branch
            case ev.RequestRejected():
                attributes |= {
                    "yb.request_id": output.request_id,
                    "yb.decision": "rejected",
                    "yb.policy": output.policy,
                    "yb.reason": output.reason,
                    "yb.retry_after_s": output.retry_after_s,
                    **_estimate_attributes(output.estimates),
                }
                if output.explain is not None:
                    attributes["yb.path"] = output.explain.branch
            case ev.LoadPrediction():
                attributes["yb.predicted_decode_batch"] = output.predicted_batch
                attributes["yb.predicted_tbt_s"] = output.predicted_tbt_s
            case ev.ReplicationPlanned():
                attributes["yb.replication"] = (
                    f"{output.source_instance} -> {output.target_instance}: "
                    f"{len(output.block_hashes)} blocks"
                )
    return attributes


def _estimate_attributes(estimates: ev.Estimates) -> dict[str, AttributeValue]:
    return {
        "yb.estimate.queue_s": estimates.queue_s,
        "yb.estimate.transfer_s": estimates.transfer_s,
        "yb.estimate.prefill_s": estimates.prefill_s,
        "yb.estimate.ttft_s": estimates.ttft_s,
        "yb.estimate.tbt_s": estimates.tbt_s,
        "yb.estimate.decode_batch": estimates.decode_batch,
    }


def _add_candidates(span: trace.Span, explain: ev.Explanation) -> None:
    """The candidates the decision weighed, one event each, best first (as `yb
    explain` prints them)."""
    for candidate in explain.candidates:
        span.add_event(
            "prefill_candidate",
            {
                "instance": candidate.instance_id,
                "option": candidate.option,
                "reuse_blocks": candidate.reuse_blocks,
                "source": candidate.source,
                "queue_s": candidate.queue_s,
                "transfer_s": candidate.transfer_s,
                "prefill_s": candidate.prefill_s,
                "ttft_s": candidate.ttft_s,
            },
        )
    for decode in explain.decode_candidates:
        span.add_event(
            "decode_candidate",
            {
                "instance": decode.instance_id,
                "batch": decode.batch,
                "predicted_batch": decode.predicted_batch,
                "tbt_s": decode.tbt_s,
            },
        )
