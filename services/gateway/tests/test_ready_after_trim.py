"""A gateway started after the event log trimmed the engines' announcements still
becomes ready: it reads them from the instance stream, which keeps the newest
instance event of each subject (`Bus.read_instances`).

Against the log alone it would see only the engines' load reports, which do not say
which model an instance serves, and `/readyz` would stay 503 for ever.
"""

from __future__ import annotations

import time

import msgspec
from gateway_testkit import MODEL, client_for, make_config, start_gateway, wait_for

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import MIN_EVENT_LOG_BYTES, NatsConfig
from yb_testkit.fixtures import flood_log

WAIT_S = 30.0


async def test_a_gateway_started_after_the_trim_becomes_ready(nats_config: NatsConfig) -> None:
    small = msgspec.structs.replace(nats_config, max_bytes=MIN_EVENT_LOG_BYTES)
    bus = await Bus.connect(small, "engines", timeout_s=10)
    try:
        await bus.ensure_stream()
        engines: list[tuple[str, ev.Role]] = [
            ("prefill-0", "prefill"),
            ("decode-0", "decode"),
            ("decode-1", "decode"),
        ]
        for iid, role in engines:
            await bus.publish(ev.InstanceUp(instance_id=iid, role=role, host="h0", model=MODEL))
        down = await bus.publish(ev.InstanceDown(instance_id="decode-1", reason="crashed"))
        await bus.sync_instances(WAIT_S)  # announced long ago: copied before the trim
        await flood_log(bus, 4 * MIN_EVENT_LOG_BYTES)
        assert not (await bus.log_extent()).reaches(down), "the log still holds them"
        # The engines still heartbeat; their reports alone make no instance known.
        for iid, role in engines[:2]:
            await bus.publish(ev.LoadReport(instance_id=iid, role=role))
        await bus.sync_instances(WAIT_S)
        info = await bus.jetstream.stream_info(bus.instance_stream)
        copied = int(info.state.messages)

        cfg = make_config(small)
        # Liveness by the report times is not what is tested here: no report may
        # age out however long the tokenizer takes to load on a busy machine.
        cfg.conductor.heartbeat_timeout_s = 3600.0
        gw = await start_gateway(cfg)
        try:
            async with client_for(gw) as client:
                await wait_for(lambda: gw.readiness()["ready"], WAIT_S, "the gateway to be ready")
                assert (await client.get("/readyz")).status_code == 200
            # Every copied event is delivered before anything newer (the gateway's own
            # reports): once that many are applied, decode-1's goodbye is among them.
            await wait_for(
                lambda: gw.instances.events_applied >= copied, WAIT_S, "the copied events"
            )
            assert gw.instances.alive("decode", time.time()) == ["decode-0"]
            assert gw.instances.alive("prefill", time.time()) == ["prefill-0"]
        finally:
            await gw.stop()
    finally:
        await bus.close()
