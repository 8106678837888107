"""Outages, broken streams, clients that leave, and stopping with requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from gateway_testkit import (
    DECODE_ID,
    METRICS_AUTH,
    MODEL,
    Cluster,
    GatewayFactory,
    client_for,
    next_event,
    poll_status,
    wait_for,
)
from httpx_sse import aconnect_sse

from yb_core import events as ev
from yb_core import protocol
from yb_core.bus import SOURCE_HEADER, Bus, LoggedEvent
from yb_core.config import NatsConfig
from yb_gateway.service import GatewayService
from yb_tools.natsserver import NatsServer, free_port

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def sse_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(event, data) of every SSE event of a streamed chat completion."""
    async with aconnect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        assert source.response.status_code == 200
        return [(sse.event, sse.data) async for sse in source.aiter_sse()]


async def test_gap_in_token_sequence_is_an_error_event(
    client: httpx.AsyncClient, cluster: Cluster, bus: Bus
) -> None:
    def gappy(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        return [
            protocol.TokenChunk(request_id=job.request_id, seq=0, token_ids=[1], text="a"),
            protocol.TokenChunk(request_id=job.request_id, seq=2, token_ids=[2], text="c"),
            protocol.TokenChunk(request_id=job.request_id, seq=3, finished=True),
        ]

    cluster.engine.script = gappy
    # The decode instance does not hold chunk 1 either: the gap cannot be filled.
    cluster.engine.resend = "forget"
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    events = await sse_events(client, {**CHAT, "stream": True})
    assert events[-1] == ("message", "[DONE]")
    kind, data = events[-2]
    assert kind == "error"
    error = json.loads(data)["error"]
    assert (
        error["code"] == "token_stream_gap" and "expected chunk 1, got chunk 2" in error["message"]
    )
    assert "no longer holds" in error["message"]
    # Text before the gap was relayed; nothing after it.
    texts = [json.loads(d)["choices"][0]["delta"].get("content") for k, d in events[:-2]]
    assert texts == ["", "a"]
    # The stream ended early: the request is cancelled on the bus.
    await next_event(cancelled, ev.RequestCancelled)
    await cancelled.close()


async def test_client_disconnect_cancels_the_request(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster, bus: Bus
) -> None:
    cluster.engine.delay_s = 0.05
    cluster.engine.script = lambda job: [
        protocol.TokenChunk(request_id=job.request_id, seq=i, token_ids=[i], text=f"t{i} ")
        for i in range(200)
    ]
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    async with aconnect_sse(
        client, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as source:
        request_id = source.response.headers["x-request-id"]
        seen = 0
        async for _sse in source.aiter_sse():
            seen += 1
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    event = await next_event(cancelled, ev.RequestCancelled)
    assert event.request_id == request_id
    assert event.reason == "client disconnected"
    await cancelled.close()
    await wait_for(lambda: gateway.in_flight == 0, 5, "the session to be released")
    # Its token route is gone too, and the only token subscription is the gateway's
    # own for all its requests (nats-py keeps no public list of them).
    assert len(gateway.tokens) == 0
    assert gateway.bus is not None
    subjects = [s.subject for s in gateway.bus.client._subs.values()]
    assert [s for s in subjects if s.startswith("yb.tok.")] == [
        protocol.token_subjects(gateway.instance_id)
    ]
    metrics = (await client.get("/metrics", headers=METRICS_AUTH)).text
    assert 'yb_gateway_requests_total{status="499"} 1.0' in metrics
    assert "yb_gateway_in_flight_requests 0.0" in metrics


async def test_client_leaving_a_non_streaming_request_cancels_it(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster, bus: Bus
) -> None:
    cluster.engine.delay_s = 0.05
    cluster.engine.script = lambda job: [
        protocol.TokenChunk(request_id=job.request_id, seq=i, token_ids=[i], text="t")
        for i in range(200)
    ]
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    call = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    # Given up once the engine streams (200 chunks, 0.05 s apart: far from done).
    await wait_for(lambda: bool(cluster.engine.jobs), 30, "the job to reach the engine")
    # Cancelling the call drops its connection, as a client that gives up does.
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    event = await next_event(cancelled, ev.RequestCancelled)
    assert event.reason == "client disconnected"
    assert event.request_id == cluster.engine.jobs[0].request_id
    await cancelled.close()
    await wait_for(lambda: gateway.in_flight == 0, 5, "the session to be released")


async def test_concurrent_streams_do_not_mix(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    cluster.engine.delay_s = 0.01
    cluster.engine.script = lambda job: (
        [
            protocol.TokenChunk(
                request_id=job.request_id, seq=i, token_ids=[i], text=f"{job.request_id[-4:]}."
            )
            for i in range(10)
        ]
        + [
            protocol.TokenChunk(
                request_id=job.request_id, seq=10, finished=True, finish_reason="length"
            )
        ]
    )

    async def one() -> tuple[str, str]:
        async with aconnect_sse(
            client, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
        ) as source:
            request_id = source.response.headers["x-request-id"]
            data = [sse.data async for sse in source.aiter_sse()]
        assert data[-1] == "[DONE]"
        return request_id, "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])

    results = await asyncio.gather(*(one() for _ in range(16)))
    for request_id, text in results:
        assert text == f"{request_id[-4:]}." * 10
    assert gateway.in_flight == 0 and gateway.decisions.waiting == 0
    # Per-request close tasks leave the supervisor once done: only http, bus and the
    # batch worker stay.
    await wait_for(lambda: len(gateway.tasks._tasks) == 3, 10, "close tasks to finish")


async def test_nats_down_then_back(
    gateway_factory: GatewayFactory, cluster: Cluster, nats_server: NatsServer
) -> None:
    gw = await gateway_factory(decision_timeout_s=1.0)
    async with client_for(gw) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

        nats_server.stop()
        await wait_for(lambda: gw.readiness()["bus"] == "disconnected", 5, "the outage to show")
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        # Refused because the bus is down, not after waiting for a decision.
        assert response.json()["error"]["code"] == "bus_unavailable"
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 503

        nats_server.start()
        # Every peer reconnects by itself; requests are served again.
        deadline = time.monotonic() + 20
        while True:
            response = await client.post("/v1/chat/completions", json=CHAT)
            if response.status_code == 200:
                break
            assert time.monotonic() < deadline, response.text
            await asyncio.sleep(0.2)
        assert response.json()["choices"][0]["message"]["content"] == "Hello, world!"


async def test_a_request_rides_out_a_brief_nats_outage(
    gateway_factory: GatewayFactory, cluster: Cluster, nats_server: NatsServer
) -> None:
    # A request that arrives while the connection is being re-established (a client
    # moving to another NATS node) waits for it, within `bus_grace_s`, instead of
    # failing.
    gw = await gateway_factory(bus_grace_s=20.0, decision_timeout_s=10.0)
    async with client_for(gw) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        nats_server.stop()
        await wait_for(lambda: gw.readiness()["bus"] == "disconnected", 5, "the outage to show")
        pending = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT))
        # NATS comes back only once the request is inside the gateway; its 200 then
        # proves that it waited for the bus rather than being refused.
        await wait_for(
            lambda: gw.registry.get_sample_value("yb_gateway_in_flight_requests") == 1,
            10,
            "the request to reach the gateway",
        )
        nats_server.start()
        response = await asyncio.wait_for(pending, 30)
    assert response.status_code == 200, response.text


async def test_starts_and_answers_without_nats(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    port = free_port()
    nats = NatsConfig(
        url=f"nats://127.0.0.1:{port}", reconnect_wait_s=0.05, max_reconnect_wait_s=0.3
    )
    gw = await gateway_factory(nats=nats, wait_bus=False, bus_grace_s=0.2)
    async with client_for(gw) as client:
        assert (await client.get("/healthz")).status_code == 200
        ready = (await client.get("/readyz")).json()
        assert ready["bus"] == "disconnected"
        assert "event bus (NATS) connection" in ready["missing"]
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "bus_unavailable"

        # NATS comes up later: the gateway connects by itself.
        server = NatsServer(store_dir=tmp_path / "late-nats", port=port)
        server.start()
        try:
            await wait_for(lambda: gw.readiness()["bus"] == "connected", 10, "the late NATS")
            report = (await poll_status(client, "/readyz", 503)).json()
            assert "event bus (NATS) connection" not in report["missing"]
        finally:
            await gw.stop()
            server.stop()


async def test_stop_cancels_in_flight_requests(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster, bus: Bus
) -> None:
    cluster.engine.delay_s = 0.05
    cluster.engine.script = lambda job: [
        protocol.TokenChunk(request_id=job.request_id, seq=i, token_ids=[i], text="x")
        for i in range(200)
    ]
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    events: list[tuple[str, str]] = []
    async with aconnect_sse(
        client, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as source:
        async for sse in source.aiter_sse():
            events.append((sse.event, sse.data))
            if len(events) == 3:
                stopping = asyncio.create_task(gateway.stop())
    await stopping
    await gateway.stop()  # idempotent
    assert events[-1] == ("message", "[DONE]")
    assert events[-2][0] == "error"
    assert json.loads(events[-2][1])["error"]["code"] == "shutting_down"
    await next_event(cancelled, ev.RequestCancelled)
    await cancelled.close()
    assert gateway.in_flight == 0


async def test_a_verdict_logged_before_admission_never_ends_the_request(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    # decode was declared dead, then announced itself again, and the conductor placed a
    # request on it. The old verdict can reach the gateway while that request streams:
    # the instance stream it reads is a copy of the log that may lag behind it. Such a
    # late delivery is handed to the gateway's instance follower directly (as read
    # from the instance stream: its header names the verdict's place in the log).
    old = ev.InstanceDown(instance_id=DECODE_ID, reason="no heartbeat for 15s")
    old_seq = await bus.publish(old)
    await cluster.engine.announce()
    cluster.engine.pause_before = 2  # each stream holds after its first two chunks
    # No re-plan: a verdict about the request must end its stream, not continue it.
    gw = await gateway_factory(replan_budget=0)

    async def late(verdict: ev.InstanceDown, seq: int) -> AsyncIterator[LoggedEvent]:
        yield LoggedEvent(
            seq=1,
            subject=ev.subject_for(verdict),
            event=verdict,
            headers={SOURCE_HEADER: f"YB_EVENTS {seq} > >"},
        )

    async def stream_with_a_verdict(seq: int) -> list[tuple[str, str]]:
        cluster.engine.resume.clear()

        async def verdict() -> None:
            await gw._follow_instances(late(old, seq))  # type: ignore[arg-type]
            cluster.engine.resume.set()

        return await rest_of_a_stream_after(gw, verdict)

    # Logged before the request was admitted: the conductor knew it. The stream goes on.
    rest = await stream_with_a_verdict(old_seq)
    assert rest[-1] == ("message", "[DONE]"), rest
    assert all(kind == "message" for kind, _ in rest), rest
    # The same verdict placed after the admission is about this request: it ends it.
    rest = await stream_with_a_verdict(10**9)
    assert rest[-1] == ("message", "[DONE]"), rest
    kind, data = rest[-2]
    assert kind == "error" and DECODE_ID in json.loads(data)["error"]["message"], rest


async def test_a_verdict_the_instance_reader_misses_is_found_in_the_log(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    # After a NATS node comes back, a reader's consumer can take many seconds to
    # deliver again, and the conductor cancels an orphaned request that is not
    # re-planned within its grace period. A stream whose decode instance went silent
    # asks the log itself. Here the instance stream stops copying the log, so the
    # gateway's instance reader never sees the verdict: only the lookup can.
    cluster.engine.pause_before = 2  # the stream holds after its first two chunks
    # Idle timeouts far beyond the test's wait: only the verdict can end the stream.
    gw = await gateway_factory(token_idle_timeout_s=120.0, replan_budget=0)
    # After the gateway made sure of the stream's settings at its start.
    info = await bus.jetstream.stream_info(bus.instance_stream)
    info.config.sources = None
    await bus.jetstream.update_stream(info.config)

    async def cut_off() -> None:
        await cluster.engine.go_deaf()
        await bus.publish(ev.InstanceDown(instance_id=DECODE_ID, reason="no heartbeat for 15s"))

    rest = await rest_of_a_stream_after(gw, cut_off)
    kind, data = rest[-2]
    error = json.loads(data)["error"]
    assert kind == "error" and error["code"] == "engine_failed", rest
    assert DECODE_ID in error["message"], error


async def rest_of_a_stream_after(
    gw: GatewayService, happening: Callable[[], Awaitable[None]]
) -> list[tuple[str, str]]:
    """(event, data) of a streamed chat completion's SSE events after its first
    message, which `happening()` runs after (within a minute)."""
    async with (
        client_for(gw) as client,
        aconnect_sse(
            client, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as source,
    ):
        events = source.aiter_sse()
        first = await anext(events)
        assert first.event == "message", first.data
        await happening()

        async def rest() -> list[tuple[str, str]]:
            return [(e.event, e.data) async for e in events]

        return await asyncio.wait_for(rest(), timeout=60)
