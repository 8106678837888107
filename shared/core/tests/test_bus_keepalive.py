"""The bus's keepalive against a real nats-server that stops answering.

A link that is cut and comes back leaves the server's socket to a client in TCP's
retransmission backoff: for tens of seconds the client's publishes reach the server
while nothing reaches the client. Without a keepalive of its own the client keeps that
connection (nats-py's default: a PING every two minutes), and an instance heartbeats
without hearing its requests. A stopped server (SIGSTOP) is the same from the client's
side, without a network: its socket stays open, the kernel accepts what is sent, and
no PONG comes back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import msgspec

from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_tools.natsserver import NatsServer


async def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `check()`; the seconds it took. Fails at the deadline."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"no {what} within {timeout_s:g}s"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_connection_that_stops_answering_is_replaced(
    nats_server: NatsServer, nats_config: NatsConfig
) -> None:
    cfg = msgspec.structs.replace(
        nats_config,
        ping_interval_s=0.2,
        max_outstanding_pings=2,
        connect_timeout_s=0.5,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.2,
    )
    states: list[str] = []

    async def on_state(state: str) -> None:
        states.append(state)

    bus = await Bus.connect(cfg, "keepalive-test", timeout_s=10, on_state=on_state)
    try:
        await bus.flush()
        assert nats_server.process is not None
        pid = nats_server.process.pid
        generation = bus.generation
        os.kill(pid, signal.SIGSTOP)
        try:
            # Its socket is open and nothing is refused: only the unanswered PINGs
            # tell. The deadline is far inside nats-py's default (six minutes).
            await _wait_for(lambda: not bus.connected, 60, "drop of the silent connection")
        finally:
            os.kill(pid, signal.SIGCONT)
        # A new connection, once the server answers again; requests go through it.
        await _wait_for(lambda: bus.generation > generation, 60, "reconnect")
        assert bus.connected
        assert states[-2:] == ["disconnected", "connected"], states
        await bus.flush(timeout_s=10)
    finally:
        await bus.close()


def test_the_keepalive_is_configured_and_checked() -> None:
    cfg = NatsConfig()
    # Dropped after at most (max + 1) intervals without an answer.
    assert (cfg.max_outstanding_pings + 1) * cfg.ping_interval_s <= 10.0
    for bad in ({"ping_interval_s": 0}, {"max_outstanding_pings": 0}):
        try:
            msgspec.convert(bad, NatsConfig)
        except msgspec.ValidationError:
            continue
        raise AssertionError(f"accepted {bad}")
