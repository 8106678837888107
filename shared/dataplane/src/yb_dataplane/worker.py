"""The shell every data-plane service (prefill, decode, kvstore) runs in.

A data-plane instance is a bus connection, a UCX receiver that peers reach it on, a
sender, a directory of the other instances (`PeerDirectory`, which also vets who may
connect to the receiver), its presence on the log (`InstanceUp`, load reports as
heartbeats, `InstanceDown`), usually a follower of cancellations, and supervised
tasks. `WorkerShell` owns all of that and the order it comes up and goes down in.
What a service does with it is its `Worker`: built by the service's `build` once the
shell's parts run, with every collaborator it needs passed in, so nothing in a worker
is ever missing.

Start order: metrics, bus, peer directory (followed at once), receiver, the worker
(`build`: load a model; then `Worker.open`: its log, its pool), cancellations, the
worker's own intake (`Worker.serve`), and last the announcement, after which peers
may send work; then the sender connects to the peers it may send to
(`Worker.preconnects_to`), each as it is announced. A start that fails or is
cancelled closes what it opened, in reverse, except that the transport closes before
the worker does, as in the stop order.

Stop order (`WorkerShell.stop`; each step says why it comes where it does):

0. drain (an engine: `drain_timeout_s` > 0): `InstanceDraining` goes to the log, so
   the conductor places nothing more here; the worker takes no new work
   (`Worker.drain`) but finishes what it holds, with every task and the transport
   still up, until it holds nothing (`Worker.holds_work`), the drain's deadline
   passes, or a second signal hurries it (`WorkerShell.hurry`). What is left then is
   handed off by the steps below: a request ended with a 503 is re-planned by its
   gateway onto another instance, from the tokens its client already has. The
   pool's blocks are the kvstores', not the engine's: they stay;
1. refuse: the worker stops taking new work, so nothing starts while it goes down;
2. retire: `InstanceDown`, so the conductor plans nothing more here;
3. for a worker whose work arrives over the transport itself (a store serving puts
   and fetches), close the transport now: that is how it stops taking work;
4. settle: the worker gets out what must reach the log before its tasks go;
5. cancel every supervised task and wait for them: a task cancelled mid-request
   fails that request itself, and still has the bus, the engine and the transport;
6. release: the worker ends what is left (queued jobs, reservations, streams), still
   with the bus to say so;
7. stop following cancellations;
8. close the transport (receiver, then sender; UCX is torn down off the loop);
9. close the worker's own resources (the engine thread, the store's files);
10. close the bus, last, since every step above may publish.

`stop` is idempotent and safe after a failed start.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import msgspec
from prometheus_client import CollectorRegistry

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import YbConfig
from yb_core.instance import CancellationFollower, Presence
from yb_core.kv_spec import KVCacheSpec
from yb_core.service import Service, Supervisor
from yb_core.telemetry import get_logger
from yb_dataplane.peers import PeerDirectory, PreConnector
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress

log = get_logger(__name__)

#: How often a drain looks whether the worker still holds work.
DRAIN_POLL_S = 0.05


def decided_before(decision: ev.RequestScheduled, logged_seq: int) -> bool:
    """Whether the conductor decided `decision` before an instance's drain reached the
    log at stream sequence `logged_seq` (0: it did not get there). Such a job was
    placed before the conductor could know, so a draining instance takes it, as work
    it holds: refused, its request would fail, since a gateway does not re-plan a
    refused hand-off. Any job decided later is new work, and refused."""
    return 0 < decision.admitted_seq < logged_seq


class WorkerSection(Protocol):
    """The settings every data-plane section carries (`EngineConfig`,
    `KVStoreConfig`): where its receiver listens and how often it reports load."""

    @property
    def ucx_host(self) -> str: ...

    @property
    def ucx_port(self) -> int: ...

    @property
    def load_report_interval_s(self) -> float: ...


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker announces about itself beyond who and where it is."""

    kv_capacity_blocks: int
    # An engine: bytes of one block's KV across the layers it holds.
    kv_block_bytes: int = 0
    # An engine: what one token's KV is (`InstanceUp.kv_spec`).
    kv_spec: KVCacheSpec | None = None
    max_batch_size: int = 0
    attention_backend: str = ""
    epoch: int = 0
    # Decode: it takes prompts into its batch (`InstanceUp.piggyback`).
    piggyback: bool = False
    # Prefill: a stage of a prefill group, its layers of the model's `num_layers` and
    # the group's chunk size (`InstanceUp.group`); empty `group`: the whole model.
    group: str = ""
    layer_start: int = 0
    layer_end: int = 0
    num_layers: int = 0
    chunk_tokens: int = 0
    # An engine: the ranks it spans, and the data-plane endpoints its KV moves over
    # (one: rank 0 moves every rank's pages).
    tensor_parallel: int = 1
    transfer_lanes: int = 1


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """The shell's running parts, handed to `WorkerShell.build`.

    A worker uses them and never closes them: the shell does, in its stop order.
    Tasks the worker spawns on `tasks` are cancelled at step 5 of that order.
    """

    instance_id: str
    cfg: YbConfig
    bus: Bus
    peers: PeerDirectory
    receiver: KVReceiver
    sender: KVSender
    address: PeerAddress
    tasks: Supervisor
    registry: CollectorRegistry


