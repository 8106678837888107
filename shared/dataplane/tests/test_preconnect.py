"""Pre-connect: a sender holds an endpoint to a peer once its InstanceUp arrives.

Real UCX receivers and senders; the directory is fed announcements directly (no bus).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import numpy as np
import pytest

from yb_core import events as ev
from yb_dataplane.peers import PeerDirectory, PreConnector, of_roles
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress


class Tasks:
    """A stand-in for the shell's Supervisor: owns the tasks `spawn` starts."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.tasks: list[asyncio.Task[Any]] = []

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        self.names.append(name)
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        return task

    async def settle(self) -> list[Any]:
        return await asyncio.gather(*self.tasks)


def up(instance_id: str, role: str, address: PeerAddress) -> ev.InstanceUp:
    return ev.InstanceUp(
        instance_id=instance_id, role=cast(Any, role), host="h0", ucx_address=address.to_wire()
    )


async def until(holds: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not holds():
            await asyncio.sleep(0.005)


async def test_an_announced_peer_is_connected_before_any_send(receiver: KVReceiver) -> None:
    peers = PeerDirectory(cast(Any, None))
    sender = KVSender(connect_timeout_s=20.0)
    tasks = Tasks()
    try:
        wants = of_roles({"decode", "kvstore"})
        PreConnector(peers, sender, wants, "prefill-0", tasks.spawn).start()
        assert sender.connects == 0 and receiver.connections == 0
        peers.apply(up("decode-0", "decode", receiver.address))
        await tasks.settle()
        # The endpoint exists, and the receiver has taken the connection, before any
        # transfer was asked for.
        assert sender.connected(receiver.address)
        assert sender.connects == 1
        await until(lambda: receiver.connections == 1)

        # The first transfer uses that connection: no new handshake.
        dest = np.zeros(64, np.uint8)
        res = receiver.reserve("r0", [dest], deadline_s=20.0)
        source = np.arange(64, dtype=np.uint8)
        await sender.send(receiver.address, "r0", [(0, source)], deadline_s=20.0, commit=True)
        await res.wait_committed()
        assert np.array_equal(dest, source)
        assert sender.connects == 1

        # A re-announcement of a connected peer starts nothing new.
        peers.apply(up("decode-0", "decode", receiver.address))
        assert tasks.names == ["preconnect:decode-0"]
    finally:
        await sender.close()


async def test_peers_up_before_the_start_are_connected_too(receiver: KVReceiver) -> None:
    peers = PeerDirectory(cast(Any, None))
    peers.apply(up("kvstore-0", "kvstore", receiver.address))
    sender = KVSender(connect_timeout_s=20.0)
    tasks = Tasks()
    try:
        PreConnector(peers, sender, of_roles({"kvstore"}), "prefill-0", tasks.spawn).start()
        await tasks.settle()
        assert sender.connected(receiver.address) and sender.connects == 1
    finally:
        await sender.close()


async def test_other_roles_and_itself_are_not_connected(receiver: KVReceiver) -> None:
    peers = PeerDirectory(cast(Any, None))
    sender = KVSender()
    tasks = Tasks()
    try:
        connector = PreConnector(peers, sender, of_roles({"decode"}), "decode-0", tasks.spawn)
        connector.start()
        peers.apply(up("prefill-0", "prefill", receiver.address))
        peers.apply(up("decode-0", "decode", receiver.address))  # itself
        peers.apply(ev.InstanceUp(instance_id="decode-1", role="decode", host="h0"))  # no UCX
        assert tasks.names == [] and connector.started == 0
        assert sender.connects == 0
    finally:
        await sender.close()


async def test_a_failed_preconnect_is_logged_and_the_first_send_connects(
    receiver: KVReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    # A peer that is announced but does not answer: its receiver is gone.
    gone = KVReceiver()
    gone_address = await gone.start()
    await gone.close()
    peers = PeerDirectory(cast(Any, None))
    # The production default: the pre-connect to the gone peer waits it out, and the
    # lazy connect to the live one below must fit in it (a handshake takes ~0.2 s).
    sender = KVSender(connect_timeout_s=3.0)
    tasks = Tasks()
    try:
        PreConnector(peers, sender, of_roles({"decode"}), "prefill-0", tasks.spawn).start()
        peers.apply(up("decode-9", "decode", gone_address))
        assert await tasks.settle() == [None]  # the task ended without raising
        assert not sender.connected(gone_address) and sender.connects == 0
        assert "pre-connect to" in caplog.text

        # Never fatal: the sender works, and connects lazily where nothing was ready.
        dest = np.zeros(16, np.uint8)
        res = receiver.reserve("r1", [dest], deadline_s=20.0)
        await sender.send(
            receiver.address, "r1", [(0, np.ones(16, np.uint8))], deadline_s=20.0, commit=True
        )
        await res.wait_committed()
        assert sender.connects == 1 and dest.sum() == 16
    finally:
        await sender.close()
