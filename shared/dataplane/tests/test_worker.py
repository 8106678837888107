"""The data-plane worker shell on a real bus with real UCX: start, announce, receive,
cancel, and the stop order.

`ProbeWorker` is the smallest worker there is: it reserves one buffer on the shell's
receiver, follows cancellations, runs one task, and records what it sees at every
stop hook (whether the log holds its `InstanceDown`, whether the receiver still takes
reservations, whether its task is gone), so the order is checked by what each step
could observe, not by the order of calls alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import DecodeEngineConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_dataplane.transport import KVSender, PeerAddress, TransferCancelled
from yb_dataplane.worker import Capacity, Worker, WorkerContext, WorkerShell

INSTANCE = "probe-0"
RECEIVE_ID = "probe-transfer"
NBYTES = 64 * 1024
#: Upper bound on each wait below; generous for a loaded machine, not a speed test.
DEADLINE_S = 60.0


@dataclass
class Seen:
    """What the probe observed at one stop hook."""

    hook: str
    retired: bool = False  # the log holds this instance's InstanceDown
    receiving: bool = False  # the receiver still takes reservations
    task_running: bool = False
    bus_connected: bool = False


@dataclass
class Journal:
    """Everything the probe records, in order."""

    seen: list[Seen] = field(default_factory=list)
    opened: bool = False
    fail_open: bool = False
    cancels: asyncio.Queue[tuple[str, str]] = field(default_factory=asyncio.Queue)


class ProbeWorker(Worker):
    """Receives one transfer, follows cancellations, records every stop hook."""

    def __init__(self, context: WorkerContext, journal: Journal) -> None:
        self.context = context
        self.journal = journal
        self.buffer = np.zeros(NBYTES, dtype=np.uint8)
        self.task: asyncio.Task[None] | None = None

    def capacity(self) -> Capacity:
        return Capacity(kv_capacity_blocks=7, max_batch_size=3, attention_backend="x", epoch=5)

    def load_report(self) -> ev.LoadReport:
        return ev.LoadReport(instance_id=self.context.instance_id, role="decode", queued_requests=2)

    async def open(self) -> None:
        if self.journal.fail_open:
            raise RuntimeError("the pool's files are unreadable")
        self.journal.opened = True

    async def serve(self) -> None:
        assert self.journal.opened, "serve before open"
        self.reservation = self.context.receiver.reserve(
            RECEIVE_ID, [self.buffer], deadline_s=DEADLINE_S
        )
        self.task = self.context.tasks.spawn("probe", asyncio.Event().wait())

    def on_cancel(self, request_id: str, reason: str) -> None:
        self.journal.cancels.put_nowait((request_id, reason))

    def refuse_work(self) -> None:
        self.journal.seen.append(self._now("refuse"))

    async def settle(self) -> None:
        self.journal.seen.append(await self._observe("settle"))

    async def release(self) -> None:
        self.journal.seen.append(await self._observe("release"))

    async def close(self) -> None:
        self.journal.seen.append(await self._observe("close"))

    def _now(self, hook: str) -> Seen:
        try:
            self.context.receiver.reserve(f"probe.{hook}", [np.zeros(8, np.uint8)], deadline_s=1)
            self.context.receiver.cancel(f"probe.{hook}")
            receiving = True
        except RuntimeError:
            receiving = False
        return Seen(
            hook,
            receiving=receiving,
            task_running=self.task is not None and not self.task.done(),
            bus_connected=self.context.bus.connected,
        )

    async def _observe(self, hook: str) -> Seen:
        seen = self._now(hook)
        subject = f"yb.ev.instance.instance_down.{ev.subject_token(self.context.instance_id)}"
        # A lookup of the log, not a consumer's delivery: its answer does not depend
        # on how soon a new consumer delivers on a busy machine.
        item = await self.context.bus.last_event(subject, timeout_s=30.0)
        seen.retired = item is not None and isinstance(item.event, ev.InstanceDown)
        return seen


class StoreLikeProbe(ProbeWorker):
    """A probe whose work arrives over the transport, and that follows no cancels."""

    follows_cancellations = False
    transport_is_intake = True


class ProbeShell(WorkerShell[ProbeWorker]):
    role = "decode"

    def __init__(
        self, cfg: YbConfig, kind: type[ProbeWorker] = ProbeWorker, fail_build: bool = False
    ) -> None:
        super().__init__(cfg, cfg.decode)
        self.journal = Journal()
        self.kind = kind
        self.fail_build = fail_build

    async def build(self, context: WorkerContext) -> ProbeWorker:
        if self.fail_build:
            raise RuntimeError("no model here")
        return self.kind(context, self.journal)


def config(nats: NatsConfig) -> YbConfig:
    return YbConfig(
        instance_id=INSTANCE,
        nats=nats,
        decode=DecodeEngineConfig(load_report_interval_s=0.2),
        telemetry=TelemetryConfig(log_json=False),
    )


@pytest.fixture
async def shell(nats_config: NatsConfig) -> AsyncIterator[ProbeShell]:
    service = ProbeShell(config(nats_config))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def first_event(bus: Bus, subject: str) -> ev.AnyEvent:
    reader = await bus.read_ordered(subject)
    try:
        item = await reader.next(timeout_s=DEADLINE_S)
    finally:
        await reader.close()
    assert item is not None, f"nothing on {subject}"
    return item.event


async def test_a_worker_is_announced_with_its_capacity_and_reports_load(
    shell: ProbeShell, bus: Bus
) -> None:
    up = await first_event(bus, f"yb.ev.instance.instance_up.{ev.subject_token(INSTANCE)}")
    assert isinstance(up, ev.InstanceUp)
    assert (up.role, up.kv_capacity_blocks, up.max_batch_size, up.attention_backend) == (
        "decode",
        7,
        3,
        "x",
    )
    assert up.epoch == 5
    assert up.ucx_address == shell.ucx_address
    assert up.metrics_address == shell.metrics_address != ""
    report = await first_event(bus, f"yb.ev.instance.load_report.{ev.subject_token(INSTANCE)}")
    assert isinstance(report, ev.LoadReport) and report.queued_requests == 2


async def test_a_worker_receives_over_the_shells_transport(shell: ProbeShell) -> None:
    # The test's sender shares this process's UCX worker, which the shell announced:
    # the receiver's peer check (the directory) vouches for it.
    data = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    sender = KVSender()
    try:
        peer = PeerAddress.parse(shell.ucx_address)
        await sender.send(peer, RECEIVE_ID, [(0, data)], deadline_s=DEADLINE_S)
        await sender.commit(peer, RECEIVE_ID, deadline_s=DEADLINE_S)
    finally:
        await sender.close()
    await asyncio.wait_for(shell.worker.reservation.wait_committed(), DEADLINE_S)
    assert np.array_equal(shell.worker.buffer, data)


async def test_a_worker_hears_of_every_cancellation(shell: ProbeShell, bus: Bus) -> None:
    await bus.publish(ev.RequestCancelled(request_id="r-1", reason="client went away"))
    got = await asyncio.wait_for(shell.journal.cancels.get(), DEADLINE_S)
    assert got == ("r-1", "client went away")


async def test_stop_goes_down_in_its_order(nats_config: NatsConfig, bus: Bus) -> None:
    service = ProbeShell(config(nats_config))
    await service.start()
    worker = service.worker
    await service.stop()
    hooks = {s.hook: s for s in service.journal.seen}
    assert [s.hook for s in service.journal.seen] == ["refuse", "settle", "release", "close"]
    # Refusing comes first, with everything still up.
    assert hooks["refuse"].receiving and hooks["refuse"].task_running
    # Settling: retired (InstanceDown is in the log), the transport and tasks still up.
    assert hooks["settle"].retired and hooks["settle"].receiving
    assert hooks["settle"].task_running
    # Releasing: the tasks are gone, the transport and bus are still there.
    assert not hooks["release"].task_running and hooks["release"].receiving
    assert hooks["release"].bus_connected
    # Closing: the transport is closed (the open reservation failed), the bus is not.
    assert not hooks["close"].receiving and hooks["close"].bus_connected
    with pytest.raises(TransferCancelled, match="receiver closed"):
        await worker.reservation.wait_committed()
    assert not worker.context.bus.connected
    with pytest.raises(RuntimeError, match="not running"):
        _ = service.worker
    await service.stop()  # idempotent
    assert len(service.journal.seen) == 4
    down = await first_event(bus, f"yb.ev.instance.instance_down.{ev.subject_token(INSTANCE)}")
    assert isinstance(down, ev.InstanceDown) and down.reason == "stopped"


async def test_a_store_like_worker_stops_taking_transfers_before_it_settles(
    nats_config: NatsConfig,
) -> None:
    service = ProbeShell(config(nats_config), kind=StoreLikeProbe)
    await service.start()
    await service.stop()
    hooks = {s.hook: s for s in service.journal.seen}
    assert hooks["refuse"].receiving
    assert hooks["settle"].retired and not hooks["settle"].receiving
    assert hooks["settle"].task_running  # its tasks still run to get things out


async def test_a_failed_build_closes_what_the_shell_opened(nats_config: NatsConfig) -> None:
    service = ProbeShell(config(nats_config), fail_build=True)
    with pytest.raises(RuntimeError, match="no model here"):
        await service.start()
    # The receiver was started and is closed again; supervised tasks are shut down.
    with pytest.raises(RuntimeError, match="not running"):
        service.receiver.reserve("late", [np.zeros(8, np.uint8)], deadline_s=1)
    with pytest.raises(RuntimeError, match="after shutdown"):
        service.tasks.spawn("late", asyncio.sleep(0))
    await service.stop()  # safe after a failed start
    assert service.journal.seen == []


async def test_a_failed_open_closes_the_worker_and_the_shell(nats_config: NatsConfig) -> None:
    service = ProbeShell(config(nats_config))
    service.journal.fail_open = True
    with pytest.raises(RuntimeError, match="unreadable"):
        await service.start()
    # The worker was built, so it is closed; the receiver had closed before that.
    assert [s.hook for s in service.journal.seen] == ["close"]
    assert not service.journal.seen[0].receiving
    with pytest.raises(RuntimeError, match="after shutdown"):
        service.tasks.spawn("late", asyncio.sleep(0))
    await service.stop()
    assert len(service.journal.seen) == 1
