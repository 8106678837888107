"""The conductor service against a real nats-server: decisions land in the log."""

from __future__ import annotations

import asyncio

from yb_conductor.service import ConductorService
from yb_shared import events as ev
from yb_shared.bus import Bus
from yb_shared.config import NatsConfig, YbConfig


async def _decisions(bus: Bus, want: int, timeout_s: float = 10.0) -> list[ev.AnyEvent]:
    reader = await bus.read_ordered("yb.ev.decision.>")
    found: list[ev.AnyEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(found) < want and loop.time() < deadline:
        item = await reader.next(timeout_s=0.5)
        if item is not None:
            found.append(item.event)
    await reader.close()
    return found


async def test_decides_from_the_log_and_does_not_redecide_after_restart(
    bus: Bus, nats_config: NatsConfig
) -> None:
    cfg = YbConfig(instance_id="cond-1", nats=nats_config)
    for e in (
        ev.InstanceUp(instance_id="p0", role="prefill", host="h", model="m"),
        ev.InstanceUp(instance_id="d0", role="decode", host="h", model="m"),
    ):
        await bus.publish(e)
    service = ConductorService(cfg)
    await service.start()
    try:
        await bus.publish(
            ev.RequestAdmitted(
                request_id="r1",
                gateway_id="g",
                model="m",
                block_size=16,
                block_hashes=[],
                prompt_tokens=10,
                max_tokens=4,
            )
        )
        (decision,) = await _decisions(bus, 1)
        assert isinstance(decision, ev.RequestScheduled)
        assert (decision.prefill_instance, decision.decode_instance) == ("p0", "d0")
    finally:
        await service.stop()
        await service.stop()

    # A new conductor replays the log: the decision is reproduced, not published twice.
    again = ConductorService(YbConfig(instance_id="cond-2", nats=nats_config))
    await again.start()
    try:
        await bus.publish(
            ev.RequestAdmitted(
                request_id="r2",
                gateway_id="g",
                model="m",
                block_size=16,
                block_hashes=[],
                prompt_tokens=10,
                max_tokens=4,
            )
        )
        found = await _decisions(bus, 3, timeout_s=3.0)
        assert [d.request_id for d in found] == ["r1", "r2"]  # type: ignore[union-attr]
        assert again.conductor.divergences == []
    finally:
        await again.stop()
