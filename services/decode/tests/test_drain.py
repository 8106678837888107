"""A decode instance told to stop drains first: a real decode service, bus, UCX and
tiny model.

The test plays the prefill instance by hand (`ReserveKV`, the KV pages over UCX,
`StartDecode`) and parks a request mid-stream at the `decode.token` failpoint, so
the request is provably running when the stop begins and ends only when the test
lets it: every outcome holds by construction, whatever the machine's speed. What is
checked is what the cluster sees: `InstanceDraining` and `InstanceDown` in the log,
the answers to reservations, the token streams and the `RequestFinished` events.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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
#: A drain no request here outlives unless the test keeps it parked.
LONG_DRAIN_S = 300.0


@asynccontextmanager
async def decode_instance(
    nats_config: NatsConfig, gate: Path, drain_timeout_s: float
) -> AsyncIterator[DecodeService]:
    service = DecodeService(
        YbConfig(
            instance_id="decode-0",
            nats=nats_config,
            model=MODEL,
            decode=DecodeEngineConfig(
                num_kv_pages=256,
                threads=1,
                load_report_interval_s=0.5,
                drain_timeout_s=drain_timeout_s,
            ),
            telemetry=TelemetryConfig(log_json=False),
            # A request parks after its HOLD_AT-th token only when the test armed the
            # gate for it (`arm`).
            failpoints=f"gate={gate};timeout=300;decode.token=once:hold({HOLD_AT})",
        )
    )
    await service.start()
    try:
        yield service
    finally:
        # Waits for a stop the test began (`stop` is idempotent).
        await service.stop()


@asynccontextmanager
async def reading(bus: Bus, subject: str) -> AsyncIterator[EventReader]:
    reader = await bus.read_ordered(subject, new_only=True)
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

    async def rest(self) -> list[pr.TokenChunk]:
        """Every chunk from here to the stream's last."""
        out = [await asyncio.wait_for(self.chunks.get(), DEADLINE_S)]
        while not out[-1].finished:
            out.append(await asyncio.wait_for(self.chunks.get(), DEADLINE_S))
        return out


def reservation(request_id: str, max_tokens: int) -> pr.ReserveKV:
    return pr.ReserveKV(
        request_id=request_id,
        prefill_instance="prefill-x",
        num_tokens=len(PROMPT),
        prompt_token_ids=PROMPT,
        sampling=pr.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        token_subject=pr.token_subject("gw", request_id),
        deadline=time.time() + 600.0,
    )


async def control(bus: Bus, message: pr.DecodeControl) -> pr.DecodeReply:
    reply = await bus.request(
        pr.decode_control_subject("decode-0"), pr.encode(message), timeout_s=DEADLINE_S
    )
    return pr.decode_reply_decoder.decode(reply.data)


async def reserve(bus: Bus, max_tokens: int) -> Played:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

    async def on_chunk(msg: Msg) -> None:
        chunks.put_nowait(pr.token_decoder.decode(msg.data))

    await bus.subscribe(pr.token_subject("gw", rid), cb=on_chunk)
    reserved = await control(bus, reservation(rid, max_tokens))
    assert isinstance(reserved, pr.KVReserved), reserved
    return Played(rid, chunks, reserved)


async def start(bus: Bus, played: Played) -> None:
    """Send every page, commit, and hand the request over (as prefill does)."""
    r = played.reserved
    sender = KVSender()
    try:
        await sender.send(
            PeerAddress.parse(r.ucx_address),
            played.request_id,
            [(i, np.zeros(r.page_nbytes, np.uint8)) for i in range(r.num_layers * r.num_pages)],
            deadline_s=DEADLINE_S,
            commit=True,
        )
    finally:
        await sender.close()
    message = pr.StartDecode(request_id=played.request_id, first_token=7, prompt_tokens=len(PROMPT))
    ack = await control(bus, message)
    assert isinstance(ack, pr.DecodeAck) and ack.ok, ack


def arm(gate: Path) -> None:
    """The next request to reach the `decode.token` failpoint parks there."""
    gate.mkdir(parents=True, exist_ok=True)
    (gate / "decode.token.arm").touch()


async def parked_mid_stream(bus: Bus, gate: Path, max_tokens: int) -> Played:
    """A request that streamed HOLD_AT tokens and is parked there until released."""
    arm(gate)
    played = await reserve(bus, max_tokens)
    await start(bus, played)
    reached = gate / f"decode.token.{safe_name(played.request_id)}.reached"
    async with asyncio.timeout(DEADLINE_S):
        while not reached.exists():
            await asyncio.sleep(0.02)
    return played


def release(gate: Path, played: Played) -> None:
    (gate / f"decode.token.{safe_name(played.request_id)}.release").touch()


