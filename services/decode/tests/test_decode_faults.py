"""Decode frees what nobody will finish, and sends again what a gateway lost: a real
decode service, bus, UCX and tiny model.

The test plays the prefill instance by hand (`ReserveKV`, the KV pages over UCX with
a `KVSender`, `StartDecode`), so it can break off where a dying prefill would, and the
gateway (`ResendTokens` on the decode's resend subject). What is checked is what the
rest of the cluster sees: the request's token stream, the `RequestFinished` in the
log, and the engine's own page count.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus, EventReader
from yb_core.config import DecodeEngineConfig, ModelConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_core.failpoints import safe_name
from yb_dataplane.transport import KVSender, PeerAddress
from yb_decode.service import DecodeService

MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=16, max_model_len=4096)
PROMPT = list(range(10, 50))
#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0
#: The token after which an armed request parks (failpoint `decode.token`).
HOLD_AT = 4


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    """The failpoint gate of the decode instance under test."""
    return tmp_path / "gate"


@pytest.fixture
async def decode(nats_config: NatsConfig, gate: Path) -> AsyncIterator[DecodeService]:
    service = DecodeService(
        YbConfig(
            instance_id="decode-0",
            nats=nats_config,
            model=MODEL,
            decode=DecodeEngineConfig(num_kv_pages=256, threads=1, load_report_interval_s=0.5),
            telemetry=TelemetryConfig(log_json=False),
            # A request parks after its HOLD_AT-th token only when the test armed the
            # gate for it (`arm`): it is then in flight, by construction, until the
            # test releases or cancels it.
            failpoints=f"gate={gate};timeout=300;decode.token=once:hold({HOLD_AT})",
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

    async def next_chunk(self, timeout_s: float = DEADLINE_S) -> pr.TokenChunk:
        return await asyncio.wait_for(self.chunks.get(), timeout_s)


def arm(gate: Path) -> None:
    """The next request to reach the `decode.token` failpoint parks there."""
    gate.mkdir(parents=True, exist_ok=True)
    (gate / "decode.token.arm").touch()


async def parked(gate: Path, request_id: str) -> None:
    """Wait until `request_id` is parked at the failpoint (it wrote its marker)."""
    reached = gate / f"decode.token.{safe_name(request_id)}.reached"
    async with asyncio.timeout(DEADLINE_S):
        while not reached.exists():
            await asyncio.sleep(0.02)


def release(gate: Path, request_id: str) -> None:
    (gate / f"decode.token.{safe_name(request_id)}.release").touch()


async def reserve(
    bus: Bus, *, max_tokens: int = 8, deadline_s: float = 60.0, prompt: list[int] = PROMPT
) -> Played:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    subject = pr.token_subject("gw", rid)
    chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

    async def on_chunk(msg: Msg) -> None:
        chunks.put_nowait(pr.token_decoder.decode(msg.data))

    await bus.subscribe(subject, cb=on_chunk)
    message = reservation(rid, len(prompt), max_tokens=max_tokens, deadline_s=deadline_s)
    reserved = await control(bus, msgspec.structs.replace(message, prompt_token_ids=prompt))
    assert isinstance(reserved, pr.KVReserved), reserved
    return Played(rid, chunks, reserved)


def reservation(
    request_id: str,
    num_tokens: int,
    *,
    max_tokens: int = 8,
    deadline_s: float = 60.0,
    wait_s: float = 0.0,
    n: int = 1,
) -> pr.ReserveKV:
    return pr.ReserveKV(
        request_id=request_id,
        prefill_instance="prefill-x",
        num_tokens=num_tokens,
        sampling=pr.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n),
        token_subject=pr.token_subject("gw", request_id),
        deadline=time.time() + deadline_s,
        wait_s=wait_s,
    )


async def control(bus: Bus, message: pr.DecodeControl) -> pr.DecodeReply:
    reply = await bus.request(
        pr.decode_control_subject("decode-0"), pr.encode(message), timeout_s=DEADLINE_S
    )
    return pr.decode_reply_decoder.decode(reply.data)


def pages(played: Played) -> list[tuple[int, np.ndarray]]:
    r = played.reserved
    return [(i, np.zeros(r.page_nbytes, np.uint8)) for i in range(r.num_layers * r.num_pages)]


async def send_kv(played: Played, note: bytes = b"") -> None:
    """Send every page and commit (as prefill does), with `note` when given (the
    hand-over prefill sends with its commit)."""
    sender = KVSender()
    try:
        await sender.send(
            PeerAddress.parse(played.reserved.ucx_address),
            played.request_id,
            pages(played),
            deadline_s=DEADLINE_S,
            commit=True,
            note=note,
        )
    finally:
        await sender.close()


async def start(bus: Bus, played: Played) -> None:
    """Send every page, commit, and hand the request over (as prefill does)."""
    await send_kv(played)
    message = pr.StartDecode(request_id=played.request_id, first_token=7, prompt_tokens=len(PROMPT))
    ack = await control(bus, message)
    assert isinstance(ack, pr.DecodeAck) and ack.ok, ack


async def resend(bus: Bus, request_id: str, from_seq: int) -> pr.TokensResent:
    """Ask as a gateway that lost chunks does."""
    ask = pr.ResendTokens(request_id=request_id, from_seq=from_seq)
    reply = await bus.request(pr.resend_subject("decode-0"), pr.encode(ask), timeout_s=DEADLINE_S)
    return pr.resend_reply_decoder.decode(reply.data)


async def finish_of(reader: EventReader, request_id: str) -> ev.RequestFinished:
    async with asyncio.timeout(DEADLINE_S):
        while True:
            item = await reader.next(timeout_s=DEADLINE_S)
            if isinstance(item and item.event, ev.RequestFinished):
                assert item is not None and isinstance(item.event, ev.RequestFinished)
                if item.event.request_id == request_id:
                    return item.event


async def pages_back(service: DecodeService) -> None:
    allocator = service.worker.engine.allocator
    async with asyncio.timeout(DEADLINE_S):
        while allocator.num_used:
            await asyncio.sleep(0.02)


async def test_a_prefill_that_dies_mid_transfer_frees_the_reservation_and_tells_the_gateway(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    played = await reserve(bus)
    assert decode.worker.engine.allocator.num_used > 0
    # Half the KV arrives, then the prefill's connection breaks (as when it is killed).
    sender = KVSender()
    half = pages(played)[: len(pages(played)) // 2]
    await sender.send(
        PeerAddress.parse(played.reserved.ucx_address),
        played.request_id,
        half,
        deadline_s=DEADLINE_S,
    )
    await sender.close()

    chunk = await played.next_chunk()
    assert chunk.finished and chunk.error_status == 503, chunk
    assert "prefill-x" in chunk.error, chunk.error
    # A gateway that lost that one chunk gets it again.
    answer = await resend(bus, played.request_id, 0)
    assert (answer.state, answer.first_seq, answer.next_seq, answer.resent) == ("finished", 0, 1, 1)
    assert await played.next_chunk() == chunk
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "failed" and end.instance_id == "decode-0"


async def test_a_cancelled_request_stops_decoding_and_says_why(
    decode: DecodeService, bus: Bus, finished: EventReader, gate: Path
) -> None:
    arm(gate)
    played = await reserve(bus, max_tokens=3000)
    await start(bus, played)
    for _ in range(HOLD_AT):
        assert not (await played.next_chunk()).finished
    # Parked after its HOLD_AT-th token: still decoding when the cancel comes.
    await parked(gate, played.request_id)
    await bus.publish(ev.RequestCancelled(request_id=played.request_id, reason="client left"))

    chunk = await played.next_chunk()
    while not chunk.finished:
        chunk = await played.next_chunk()
    assert chunk.error_status == 503 and "client left" in chunk.error, chunk
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "cancelled" and end.output_tokens == HOLD_AT


async def test_a_request_past_its_deadline_is_ended_and_freed(
    decode: DecodeService, bus: Bus, finished: EventReader, gate: Path
) -> None:
    # Its gateway gave up at the deadline (or is gone): nothing else would stop it.
    # The deadline only has to leave time to reserve and start (one round trip and a
    # local transfer); the request is parked until it has passed, so it cannot finish
    # first however fast the machine is.
    arm(gate)
    played = await reserve(bus, max_tokens=3000, deadline_s=15.0)
    await start(bus, played)
    await parked(gate, played.request_id)
    deadline = time.time() + 15.0  # no earlier than the request's own
    while time.time() <= deadline:
        await asyncio.sleep(0.1)
    release(gate, played.request_id)
    chunk = await played.next_chunk()
    while not chunk.finished:
        chunk = await played.next_chunk()
    assert chunk.error_status == 504, chunk
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    # Released, it may take one more step: the engine loop finds it expired and
    # queues its abort, but the step already submitted runs first.
    assert end.outcome == "failed" and HOLD_AT <= end.output_tokens <= HOLD_AT + 1, end


# --- resends ------------------------------------------------------------------------


async def test_a_live_stream_is_sent_again_from_the_asked_chunk(
    decode: DecodeService, bus: Bus, gate: Path
) -> None:
    arm(gate)
    played = await reserve(bus, max_tokens=3000)
    await start(bus, played)
    first = [await played.next_chunk() for _ in range(HOLD_AT)]
    assert [c.seq for c in first] == list(range(HOLD_AT))
    # Parked: the stream is live (not finished) when the resend is asked, by construction.
    await parked(gate, played.request_id)
    answer = await resend(bus, played.request_id, 1)
    assert answer.state == "streaming" and answer.first_seq == 0, answer
    assert (answer.next_seq, answer.resent) == (HOLD_AT, HOLD_AT - 1), answer
    # Chunks 1.. come again on the stream's own subject, the same as the first time.
    again = [await played.next_chunk() for _ in range(HOLD_AT - 1)]
    assert again == first[1:]
    # Let it go on: the stream carries on from where it was, after the resent chunks.
    release(gate, played.request_id)
    assert (await played.next_chunk()).seq == HOLD_AT
    await bus.publish(ev.RequestCancelled(request_id=played.request_id, reason="test over"))
    await pages_back(decode)


async def test_a_finished_stream_is_kept_for_a_resend(decode: DecodeService, bus: Bus) -> None:
    played = await reserve(bus, max_tokens=6)
    await start(bus, played)
    chunks = [await played.next_chunk()]
    while not chunks[-1].finished:
        chunks.append(await played.next_chunk())
    answer = await resend(bus, played.request_id, 2)
    assert answer.state == "finished", answer
    assert (answer.first_seq, answer.next_seq, answer.resent) == (0, len(chunks), len(chunks) - 2)
    assert [await played.next_chunk() for _ in chunks[2:]] == chunks[2:]
    # Asked from past its end: nothing to send, and it says how far the stream went.
    answer = await resend(bus, played.request_id, len(chunks))
    assert (answer.state, answer.next_seq, answer.resent) == ("finished", len(chunks), 0)
    assert played.chunks.empty()


async def test_a_resend_of_an_unknown_or_not_yet_started_request_says_so(
    decode: DecodeService, bus: Bus
) -> None:
    answer = await resend(bus, "req-never-seen", 0)
    assert (answer.request_id, answer.state, answer.resent) == ("req-never-seen", "unknown", 0)
    # KV reserved, no token yet: "nothing yet", not "lost".
    played = await reserve(bus)
    answer = await resend(bus, played.request_id, 0)
    assert (answer.state, answer.resent) == ("pending", 0)
    await control(bus, pr.AbortReservation(request_id=played.request_id, reason="test over"))
    await pages_back(decode)
    assert (await resend(bus, played.request_id, 0)).state == "unknown"


async def test_a_hand_over_waiting_for_its_commit_does_not_hold_other_reservations(
    decode: DecodeService, bus: Bus
) -> None:
    # The hand-over of `first` reaches decode before any of its KV (one connection's
    # messages arrive in order), so decode waits for its commit; `second` is reserved
    # meanwhile, and only then does `first`'s KV come. Handled one at a time, the
    # reservation would wait behind the hand-over, which would wait for a commit
    # sent after the reservation's answer: it would end "KV not committed".
    first = await reserve(bus)
    # Published and flushed (the server has it) before `second`'s reservation leaves.
    inbox = bus.client.new_inbox()
    replies = await bus.client.subscribe(inbox, max_msgs=1)
    rid = first.request_id
    hand_over = pr.StartDecode(request_id=rid, first_token=7, prompt_tokens=len(PROMPT))
    await bus.client.publish(
        pr.decode_control_subject("decode-0"), pr.encode(hand_over), reply=inbox
    )
    await bus.flush()
    second = await reserve(bus)
    await send_kv(first)
    ack = pr.decode_reply_decoder.decode((await replies.next_msg(timeout=DEADLINE_S)).data)
    assert isinstance(ack, pr.DecodeAck) and ack.ok, ack
    await start(bus, second)
    for played in (first, second):
        while not (chunk := await played.next_chunk()).finished:
            pass
        assert chunk.error is None or chunk.error == "", chunk


# --- the hand-over on the commit ------------------------------------------------------


async def test_a_hand_over_on_the_commit_starts_the_request_without_a_control_message(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    played = await reserve(bus, max_tokens=3)
    assert played.reserved.handover_on_commit
    hand_over = pr.StartDecode(request_id=played.request_id, first_token=7, prompt_tokens=40)
    await send_kv(played, pr.encode(hand_over))
    chunks = [await played.next_chunk()]
    while not chunks[-1].finished:
        chunks.append(await played.next_chunk())
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[0].token_ids == [7] and chunks[-1].error in (None, ""), chunks
    assert sum(len(c.token_ids) for c in chunks) == 3
    # A control message after it finds nothing to start: the commit did.
    late = await control(bus, hand_over)
    assert isinstance(late, pr.DecodeAck) and not late.ok, late
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "completed" and end.output_tokens == 3


@pytest.mark.parametrize(
    "note",
    [
        b"\xc1not msgpack",
        pr.encode(pr.AbortReservation(request_id="req-x", reason="wrong kind")),
        pr.encode(pr.StartDecode(request_id="another-request", first_token=7, prompt_tokens=1)),
    ],
    ids=["unreadable", "not-a-start", "another-request"],
)
async def test_a_bad_hand_over_on_the_commit_frees_the_pages_and_tells_the_gateway(
    decode: DecodeService, bus: Bus, finished: EventReader, note: bytes
) -> None:
    # Nobody waits for an answer to a hand-over on the commit: the gateway must hear
    # of it from decode, or its client would wait for a first token until the timeout.
    played = await reserve(bus)
    await send_kv(played, note)
    chunk = await played.next_chunk()
    assert chunk.finished and chunk.error_status == 503, chunk
    assert "did not start the request" in chunk.error, chunk.error
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "failed" and end.instance_id == "decode-0"


async def test_a_hand_over_lost_with_the_last_segment_fails_the_reservation(
    decode: DecodeService, bus: Bus, finished: EventReader
) -> None:
    # The segment carrying the commit and its hand-over never arrives: the prefill
    # was cut off after the other pages. Decode must not wait for a hand-over that
    # will not come: the broken connection fails the reservation and the gateway is
    # told (the prefill, if alive, reports the failed transfer too).
    played = await reserve(bus)
    sender = KVSender()
    everything = pages(played)
    await sender.send(
        PeerAddress.parse(played.reserved.ucx_address),
        played.request_id,
        everything[:-1],
        deadline_s=DEADLINE_S,
    )
    await sender.close()
    chunk = await played.next_chunk()
    assert chunk.finished and chunk.error_status == 503, chunk
    assert "prefill-x" in chunk.error, chunk.error
    await pages_back(decode)
    end = await finish_of(finished, played.request_id)
    assert end.outcome == "failed"


# --- reservations short of pages ------------------------------------------------------

#: A prompt that takes 248 of the instance's 256 pages (16 tokens each).
LONG_PROMPT = [10 + i % 1000 for i in range(248 * 16)]


async def waiting(service: DecodeService, count: int) -> None:
    """Wait until `count` reservations wait for pages."""
    async with asyncio.timeout(DEADLINE_S):
        while service.worker.reservations_waiting != count:
            await asyncio.sleep(0.02)


async def test_a_reservation_short_of_pages_waits_its_turn_and_gets_them_when_a_request_ends(
    decode: DecodeService, bus: Bus, gate: Path
) -> None:
    # `big` holds 248 pages and is parked mid-decode, so nothing frees pages until the
    # test releases it: the reservation of 10 pages must wait, and is answered once
    # `big` has ended, however long that takes.
    arm(gate)
    big = await reserve(bus, max_tokens=HOLD_AT + 2, prompt=LONG_PROMPT)
    await start(bus, big)
    await parked(gate, big.request_id)
    waiter = asyncio.create_task(control(bus, reservation("req-waits", 10 * 16, wait_s=DEADLINE_S)))
    await waiting(decode, 1)
    # Three pages are free for it, but it would jump the queue: refused, not waiting.
    impatient = await control(bus, reservation("req-impatient", 3 * 16))
    assert isinstance(impatient, pr.ReserveRefused), impatient
    assert "waiting for pages" in impatient.reason, impatient.reason
    assert not waiter.done()

    release(gate, big.request_id)
    granted = await asyncio.wait_for(waiter, DEADLINE_S)
    assert isinstance(granted, pr.KVReserved) and granted.num_pages == 10, granted
    while not (chunk := await big.next_chunk()).finished:
        pass
    assert not chunk.error, chunk  # the running request was not cut short for it
    assert decode.worker.reservations_waiting == 0
    await control(bus, pr.AbortReservation(request_id="req-waits", reason="test over"))
    await pages_back(decode)


async def test_a_reservation_is_refused_when_its_wait_ends_or_it_could_never_fit(
    decode: DecodeService, bus: Bus
) -> None:
    held = await reserve(bus, prompt=LONG_PROMPT)  # held until the test gives it back
    short = await control(bus, reservation("req-short", 10 * 16, wait_s=0.5))
    assert isinstance(short, pr.ReserveRefused), short
    assert "after waiting" in short.reason, short.reason
    assert decode.worker.reservations_waiting == 0
    # 256 pages and a copy of the last for the second choice: more than the instance
    # has, so it is refused at once however long it may wait.
    never = await control(bus, reservation("req-never", 4090, max_tokens=4, wait_s=DEADLINE_S, n=2))
    assert isinstance(never, pr.ReserveRefused), never
    assert "the instance has 256" in never.reason, never.reason
    await control(bus, pr.AbortReservation(request_id=held.request_id, reason="test over"))
    await pages_back(decode)