class Worker(abc.ABC):
    """What a data-plane service supplies to its shell: the part that is its own.

    `follows_cancellations`: whether `on_cancel` hears of every cancelled request.
    `transport_is_intake`: whether work arrives over the transport itself, so the
    shell closes it to stop taking work (step 3) rather than after the tasks.
    `preconnect_roles`: the roles of the instances this worker's sender may send to;
    the shell connects to each as soon as it is announced (`PreConnector`), or to
    those `preconnects_to` names where a worker decides by more than the role.
    """

    follows_cancellations: ClassVar[bool] = True
    transport_is_intake: ClassVar[bool] = False
    preconnect_roles: ClassVar[frozenset[str]] = frozenset()

    def preconnects_to(self, up: ev.InstanceUp) -> bool:
        """Whether this worker's sender connects to `up` as soon as it is announced."""
        return up.role in self.preconnect_roles

    @abc.abstractmethod
    def capacity(self) -> Capacity:
        """What the announcement says this instance can hold."""

    @abc.abstractmethod
    def load_report(self) -> ev.LoadReport:
        """This instance's load now (published every interval, as its heartbeat)."""

    @abc.abstractmethod
    async def serve(self) -> None:
        """Open the intake (subscriptions, receiver handlers) and spawn the worker's
        own tasks; runs before the announcement, so no work arrives earlier."""

    async def open(self) -> None:  # noqa: B027 (optional hook)
        """Start step: open what the worker holds (a log, a pool) before it serves;
        if this fails, `close` still runs."""

    def on_cancel(self, request_id: str, reason: str) -> None:
        """A request was cancelled (called on the event loop; must not block)."""
        del request_id, reason

    def refuse_work(self) -> None:  # noqa: B027 (optional hook)
        """Stop step 1: refuse new work from now on."""

    def drain(self, logged_seq: int) -> None:
        """Stop step 0: the instance drains, its `InstanceDraining` at `logged_seq`
        in the log (0: not logged). Take no new work; jobs the conductor decided
        before `logged_seq` are not new (`decided_before`). By default: refuse all."""
        del logged_seq
        self.refuse_work()

    def holds_work(self) -> bool:
        """Whether work it took is still under way; a drain waits until it is not."""
        return False

    async def settle(self) -> None:  # noqa: B027 (optional hook)
        """Stop step 4: get out what must reach the log while the tasks still run."""

    async def release(self) -> None:  # noqa: B027 (optional hook)
        """Stop step 6: end what is left, with the tasks gone and the bus still open."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop step 9: close the worker's own resources."""


W = TypeVar("W", bound=Worker)


@dataclass(slots=True)
class _Running(Generic[W]):
    """What a started shell closes in its stop order."""

    bus: Bus
    worker: W
    presence: Presence
    cancellations: CancellationFollower | None


