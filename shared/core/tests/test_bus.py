"""The bus against a real nats-server: stream, de-duplication, ordering, outages."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core.bus import Bus, BusUnavailable, LoggedEvent, within
from yb_core.config import NatsConfig
from yb_tools.natsserver import NatsServer, free_port


async def test_publish_is_deduplicated_by_message_id(bus: Bus) -> None:
    event = ev.RequestCancelled(request_id="r1", reason="client left")
    first = await bus.publish(event)
    again = await bus.publish(event)  # a retry of the same event
    assert first == again == await bus.last_sequence()


async def test_ordered_reader_sees_every_event_in_order(bus: Bus) -> None:
    for i in range(20):
        await bus.publish(ev.InstanceDown(instance_id=f"i{i}", time=float(i + 1)))
    reader = await bus.read_ordered(start_seq=5)
    seen = []
    # Read up to the log's end (seq 20): nothing more can come, no waiting it out.
    while not seen or seen[-1].seq < 20:
        item = await reader.next(timeout_s=60)
        assert item is not None, seen[-1:]
        seen.append(item)
    await reader.close()
    assert await bus.last_sequence() == 20
    assert [s.seq for s in seen] == list(range(5, 21))
    assert [s.event.instance_id for s in seen] == [f"i{i}" for i in range(4, 20)]  # type: ignore[union-attr]


async def test_durable_reader_resumes_after_ack(bus: Bus) -> None:
    for i in range(3):
        await bus.publish(ev.InstanceDown(instance_id=f"i{i}", time=float(i + 1)))
    reader = await bus.read_durable("t1")
    # A fetch returns what has arrived by its timeout: ask until two came.
    batch: list[tuple[LoggedEvent, Msg]] = []
    while len(batch) < 2:
        batch += await reader.fetch(2 - len(batch), timeout_s=60)
    assert [e.seq for e, _ in batch] == [1, 2]
    for _, msg in batch:
        await msg.ack_sync(timeout=60)
    await reader.close()
    reader = await bus.read_durable("t1")
    rest = await reader.fetch(10, timeout_s=60)
    # The log ends at 3, so the one event after the acknowledged ones is all there is.
    assert await bus.last_sequence() == 3
    assert [e.seq for e, _ in rest] == [3]


async def test_last_event_is_the_newest_on_its_subject_asked_of_the_stream(bus: Bus) -> None:
    subject = ev.instance_down_subject("decode-0")
    assert await bus.last_event(subject, timeout_s=30) is None
    await bus.publish(ev.InstanceDown(instance_id="decode-0", reason="first", time=1.0))
    await bus.publish(ev.InstanceDown(instance_id="decode-1", reason="other", time=2.0))
    newest = await bus.publish(ev.InstanceDown(instance_id="decode-0", reason="again", time=3.0))
    await bus.publish(ev.RequestCancelled(request_id="r1"))
    found = await bus.last_event(subject, timeout_s=30)
    assert found is not None
    assert found.seq == newest
    assert found.subject == subject
    assert found.event == ev.InstanceDown(instance_id="decode-0", reason="again", time=3.0)


async def test_garbage_on_the_stream_is_skipped(bus: Bus) -> None:
    await bus.jetstream.publish("yb.ev.req.junk", b"\xc1not msgpack")
    await bus.publish(ev.RequestCancelled(request_id="ok"))
    reader = await bus.read_ordered()
    item = await reader.next(timeout_s=60)
    await reader.close()
    assert item is not None
    assert item.seq == 2


async def test_connect_gives_up_at_its_deadline() -> None:
    cfg = NatsConfig(
        url=f"nats://127.0.0.1:{free_port()}",
        connect_timeout_s=0.2,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.2,
    )
    # It gives up (raises) instead of retrying forever, as it would without a
    # deadline; the guard only turns such a hang into a failure. How close to its
    # deadline it gives up is a matter of speed, not asserted.
    async with asyncio.timeout(60):
        with pytest.raises(BusUnavailable, match=re.escape("127.0.0.1")):
            await Bus.connect(cfg, "t", timeout_s=1.0)


async def _retries_past_one_cancel(attempts: list[int]) -> None:
    """A retry loop like nats-py's first connect when a cancel met a completing inner
    `asyncio.wait_for` on Python 3.11: that cancel is lost, the loop goes on."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
        attempts.append(1)


async def test_a_deadline_holds_even_when_a_cancel_is_swallowed() -> None:
    # `asyncio.wait_for` waits for the cancelled coroutine to end, for ever here (a
    # refused `Bus.connect` hung so in a full run); `within` cancels until it ends.
    attempts: list[int] = []
    async with asyncio.timeout(60):
        with pytest.raises(TimeoutError):
            await within(_retries_past_one_cancel(attempts), 0.05)
    seen = len(attempts)
    await asyncio.sleep(0.05)
    assert len(attempts) == seen  # ended, not left retrying


async def test_reconnects_after_server_restart(
    nats_server: NatsServer, nats_config: NatsConfig
) -> None:
    bus = await Bus.connect(nats_config, "t", timeout_s=5)
    await bus.ensure_stream()
    await bus.publish(ev.RequestCancelled(request_id="before"))
    nats_server.stop()
    # While the server is down a publish fails within its deadline instead of hanging.
    with pytest.raises(BusUnavailable):
        await bus.publish(ev.RequestCancelled(request_id="during"), timeout_s=0.5)
    nats_server.start()
    # Generous: the wait ends as soon as the client is back.
    deadline = time.monotonic() + 60
    while not bus.connected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert bus.connected
    seq = await bus.publish(ev.RequestCancelled(request_id="after"), timeout_s=60)
    assert seq == 2  # the log survived the restart (file storage)
    await bus.close()
    await bus.close()  # idempotent


async def test_request_without_responder_is_unavailable(bus: Bus) -> None:
    with pytest.raises(BusUnavailable):
        await bus.request("yb.job.nobody", b"x", timeout_s=0.5)


def test_a_server_whose_monitor_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    import socket

    # Another process took the port between `free_port` and the server's bind.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = NatsServer(
            store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log", monitor_port=taken
        )
        server.start()
        try:
            assert server.monitor_port not in (0, taken)
            assert server.varz()["server_name"] == server.server_name
            assert "address already in use" in (tmp_path / "nats.log").read_text()
        finally:
            server.stop()
