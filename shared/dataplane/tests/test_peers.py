"""PeerDirectory: announcements folded into who is up and which UCX workers are theirs."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from yb_core import events as ev
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import PeerAddress


def up(instance_id: str, worker: bytes, host: str = "h0") -> ev.InstanceUp:
    address = PeerAddress("127.0.0.1", 7, worker).to_wire()
    return ev.InstanceUp(instance_id=instance_id, role="decode", host=host, ucx_address=address)


def directory() -> PeerDirectory:
    # `apply` and the waits need no bus: announcements are handed in directly.
    return PeerDirectory(cast(Any, None))


@pytest.mark.asyncio
async def test_a_worker_is_known_while_an_instance_that_announced_it_is_up() -> None:
    peers = directory()
    assert not await peers.knows_worker(b"w1", timeout_s=0.05)
    peers.apply(up("decode-0", b"w1"))
    assert await peers.knows_worker(b"w1", timeout_s=0)
    assert peers.address("decode-0") == PeerAddress("127.0.0.1", 7, b"w1")
    # Two instances in one process share a worker: it stays known while either is up.
    peers.apply(up("prefill-0", b"w1"))
    peers.apply(ev.InstanceDown(instance_id="decode-0"))
    assert await peers.knows_worker(b"w1", timeout_s=0)
    peers.apply(ev.InstanceDown(instance_id="prefill-0"))
    assert not await peers.knows_worker(b"w1", timeout_s=0.05)
    # A restarted instance announces a new worker: the old one is no longer vouched for.
    peers.apply(up("decode-0", b"w1"))
    peers.apply(up("decode-0", b"w2"))
    assert not await peers.knows_worker(b"w1", timeout_s=0.05)
    assert await peers.knows_worker(b"w2", timeout_s=0)


@pytest.mark.asyncio
async def test_a_hello_may_overtake_the_announcement_it_waits_for() -> None:
    peers = directory()
    waiting = asyncio.create_task(peers.knows_worker(b"late", timeout_s=60))
    found = asyncio.create_task(peers.wait_for("kvstore-1", timeout_s=60))
    await asyncio.sleep(0.05)
    assert not waiting.done() and not found.done()
    peers.apply(up("kvstore-1", b"late"))
    assert await waiting
    announcement = await found
    assert announcement is not None and announcement.instance_id == "kvstore-1"
    assert await peers.wait_for("nobody", timeout_s=0.05) is None
