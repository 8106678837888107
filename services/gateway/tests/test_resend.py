"""Lost token chunks are asked for again, and merged back in order.

Token chunks are core NATS messages: those published while the gateway moves to
another NATS node are lost. The `Engine` peer plays the decode instance, keeping what
it streamed and answering `ResendTokens` on the real bus as decode does; `lose` makes
it stream a chunk without publishing it, which is what the network did. Every test
here fails when the gateway does not ask (the lost chunks never arrive otherwise).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from gateway_testkit import MODEL, WORDS, Cluster, GatewayFactory, client_for, wait_for
from httpx_sse import aconnect_sse

from yb_core import protocol
from yb_gateway.recovery import PROBE_S
from yb_gateway.service import GatewayService
from yb_tools.natsserver import NatsServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def stream(client: httpx.AsyncClient) -> tuple[list[str], list[dict[str, Any]]]:
    """The streamed text pieces and the error events of one chat completion."""
    texts: list[str] = []
    errors: list[dict[str, Any]] = []
    async with aconnect_sse(client, "POST", "/v1/chat/completions", json=CHAT) as source:
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():
            if sse.event == "error":
                errors.append(json.loads(sse.data)["error"])
            elif sse.data != "[DONE]":
                delta = json.loads(sse.data)["choices"][0]["delta"]
                texts.append(delta.get("content") or "")
    return texts, errors


def resends(gw: GatewayService, trigger: str) -> float:
    return gw.registry.get_sample_value("yb_gateway_token_resends_total", {"trigger": trigger}) or 0


async def test_lost_chunks_are_resent_and_merged_in_order(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    cluster.engine.lose = {1, 3}
    texts, errors = await stream(client)
    assert not errors
    assert "".join(texts) == "".join(WORDS)
    # Every word exactly once: what was resent and also arrived is dropped.
    assert [t for t in texts if t] == WORDS
    assert [a.from_seq for a in cluster.engine.asked][:1] == [1]
    assert resends(gateway, "gap") >= 1


async def test_chunks_out_of_order_and_twice_come_out_once_in_order(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    script = cluster.engine.script

    def shuffled(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        chunks = script(job)
        return [chunks[0], chunks[2], chunks[1], chunks[1], chunks[0], *chunks[3:]]

    cluster.engine.script = shuffled
    texts, errors = await stream(client)
    assert not errors
    assert [t for t in texts if t] == WORDS


async def test_a_lost_last_chunk_is_found_when_the_stream_goes_quiet(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    # No gap shows when the last chunk is the one lost: the stream goes quiet, and
    # after PROBE_S the gateway asks. The idle timeout is longer than that.
    gw = await gateway_factory(token_idle_timeout_s=PROBE_S + 8)
    cluster.engine.lose = {len(WORDS)}
    async with client_for(gw) as client:
        texts, errors = await stream(client)
    assert not errors
    assert "".join(texts) == "".join(WORDS)
    # Found by the quiet probe (nothing else asks: no gap, no reconnect).
    assert resends(gw, "quiet") >= 1


async def test_chunks_lost_while_the_gateway_reconnects_are_asked_for_at_once(
    gateway_factory: GatewayFactory, cluster: Cluster, nats_server: NatsServer
) -> None:
    # The last three chunks are "published" while the gateway's NATS is away (lost),
    # and nothing after them would show a gap: the reconnect alone makes it ask.
    gw = await gateway_factory(token_idle_timeout_s=30.0)
    engine = cluster.engine
    engine.pause_before = 3
    engine.lose = {3, 4, 5}
    async with client_for(gw) as client:
        pending = asyncio.ensure_future(stream(client))
        await wait_for(lambda: bool(engine.streamed), 10, "the stream to start")
        _, sent, done = next(iter(engine.streamed.values()))
        await wait_for(lambda: len(sent) == 3, 10, "three chunks streamed")
        nats_server.stop()
        await wait_for(lambda: gw.readiness()["bus"] == "disconnected", 5, "the outage to show")
        engine.resume.set()
        await wait_for(lambda: done[0], 5, "the rest of the stream, lost")
        nats_server.start()
        texts, errors = await asyncio.wait_for(pending, 30)
    assert not errors
    assert "".join(texts) == "".join(WORDS)
    assert resends(gw, "reconnect") >= 1


async def test_a_gap_with_no_decode_to_answer_ends_within_the_timeouts(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    # Nobody answers resends: the gap cannot be filled, and the stream ends with the
    # same clear error as before (within the test's 2 s token timeout), never a hang.
    await cluster.engine.stop()
    cluster.engine.resend = "silent"
    await cluster.engine.start(announce=False)
    cluster.engine.lose = {2}
    texts, errors = await stream(client)
    assert [e["code"] for e in errors] == ["token_stream_gap"]
    assert "expected chunk 2, got chunk 3" in errors[0]["message"]
    assert [t for t in texts if t] == WORDS[:2]
