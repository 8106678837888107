"""Who is up, and where their UCX receivers are: a view of `InstanceUp`/`InstanceDown`.

Prefill needs two answers from it: the address of a kvstore that a decision names as
a source, and which kvstore shares this instance's host (where new blocks are
stored). Every receiver asks it whether a hello comes from one of the cluster's
processes (`knows_worker`, see `KVReceiver.set_peer_check`). All of it comes from the
instance stream (`Bus.read_instances`): the newest announcement of every instance
first, even one the event log has trimmed, then every change as it happens. That
stream copies the log's announcements a moment after the log took them, which the
waits below absorb (each has a deadline).

`PreConnector` follows the directory to connect a sender to the peers it may send to
as soon as they are announced, so that no request pays for the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Coroutine
from typing import Any

from yb_core import events as ev
from yb_core.bus import Bus, EventReader
from yb_core.telemetry import get_logger
from yb_dataplane.transport import KVSender, PeerAddress

log = get_logger(__name__)

SUBJECTS = ["yb.ev.instance.instance_up.>", "yb.ev.instance.instance_down.>"]


class PeerDirectory:
    """The instances of the cluster as their announcements describe them."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._reader: EventReader | None = None
        self._up: dict[str, ev.InstanceUp] = {}
        # The UCX worker address each instance announced (instances that share a
        # process share one).
        self._workers: dict[str, bytes] = {}
        self._changed = asyncio.Event()
        self._on_up: list[Callable[[ev.InstanceUp], None]] = []

    def on_up(self, listener: Callable[[ev.InstanceUp], None]) -> None:
        """Call `listener` with every `InstanceUp` folded from now on (on the loop;
        it must not block)."""
        self._on_up.append(listener)

    def instances(self) -> list[ev.InstanceUp]:
        """The announcements of every instance that is up."""
        return list(self._up.values())

    async def open(self) -> None:
        """Subscribe (the current state is delivered first, then changes)."""
        self._reader = await self._bus.read_instances(SUBJECTS)

    async def run(self) -> None:
        """Follow announcements until cancelled."""
        assert self._reader is not None, "open() first"
        reader = self._reader
        try:
            async for item in reader:
                self.apply(item.event)
        finally:
            with contextlib.suppress(Exception):
                await reader.close()

    def apply(self, event: ev.AnyEvent) -> None:
        """Fold one announcement."""
        match event:
            case ev.InstanceUp():
                self._up[event.instance_id] = event
                address = self.address(event.instance_id)
                if address is not None:
                    self._workers[event.instance_id] = address.worker
                else:
                    self._workers.pop(event.instance_id, None)
                for listener in self._on_up:
                    try:
                        listener(event)
                    except Exception:  # a listener's bug must not stop the directory
                        log.exception("instance_up_listener_failed", instance=event.instance_id)
            case ev.InstanceDown():
                self._workers.pop(event.instance_id, None)
                self._up.pop(event.instance_id, None)
            case _:
                return
        self._changed.set()
        self._changed = asyncio.Event()

    async def knows_worker(self, worker: bytes, timeout_s: float = 2.0) -> bool:
        """Whether an instance that is up announced this UCX worker address.

        Waits up to `timeout_s` for it: a peer's first hello can overtake its
        announcement on the way here.
        """
        return await self._until(lambda: worker in self._workers.values(), timeout_s)

    def get(self, instance_id: str) -> ev.InstanceUp | None:
        """The announcement of an instance that is up."""
        return self._up.get(instance_id)

    def address(self, instance_id: str) -> PeerAddress | None:
        """The UCX address of an instance that is up and has one."""
        up = self._up.get(instance_id)
        if up is None or not up.ucx_address:
            return None
        try:
            return PeerAddress.parse(up.ucx_address)
        except ValueError:
            return None

    def kvstore_on(self, host: str) -> ev.InstanceUp | None:
        """The kvstore on `host` (the first by id if there are several), if one is up."""
        stores = sorted(
            (u for u in self._up.values() if u.role == "kvstore" and u.host == host),
            key=lambda u: u.instance_id,
        )
        return stores[0] if stores else None

    async def wait_for(self, instance_id: str, timeout_s: float) -> ev.InstanceUp | None:
        """The announcement of `instance_id`, waiting up to `timeout_s` for it."""
        await self._until(lambda: instance_id in self._up, timeout_s)
        return self._up.get(instance_id)

    async def _until(self, holds: Callable[[], bool], timeout_s: float) -> bool:
        """Wait, up to `timeout_s`, for an announcement after which `holds()`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not holds():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True


#: How `PreConnector` starts a task (a `Supervisor.spawn`).
Spawn = Callable[[str, Coroutine[Any, Any, Any]], Any]


def of_roles(roles: Collection[str]) -> Callable[[ev.InstanceUp], bool]:
    """`PreConnector`'s test for peers of these roles."""
    wanted = frozenset(roles)
    return lambda up: up.role in wanted


class PreConnector:
    """Connects `sender` to every instance that `wants` (other than `self_id`) and
    that is up, as its `InstanceUp` arrives.

    Start it once this instance is announced: a receiver answers only hellos from
    instances it knows (`KVReceiver.set_peer_check`). A failed pre-connect is logged
    by `KVSender.preconnect`, never fatal; the first transfer connects again.
    """

    def __init__(
        self,
        peers: PeerDirectory,
        sender: KVSender,
        wants: Callable[[ev.InstanceUp], bool],
        self_id: str,
        spawn: Spawn,
    ) -> None:
        self._peers = peers
        self._sender = sender
        self._wants = wants
        self._self_id = self_id
        self._spawn = spawn
        self._connecting: set[PeerAddress] = set()
        #: Pre-connects started (one per new address of a matching instance).
        self.started = 0

    def start(self) -> None:
        """Pre-connect to the matching instances up now, and to each one announced
        from now on."""
        self._peers.on_up(self.on_up)
        for up in self._peers.instances():
            self.on_up(up)

    def on_up(self, up: ev.InstanceUp) -> None:
        """An announcement: pre-connect if it is a peer this sender wants."""
        if up.instance_id == self._self_id or not self._wants(up):
            return
        address = self._peers.address(up.instance_id)
        if address is None or address in self._connecting or self._sender.connected(address):
            return
        self._connecting.add(address)
        try:
            self._spawn(f"preconnect:{up.instance_id}", self._connect(address, up.instance_id))
        except RuntimeError:  # shutting down: nothing to connect for
            self._connecting.discard(address)
            return
        self.started += 1

    async def _connect(self, address: PeerAddress, instance_id: str) -> None:
        try:
            if await self._sender.preconnect(address):
                log.info("preconnected", peer=address.label, instance=instance_id)
        finally:
            self._connecting.discard(address)
