"""The stage-to-stage channel over real UCX in one process: chunks arrive with their
typed header in any order, the receiver refuses what was never opened or exceeds its
limits, and a request the upstream closed (complete or aborted) or abandoned ends every
wait for a chunk that will not come."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from yb_dataplane.activations import (
    ActivationReceiver,
    ActivationSender,
    UpstreamAborted,
)
from yb_dataplane.transport import (
    KVReceiver,
    KVSender,
    ReservationRefused,
    TransferTimeout,
)


class Header(msgspec.Struct, frozen=True):
    request_id: str
    chunk_index: int
    note: str


def chunk(seed: int, size: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


async def opened(
    receiver: KVReceiver, sender: KVSender
) -> tuple[ActivationReceiver[Header], ActivationSender[Header]]:
    """Both ends of a channel into `receiver`, with request "r" open."""
    inbound = ActivationReceiver(receiver, Header)
    outbound = ActivationSender[Header](sender, receiver.address)
    await outbound.open("r", deadline_s=10)
    return inbound, outbound


async def test_chunks_arrive_with_their_headers_in_any_order(
    receiver: KVReceiver, sender: KVSender
) -> None:
    inbound, outbound = await opened(receiver, sender)
    assert await inbound.next_request(deadline_s=10) == "r"
    for index in range(3):
        header = Header("r", index, f"chunk {index}")
        await outbound.send("r", index, header, chunk(index), deadline_s=10)
    await outbound.close("r", complete=True, deadline_s=10)
    for index in (2, 0, 1):
        header, payload = await inbound.receive("r", index, deadline_s=10)
        assert header == Header("r", index, f"chunk {index}")
        assert np.array_equal(payload, chunk(index))
    assert await inbound.wait_closed("r", deadline_s=10)
    with pytest.raises(UpstreamAborted, match=r"closed the request \(complete\)"):
        await inbound.receive("r", 3, deadline_s=10)
    inbound.forget("r")


async def test_an_aborted_request_ends_the_wait_for_its_next_chunk(
    receiver: KVReceiver, sender: KVSender
) -> None:
    inbound, outbound = await opened(receiver, sender)
    await outbound.send("r", 0, Header("r", 0, ""), chunk(0), deadline_s=10)
    await inbound.receive("r", 0, deadline_s=10)
    await outbound.close("r", complete=False, deadline_s=10)
    with pytest.raises(UpstreamAborted, match=r"\(aborted\)"):
        await inbound.receive("r", 1, deadline_s=60)
    assert not await inbound.wait_closed("r", deadline_s=10)


async def test_the_receiver_refuses_what_was_not_opened_or_is_too_large(
    receiver: KVReceiver, sender: KVSender
) -> None:
    inbound = ActivationReceiver(receiver, Header, max_chunk_bytes=1000)
    outbound = ActivationSender[Header](sender, receiver.address)
    with pytest.raises(ReservationRefused, match="never opened"):
        await outbound.send("stray", 0, Header("stray", 0, ""), chunk(0, 10), deadline_s=10)
    await outbound.open("r", deadline_s=10)
    with pytest.raises(ReservationRefused, match="already written"):
        await outbound.open("r", deadline_s=10)
    with pytest.raises(ReservationRefused, match="exceed the limits"):
        await outbound.send("r", 0, Header("r", 0, ""), chunk(0, 1001), deadline_s=10)
    with pytest.raises(ValueError, match="without '/'"):
        await outbound.open("a/b", deadline_s=10)
    # A chunk that is not coming, from an upstream that is still there: the deadline.
    with pytest.raises(TransferTimeout, match="chunk 1 of r"):
        await inbound.receive("r", 1, deadline_s=0.2)
    inbound.forget("r")
    with pytest.raises(ReservationRefused, match="never opened"):
        await outbound.send("r", 1, Header("r", 1, ""), chunk(1, 10), deadline_s=10)