async def next_event(reader: EventReader, kind: Callable[[ev.AnyEvent], bool]) -> ev.AnyEvent:
    """The next event `kind` accepts."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            item = await reader.next(timeout_s=DEADLINE_S)
            if item is not None and kind(item.event):
                return item.event


def finish_of(request_id: str) -> Callable[[ev.AnyEvent], bool]:
    return lambda e: isinstance(e, ev.RequestFinished) and e.request_id == request_id


def tokens(chunks: list[pr.TokenChunk]) -> int:
    return sum(len(c.token_ids) for c in chunks)


async def test_a_decode_told_to_stop_finishes_what_it_holds_and_takes_nothing_new(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    async with (
        decode_instance(nats_config, gate, LONG_DRAIN_S) as decode,
        reading(bus, "yb.ev.instance.*.decode-0") as presence,
        reading(bus, "yb.ev.req.request_finished") as finished,
    ):
        running = await parked_mid_stream(bus, gate, max_tokens=HOLD_AT + 6)
        first = [await running.chunks.get() for _ in range(HOLD_AT)]
        # Reserved before the stop; its KV and hand-over come during the drain.
        reserved = await reserve(bus, max_tokens=5)

        stopping = asyncio.create_task(decode.stop())
        draining = await next_event(presence, lambda e: not isinstance(e, ev.LoadReport))
        assert isinstance(draining, ev.InstanceDraining), draining
        assert draining.deadline >= draining.time + LONG_DRAIN_S - 1, draining

        # New work is refused; what it holds goes on.
        refused = await control(bus, reservation("req-new", max_tokens=5))
        assert isinstance(refused, pr.ReserveRefused), refused
        assert refused.reason == "decode instance shutting down"
        await start(bus, reserved)
        late = await reserved.rest()
        assert tokens(late) == 5 and not late[-1].error, late
        # Parked: it still runs, so the instance cannot have stopped.
        assert not stopping.done()
        release(gate, running)
        rest = await running.rest()
        assert not rest[-1].error and rest[-1].finish_reason == "length", rest[-1]
        chunks = first + rest
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert tokens(chunks) == HOLD_AT + 6

        await asyncio.wait_for(stopping, DEADLINE_S)
        for played in (reserved, running):
            end = await next_event(finished, finish_of(played.request_id))
            assert isinstance(end, ev.RequestFinished) and end.outcome == "completed", end
        down = await next_event(presence, lambda e: not isinstance(e, ev.LoadReport))
        assert isinstance(down, ev.InstanceDown) and down.reason == "stopped", down


async def test_a_request_that_outlives_the_drain_ends_with_a_503_at_its_deadline(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    drain_s = 2.0
    gate = tmp_path / "gate"
    async with (
        decode_instance(nats_config, gate, drain_s) as decode,
        reading(bus, "yb.ev.req.request_finished") as finished,
    ):
        # Parked and never released: only the drain's deadline can end it.
        played = await parked_mid_stream(bus, gate, max_tokens=3000)
        began = time.monotonic()
        stopping = asyncio.create_task(decode.stop())
        chunks = await played.rest()
        assert time.monotonic() - began >= drain_s
        last = chunks[-1]
        assert last.error_status == 503 and last.error == "decode instance shutting down", last
        assert tokens(chunks) == HOLD_AT
        await asyncio.wait_for(stopping, DEADLINE_S)
        end = await next_event(finished, finish_of(played.request_id))
        assert isinstance(end, ev.RequestFinished), end
        assert end.outcome == "failed" and end.output_tokens == HOLD_AT, end


async def test_a_second_signal_ends_the_drain_at_once(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    async with (
        decode_instance(nats_config, gate, LONG_DRAIN_S) as decode,
        reading(bus, "yb.ev.instance.instance_draining.decode-0") as draining,
    ):
        played = await parked_mid_stream(bus, gate, max_tokens=3000)
        stopping = asyncio.create_task(decode.stop())
        await next_event(draining, lambda e: isinstance(e, ev.InstanceDraining))
        # What `run_service` does on a second SIGTERM or SIGINT; a drain of 300 s
        # would outlast every wait below.
        decode.hurry()
        last = (await played.rest())[-1]
        assert last.error_status == 503, last
        await asyncio.wait_for(stopping, DEADLINE_S)


def test_the_stop_allows_for_the_drain() -> None:
    cfg = YbConfig(decode=DecodeEngineConfig(drain_timeout_s=7.0))
    service = DecodeService(cfg)
    # `run_service` gives the stop this long: the drain must not be cut short by it.
    assert service.stop_timeout_s == DecodeService.stop_timeout_s + 7.0