class WorkerShell(Service, Generic[W]):
    """A data-plane service: the shared lifecycle (see the module docstring) around
    the `Worker` its subclass builds."""

    role: ev.Role

    def __init__(self, cfg: YbConfig, section: WorkerSection, drain_timeout_s: float = 0.0) -> None:
        super().__init__(cfg)
        self.section = section
        self.receiver = KVReceiver(section.ucx_host, section.ucx_port)
        self.receiver.export_metrics(self.registry)
        self.sender = KVSender()
        self._running: _Running[W] | None = None
        # Stop step 0 (0: none); the stop as a whole may take that much longer.
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = Service.stop_timeout_s + drain_timeout_s
        self._hurry = asyncio.Event()
        # Set once a stop has run its course: a second `stop` waits for it.
        self._stopped: asyncio.Event | None = None

    @abc.abstractmethod
    async def build(self, context: WorkerContext) -> W:
        """Construct this service's worker from the shell's running parts."""

    @property
    def worker(self) -> W:
        """The running worker; raises before `start` has finished or after `stop`."""
        if self._running is None:
            raise RuntimeError(f"{self.instance_id} is not running")
        return self._running.worker

    @property
    def ucx_address(self) -> str:
        """The receiver's address as announced; raises before the receiver started."""
        return self.receiver.address.to_wire()

    async def start(self) -> None:
        """Bring the shell's parts up, build the worker, announce (see the module
        docstring); on failure or cancellation, close what was opened and re-raise."""
        self.serve_metrics()
        async with contextlib.AsyncExitStack() as opened:
            # Unwinding runs last-in first-out: the tasks go first, the bus last.
            bus = await self.connect_bus()
            opened.push_async_callback(bus.close)
            peers = PeerDirectory(bus)
            await peers.open()
            # Followed from now on, so the directory is current while the worker
            # builds (a model load takes a while) and whoever connects can be vetted.
            self.tasks.spawn("peers", peers.run())
            opened.push_async_callback(self.tasks.shutdown)
            self.receiver.set_peer_check(peers.knows_worker)
            opened.push_async_callback(self._close_transport)
            address = await self.receiver.start()
            context = WorkerContext(
                instance_id=self.instance_id,
                cfg=self.cfg,
                bus=bus,
                peers=peers,
                receiver=self.receiver,
                sender=self.sender,
                address=address,
                tasks=self.tasks,
                registry=self.registry,
            )
            worker = await self.build(context)
            opened.push_async_callback(worker.close)
            # Again (it is idempotent): no transfer may still land in the worker's
            # memory (engine pages, store slots) once it closes.
            opened.push_async_callback(self._close_transport)
            await worker.open()
            cancellations = None
            if worker.follows_cancellations:
                # Subscribed before the intake opens, so no cancel is missed.
                cancellations = CancellationFollower(bus, worker.on_cancel)
                await cancellations.start()
                opened.push_async_callback(cancellations.close)
            # Again, so the worker's own tasks go before its resources (idempotent).
            opened.push_async_callback(self.tasks.shutdown)
            await worker.serve()
            presence = Presence(
                bus,
                self._announcement(address, worker.capacity()),
                worker.load_report,
                self.section.load_report_interval_s,
            )
            # An announcement cut short may have reached the log all the same.
            opened.push_async_callback(presence.retire, "stopped")
            await presence.announce()
            self.tasks.spawn("presence", presence.run())
            # After the announcement: peers answer hellos only from instances they know.
            PreConnector(
                peers, self.sender, worker.preconnects_to, self.instance_id, self.tasks.spawn
            ).start()
            if cancellations is not None:
                self.tasks.spawn("cancellations", cancellations.run())
            self._running = _Running(bus, worker, presence, cancellations)
            opened.pop_all()

    def _announcement(self, address: PeerAddress, capacity: Capacity) -> ev.InstanceUp:
        return ev.InstanceUp(
            instance_id=self.instance_id,
            role=self.role,
            host=self.cfg.host,
            model=self.cfg.model.name,
            ucx_address=address.to_wire(),
            block_size=self.cfg.model.block_size,
            kv_capacity_blocks=capacity.kv_capacity_blocks,
            kv_block_bytes=capacity.kv_block_bytes,
            kv_spec=capacity.kv_spec,
            max_batch_size=capacity.max_batch_size,
            attention_backend=capacity.attention_backend,
            epoch=capacity.epoch,
            metrics_address=self.metrics_address,
            piggyback=capacity.piggyback,
            group=capacity.group,
            layer_start=capacity.layer_start,
            layer_end=capacity.layer_end,
            num_layers=capacity.num_layers,
            chunk_tokens=capacity.chunk_tokens,
            tensor_parallel=capacity.tensor_parallel,
            transfer_lanes=capacity.transfer_lanes,
        )

    async def stop(self) -> None:
        """Go down in the order the module docstring gives; idempotent (a second call
        while the first runs waits for it)."""
        running, self._running = self._running, None
        if running is None:
            # Never started, a failed start already closed what it opened, or stopping.
            if self._stopped is not None:
                await self._stopped.wait()
            await self.tasks.shutdown()
            return
        self._stopped = stopped = asyncio.Event()
        try:
            worker = running.worker
            if self.drain_timeout_s > 0:
                await self._drain(running)
            worker.refuse_work()
            await running.presence.retire("stopped")
            if worker.transport_is_intake:
                await self._close_transport()
            await worker.settle()
            await self.tasks.shutdown()
            await worker.release()
            if running.cancellations is not None:
                await running.cancellations.close()
            await self._close_transport()
            await worker.close()
            await running.bus.close()
        finally:
            stopped.set()

    def hurry(self) -> None:
        """End the drain now (a second signal): what is left is handed off."""
        self._hurry.set()

    async def _drain(self, running: _Running[W]) -> None:
        """Stop step 0 (see the module docstring): log the drain, take no new work,
        and wait until the worker holds none, the deadline, or `hurry`."""
        worker = running.worker
        loop = asyncio.get_running_loop()
        until = loop.time() + self.drain_timeout_s
        logged_seq = await running.presence.drain("stopping", time.time() + self.drain_timeout_s)
        worker.drain(logged_seq)
        log.info("draining", timeout_s=self.drain_timeout_s, holds_work=worker.holds_work())
        hurried = asyncio.ensure_future(self._hurry.wait())
        try:
            while worker.holds_work() and not hurried.done():
                left = until - loop.time()
                if left <= 0:
                    break
                await asyncio.wait({hurried}, timeout=min(left, DRAIN_POLL_S))
        finally:
            hurried.cancel()
        held = worker.holds_work()
        why = "done" if not held else "hurried" if self._hurry.is_set() else "deadline"
        log.info("drained", outcome=why, holds_work=held)

    async def _close_transport(self) -> None:
        """Close the receiver, then the sender (both idempotent)."""
        await self.receiver.close()
        await self.sender.close()
