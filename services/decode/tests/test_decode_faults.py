"""Decode frees what nobody will finish: a real decode service, bus, UCX and tiny model.

The test plays the prefill instance by hand (`ReserveKV`, the KV pages over UCX with
a `KVSender`, `StartDecode`), so it can break off where a dying prefill would. What
is checked is what the rest of the cluster sees: the request's token stream, the
`RequestFinished` in the log, and the engine's own page count.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
from nats.aio.msg import Msg

from yb_decode.service import DecodeService
from yb_shared import events as ev
from yb_shared import protocol as pr
from yb_shared.bus import Bus, EventReader
from yb_shared.config import EngineConfig, ModelConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_shared.transport import KVSender, PeerAddress

MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=16, max_model_len=4096)
PROMPT = list(range(10, 50))


@pytest.fixture
async def decode(nats_config: NatsConfig) -> AsyncIterator[DecodeService]:
    service = DecodeService(
        YbConfig(
            instance_id="decode-0",
            nats=nats_config,
            model=MODEL,
            decode=EngineConfig(num_kv_pages=256, threads=1, load_report_interval_s=0.5),
            telemetry=TelemetryConfig(log_json=False),
        )
    )
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def finished(bus: Bus) -> AsyncIterator[EventReader]:
    reader = await bus.read_ordered("yb.ev.req.request_finished", new_only=True)
    try:
        yield reader
    finally:
        await reader.close()


@dataclass
class Played:
    """A request whose prefill the test plays: its token stream and reservation."""

    request_id: str
    chunks: asyncio.Queue[pr.TokenChunk]
    reserved: pr.KVReserved

    async def next_chunk(self, timeout_s: float = 10.0) -> pr.TokenChunk:
        return await asyncio.wait_for(self.chunks.get(), timeout_s)


async def reserve(bus: Bus, *, max_tokens: int = 8, deadline_s: float = 60.0) -> Played:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    subject = pr.token_subject("gw", rid)
    chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

    async def on_chunk(msg: Msg) -> None:
        chunks.put_nowait(pr.token_decoder.decode(msg.data))

    await bus.subscribe(subject, cb=on_chunk)
    message = pr.ReserveKV(
        request_id=rid,
        prefill_instance="prefill-x",
        num_tokens=len(PROMPT),
        sampling=pr.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        token_subject=subject,
        deadline=time.time() + deadline_s,
        prompt_token_ids=PROMPT,
    )
    reserved = await control(bus, message)
    assert isinstance(reserved, pr.KVReserved), reserved
    return Played(rid, chunks, reserved)


async def control(bus: Bus, message: pr.DecodeControl) -> pr.DecodeReply:
    reply = await bus.request(
        pr.decode_control_subject("decode-0"), pr.encode(message), timeout_s=5
    )
    return pr.decode_reply_decoder.decode(reply.data)


def pages(played: Played) -> list[tuple[int, np.ndarray]]:
    r = played.reserved
    return [(i, np.zeros(r.page_nbytes, np.uint8)) for i in range(r.num_layers * r.num_pages)]


async def start(bus: Bus, played: Played) -> None:
    """Send every page, commit, and hand the request over (as prefill does)."""
    sender = KVSender()
    try:
        await sender.send(
            PeerAddress.parse(played.reserved.ucx_address),
            played.request_id,
            pages(played),
            deadline_s=10,
            commit=True,
        )
    finally:
        await sender.close()
    message = pr.StartDecode(request_id=played.request_id, first_token=7, prompt_tokens=len(PROMPT))
    ack = await control(bus, message)
    assert isinstance(ack, pr.DecodeAck) and ack.ok, ack


async def finish_of(reader: EventReader, request_id: str) -> ev.RequestFinished:
    async with asyncio.timeout(10):
        while True:
            item = await reader.next(timeout_s=10)
            if isinstance(item and item.event, ev.RequestFinished):
                assert item is not None and isinstance(item.event, ev.RequestFinished)
                if item.event.request_id == request_id:
                    return item.event


async def pages_back(service: DecodeService) -> None:
    allocator = service.engine.allocator
    assert allocator is not None
    async with asyncio.timeout(10):
        while allocator.num_used:
            await asyncio.sleep(0.02)


async def test_a_prefill_that_dies_mid_transfer_frees_the_reservation_and_tells_the_gateway(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    played = await reserve(bus)
    assert decode.engine.allocator is not None and decode.engine.allocator.num_used > 0
    # Half the KV arrives, then the prefill's connection breaks (as when it is killed).
    sender = KVSender()
    half = pages(played)[: len(pages(played)) // 2]
    await sender.send(
        PeerAddress.parse(played.reserved.ucx_address), played.request_id, half, deadline_s=10
    )
    await sender.close()

    chunk = await played.next_chunk()
    assert chunk.finished and chunk.error_status == 503, chunk
    assert "prefill-x" in chunk.error, chunk.error
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "failed" and end.instance_id == "decode-0"


async def test_a_cancelled_request_stops_decoding_and_says_why(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    played = await reserve(bus, max_tokens=3000)
    await start(bus, played)
    for _ in range(5):
        assert not (await played.next_chunk()).finished
    await bus.publish(ev.RequestCancelled(request_id=played.request_id, reason="client left"))

    chunk = await played.next_chunk()
    while not chunk.finished:
        chunk = await played.next_chunk()
    assert chunk.error_status == 503 and "client left" in chunk.error, chunk
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "cancelled" and end.output_tokens < 3000


async def test_a_request_past_its_deadline_is_ended_and_freed(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    # Its gateway gave up at the deadline (or is gone): nothing else would stop it.
    played = await reserve(bus, max_tokens=3000, deadline_s=2.0)
    await start(bus, played)
    async with asyncio.timeout(15):
        chunk = await played.next_chunk()
        while not chunk.finished:
            chunk = await played.next_chunk()
    assert chunk.error_status == 504, chunk
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "failed" and 0 < end.output_tokens < 3000
