"""The data plane's rules, with sender and receiver in one process over real UCX.

Refusals (unknown request, wrong size, foreign index, duplicate), checksums, cancel,
deadlines, close, and the block-store paths (dynamic reservations, fetch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from yb_dataplane.transport import (
    ChecksumMismatch,
    FetchOrder,
    KVReceiver,
    KVSender,
    PeerUnreachable,
    Reason,
    Reservation,
    ReservationRefused,
    SegmentHeader,
    SizeMismatch,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)

GUARD = 0xAB


def arena_views(sizes: Sequence[int], gap: int = 64) -> tuple[np.ndarray, list[np.ndarray]]:
    """Reserved views into one arena, with guard bytes between and around them."""
    arena = np.full(sum(sizes) + gap * (len(sizes) + 1), GUARD, dtype=np.uint8)
    views, offset = [], gap
    for size in sizes:
        view = arena[offset : offset + size]
        view[:] = 0
        views.append(view)
        offset += size + gap
    return arena, views


def guards_intact(arena: np.ndarray, views: Sequence[np.ndarray]) -> bool:
    mask = np.ones(arena.size, dtype=bool)
    base = arena.__array_interface__["data"][0]
    for view in views:
        start = view.__array_interface__["data"][0] - base
        mask[start : start + view.size] = False
    return bool((arena[mask] == GUARD).all())


def data(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.asyncio
async def test_refusals_name_their_reason_and_write_nothing(
    receiver: KVReceiver, sender: KVSender
) -> None:
    sizes = [1000, 2000, 3000]
    arena, views = arena_views(sizes)
    reservation = receiver.reserve("req", views, deadline_s=20)
    peer = receiver.address
    src = [data(size, i) for i, size in enumerate(sizes)]

    with pytest.raises(ReservationRefused) as unknown:
        await sender.send(peer, "nobody", [(0, src[0])], deadline_s=5)
    assert unknown.value.reason is Reason.UNKNOWN_REQUEST
    assert "no reservation for nobody" in str(unknown.value)

    with pytest.raises(SizeMismatch) as size:
        await sender.send(peer, "req", [(0, data(1001, 9))], deadline_s=5)
    assert size.value.reason is Reason.SIZE_MISMATCH and size.value.indices == (0,)

    with pytest.raises(ReservationRefused) as outside:
        await sender.send(peer, "req", [(1, src[1]), (3, src[0])], deadline_s=5)
    assert outside.value.reason is Reason.BAD_INDEX and outside.value.indices == (3,)

    with pytest.raises(ReservationRefused) as negative:
        await sender.send(peer, "req", [(-1, src[0])], deadline_s=5)
    assert negative.value.reason is Reason.BAD_INDEX

    with pytest.raises(ReservationRefused) as twice:
        await sender.send(peer, "req", [(2, src[2]), (2, src[2])], deadline_s=5)
    assert twice.value.reason is Reason.DUPLICATE

    # Nothing of the refused segments landed, not even their valid parts.
    assert guards_intact(arena, views)
    assert all((view == 0).all() for view in views)
    assert reservation.received == set()

    # The connection is still in step: the same sender completes the transfer.
    await sender.send(peer, "req", [(0, src[0]), (1, src[1])], deadline_s=5)
    with pytest.raises(ReservationRefused) as again:
        await sender.send(peer, "req", [(1, src[1])], deadline_s=5)
    assert again.value.reason is Reason.DUPLICATE
    await sender.send(peer, "req", [(2, src[2])], deadline_s=5)
    await sender.commit(peer, "req", deadline_s=5)
    await reservation.wait_committed()
    assert all(np.array_equal(v, s) for v, s in zip(views, src, strict=True))
    assert guards_intact(arena, views)

    with pytest.raises(ReservationRefused) as late:
        await sender.send(peer, "req", [(0, src[0])], deadline_s=5)
    assert "committed" in str(late.value)


@pytest.mark.asyncio
async def test_corrupted_payload_is_refused_by_checksum(receiver: KVReceiver) -> None:
    def corrupt(request_id: str, items: Sequence[tuple[int, Any]]) -> None:
        # After the header's checksums were computed: flip one byte of index 2's source.
        for index, buffer in items:
            if request_id == "bad" and index == 2:
                buffer[17] ^= 0xFF

    sender = KVSender(after_checksum=corrupt)
    try:
        dest = [np.zeros(4096, dtype=np.uint8) for _ in range(4)]
        reservation = receiver.reserve("bad", dest, deadline_s=20)
        src = [data(4096, i) for i in range(4)]
        with pytest.raises(ChecksumMismatch) as refused:
            await sender.send(receiver.address, "bad", list(enumerate(src)), deadline_s=5)
        assert refused.value.indices == (2,)
        assert reservation.received == {0, 1, 3}
        with pytest.raises(ChecksumMismatch):
            await sender.commit(receiver.address, "bad", deadline_s=5)
        with pytest.raises(ChecksumMismatch):
            await reservation.wait_committed()
    finally:
        await sender.close()


@pytest.mark.asyncio
async def test_a_corrupted_block_may_be_sent_again_before_commit(receiver: KVReceiver) -> None:
    flips = iter([True])

    def corrupt_once(request_id: str, items: Sequence[tuple[int, Any]]) -> None:
        del request_id
        if next(flips, False):
            items[0][1][0] ^= 0x01

    sender = KVSender(after_checksum=corrupt_once)
    try:
        dest = [np.zeros(512, dtype=np.uint8)]
        reservation = receiver.reserve("retry", dest, deadline_s=20)
        src = data(512, 1)
        with pytest.raises(ChecksumMismatch):
            await sender.send(receiver.address, "retry", [(0, src.copy())], deadline_s=5)
        assert reservation.received == set()
        await sender.send(receiver.address, "retry", [(0, src)], deadline_s=5)
        await sender.commit(receiver.address, "retry", deadline_s=5)
        await reservation.wait_committed()
        assert np.array_equal(dest[0], src)
    finally:
        await sender.close()


@pytest.mark.asyncio
async def test_commit_with_missing_indices_fails_the_reservation(
    receiver: KVReceiver, sender: KVSender
) -> None:
    reservation = receiver.reserve("part", [np.zeros(64, np.uint8)] * 3, deadline_s=20)
    await sender.send(receiver.address, "part", [(1, data(64, 0))], deadline_s=5)
    with pytest.raises(ReservationRefused) as refused:
        await sender.commit(receiver.address, "part", deadline_s=5)
    assert refused.value.reason is Reason.INCOMPLETE
    assert refused.value.indices == (0, 2)
    with pytest.raises(ReservationRefused):
        await reservation.wait_committed()
    with pytest.raises(ReservationRefused) as unknown:
        await sender.commit(receiver.address, "never", deadline_s=5)
    assert unknown.value.reason is Reason.UNKNOWN_REQUEST


@pytest.mark.asyncio
async def test_concurrent_segments_and_torch_buffers(
    receiver: KVReceiver, sender: KVSender
) -> None:
    # bf16 pages, as the model runner's KV cache holds them; several layers in flight.
    dest = [torch.zeros(8, 16, dtype=torch.bfloat16) for _ in range(12)]
    src = [torch.randn(8, 16).to(torch.bfloat16) for _ in range(12)]
    reservation = receiver.reserve("torch", dest, deadline_s=20)
    layers = [[(i, src[i]) for i in range(layer * 3, layer * 3 + 3)] for layer in range(4)]
    await asyncio.gather(
        *(sender.send(receiver.address, "torch", items, deadline_s=5) for items in layers)
    )
    await sender.commit(receiver.address, "torch", deadline_s=5)
    await reservation.wait_committed()
    assert all(torch.equal(d, s) for d, s in zip(dest, src, strict=True))


@pytest.mark.asyncio
async def test_cancel_and_deadline(receiver: KVReceiver, sender: KVSender) -> None:
    cancelled = receiver.reserve("c", [np.zeros(64, np.uint8)] * 2, deadline_s=20)
    await sender.send(receiver.address, "c", [(0, data(64, 0))], deadline_s=5)
    receiver.cancel("c")
    receiver.cancel("c")  # idempotent
    receiver.cancel("unknown")  # no-op
    with pytest.raises(TransferCancelled):
        await cancelled.wait_committed()
    with pytest.raises(ReservationRefused) as late:
        await sender.send(receiver.address, "c", [(1, data(64, 1))], deadline_s=5)
    assert "cancelled" in str(late.value)

    expiring = receiver.reserve("t", [np.zeros(64, np.uint8)], deadline_s=0.3)
    with pytest.raises(TransferTimeout):
        await asyncio.wait_for(expiring.wait_committed(), 5)
    # A cancelled wait does not cancel the reservation.
    kept = receiver.reserve("k", [np.zeros(8, np.uint8)], deadline_s=20)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(kept.wait_committed(), 0.05)
    assert not kept.done
    receiver.cancel("k")


@pytest.mark.asyncio
async def test_reserve_validates_buffers(receiver: KVReceiver) -> None:
    readonly = np.zeros(16, np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        receiver.reserve("ro", [readonly], deadline_s=1)
    with pytest.raises(ValueError, match="contiguous"):
        receiver.reserve("nc", [np.zeros((4, 4), np.uint8)[:, 1]], deadline_s=1)
    with pytest.raises(ValueError, match="read-only"):
        receiver.reserve("bytes", [b"immutable"], deadline_s=1)
    receiver.reserve("dup", [bytearray(4)], deadline_s=1)
    with pytest.raises(ValueError, match="already"):
        receiver.reserve("dup", [bytearray(4)], deadline_s=1)
    receiver.cancel("dup")


@pytest.mark.asyncio
async def test_close_is_idempotent_and_fails_what_is_open() -> None:
    rx = KVReceiver()
    tx = KVSender(connect_timeout_s=20)
    # Its connect can only fail (nothing listens by then), so a short timeout is safe.
    late = KVSender(connect_timeout_s=0.5)
    try:
        address = await rx.start()
        reservation = rx.reserve("open", [np.zeros(8, np.uint8)] * 2, deadline_s=20)
        await tx.send(address, "open", [(0, data(8, 0))], deadline_s=30)
        await asyncio.gather(rx.close(), rx.close())
        await rx.close()
        with pytest.raises(TransferCancelled):
            await reservation.wait_committed()
        with pytest.raises(RuntimeError):
            rx.reserve("after", [np.zeros(8, np.uint8)], deadline_s=1)
        # The receiver is gone: nothing listens any more.
        with pytest.raises(PeerUnreachable):
            await late.send(address, "open", [(1, data(8, 1))], deadline_s=5)
        await tx.close()
        await tx.close()
        with pytest.raises(PeerUnreachable, match="closed"):
            await tx.send(address, "open", [(1, data(8, 1))], deadline_s=2)
    finally:
        await tx.close()
        await late.close()
        await rx.close()


@pytest.mark.asyncio
async def test_reservation_factory_lets_a_put_allocate_on_arrival(
    receiver: KVReceiver, sender: KVSender
) -> None:
    slots: dict[str, list[np.ndarray]] = {}
    created: list[Reservation] = []

    def allocate(request_id: str, header: SegmentHeader) -> list[np.ndarray] | None:
        if not request_id.startswith("put:"):
            return None
        slots[request_id] = [np.zeros(size, np.uint8) for size in header.sizes]
        return slots[request_id]

    receiver.set_reservation_factory(allocate, deadline_s=10, on_reserved=created.append)
    blocks = [data(300, 1), data(500, 2)]
    await sender.send(receiver.address, "put:abc", list(enumerate(blocks)), deadline_s=5)
    await sender.commit(receiver.address, "put:abc", deadline_s=5)
    assert [r.request_id for r in created] == ["put:abc"]
    await created[0].wait_committed()
    assert all(np.array_equal(a, b) for a, b in zip(slots["put:abc"], blocks, strict=True))

    with pytest.raises(ReservationRefused) as refused:
        await sender.send(receiver.address, "other", [(0, blocks[0])], deadline_s=5)
    assert refused.value.reason is Reason.UNKNOWN_REQUEST


@pytest.mark.asyncio
async def test_fetch_asks_a_holder_to_send_into_our_reservation() -> None:
    store = {"k1": data(1000, 1), "k2": data(2000, 2)}
    holder_rx, holder_tx = KVReceiver(), KVSender()
    asker_rx, asker_tx = KVReceiver(), KVSender()

    async def serve(order: FetchOrder) -> None:
        missing = [key for key in order.keys if key not in store]
        if missing:
            raise ReservationRefused(f"unknown blocks {missing}", reason=Reason.UNKNOWN_REQUEST)
        items = [(i, store[key]) for i, key in enumerate(order.keys)]
        await holder_tx.send(
            order.reply_to, order.request_id, items, deadline_s=order.remaining_s()
        )
        await holder_tx.commit(order.reply_to, order.request_id, deadline_s=order.remaining_s())

    try:
        holder = await holder_rx.start()
        holder_rx.set_fetch_handler(serve)
        me = await asker_rx.start()
        dest = [np.zeros(1000, np.uint8), np.zeros(2000, np.uint8)]
        reservation = asker_rx.reserve("fetch1", dest, deadline_s=10)
        await asker_tx.request_fetch(holder, "fetch1", ["k1", "k2"], reply_to=me, deadline_s=5)
        assert reservation.done
        await reservation.wait_committed()
        assert np.array_equal(dest[0], store["k1"]) and np.array_equal(dest[1], store["k2"])

        asker_rx.reserve("fetch2", [np.zeros(1000, np.uint8)], deadline_s=10)
        with pytest.raises(ReservationRefused, match="unknown blocks"):
            await asker_tx.request_fetch(holder, "fetch2", ["nope"], reply_to=me, deadline_s=5)
        asker_rx.cancel("fetch2")

        with pytest.raises(TransferError) as no_handler:
            await holder_tx.request_fetch(me, "x", ["k1"], reply_to=holder, deadline_s=5)
        assert no_handler.value.reason is Reason.FETCH_FAILED
    finally:
        for closable in (asker_tx, asker_rx, holder_tx, holder_rx):
            await closable.close()


@pytest.mark.asyncio
async def test_cancel_mid_segment_stops_writes_and_the_sender_recovers(
    receiver: KVReceiver, sender: KVSender
) -> None:
    # A raw sender (below KVSender) that posts a segment's header and holds its
    # payloads back: the receiver has admitted the segment and posted its receives
    # into the reserved buffers, and no byte has landed yet, whenever cancel() runs.
    from yb_dataplane.transport import checksum, ucx_env
    from yb_dataplane.transport.handshake import connect
    from yb_dataplane.transport.wire import CTRL_TAG, REPLY_TAG, Bye, data_tag

    size, count = 4 << 20, 4
    dest = [np.zeros(size, np.uint8) for _ in range(count)]
    src = [np.full(size, i + 1, np.uint8) for i in range(count)]
    reservation = receiver.reserve("big", dest, deadline_s=30)
    ucx = ucx_env.acquire()
    link = await connect(ucx, receiver.address, name="held", timeout_s=10)
    # One connection of its own here; `sender` connects only later.
    try:
        header = SegmentHeader(
            0, "big", list(range(count)), [size] * count, [checksum(b) for b in src]
        )
        await link.send_frame(header, CTRL_TAG)
        async with asyncio.timeout(10):  # admitted: receives posted into `dest`
            while reservation._pending != set(range(count)):
                await asyncio.sleep(0.001)
        (held,) = receiver._links

        receiver.cancel("big")
        # cancel() closed the connection that had receives posted into the buffers
        # before it returned (white-box), and tells the sender so.
        assert not held.alive
        assert isinstance(await asyncio.wait_for(link.recv_frame(REPLY_TAG), 10), Bye)
        with pytest.raises(TransferCancelled):
            await reservation.wait_committed()
        # The held payloads go now: nothing of theirs may land in the buffers.
        for position, buffer in enumerate(src):
            link.post_send(buffer, data_tag(0, position))
    finally:
        await link.close()
        ucx_env.release()

    # The receiver serves the next request (the marker that it processed what came
    # before), and the cancelled buffers stayed untouched throughout.
    small = [np.zeros(64, np.uint8)]
    second = receiver.reserve("next", small, deadline_s=10)
    await sender.send(receiver.address, "next", [(0, data(64, 3))], deadline_s=5)
    await sender.commit(receiver.address, "next", deadline_s=5)
    await second.wait_committed()
    assert all(not d.any() for d in dest)
    assert reservation.received == set()


@pytest.mark.asyncio
async def test_a_lying_or_malformed_peer_cannot_write_past_the_reservation(
    receiver: KVReceiver,
) -> None:
    # A raw client, below KVSender, that violates the protocol on purpose.
    from yb_dataplane.transport import checksum, ucx_env
    from yb_dataplane.transport.handshake import connect
    from yb_dataplane.transport.wire import CTRL_TAG, REPLY_TAG, Bye, Nack, data_tag

    arena, views = arena_views([8])
    reservation = receiver.reserve("victim", views, deadline_s=20)
    ucx = ucx_env.acquire()
    link = await connect(ucx, receiver.address, name="raw", timeout_s=5)
    try:
        # Inconsistent lengths: refused, and the connection closed (the receiver cannot
        # know how many payloads follow), which it says.
        await link.send_frame(SegmentHeader(0, "victim", [0], [8, 8], [1]), CTRL_TAG)
        malformed = await link.recv_frame(REPLY_TAG)
        assert isinstance(malformed, Nack) and malformed.reason is Reason.MALFORMED
        assert isinstance(await link.recv_frame(REPLY_TAG), Bye)
        await link.close()

        # The header announces 8 bytes with the right checksum, the payload has 4096.
        link = await connect(ucx, receiver.address, name="raw2", timeout_s=5)
        payload = np.arange(4096, dtype=np.uint8)
        header = SegmentHeader(1, "victim", [0], [8], [checksum(payload[:8])])
        await link.send_frame(header, CTRL_TAG)
        await link.send_bytes(payload, data_tag(1, 0))
        oversized = await link.recv_frame(REPLY_TAG)
        assert isinstance(oversized, Nack) and oversized.reason is Reason.SIZE_MISMATCH
        assert guards_intact(arena, views)
        assert reservation.received == set()
    finally:
        await link.close()
        ucx_env.release()
    receiver.cancel("victim")


@pytest.mark.asyncio
async def test_public_ucxx_coroutines_fallback_moves_the_same_bytes(
    receiver: KVReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without ucxx's request-level internals, links fall back to its public coroutines.
    from yb_dataplane.transport import link

    monkeypatch.setattr(link, "RAW_API", None)
    sender = KVSender()
    try:
        dest = [np.zeros(20_000, np.uint8) for _ in range(3)]
        src = [data(20_000, i) for i in range(3)]
        reservation = receiver.reserve("fallback", dest, deadline_s=10)
        await sender.send(receiver.address, "fallback", list(enumerate(src)), deadline_s=5)
        with pytest.raises(ReservationRefused):
            await sender.send(receiver.address, "fallback", [(0, src[0])], deadline_s=5)
        await sender.commit(receiver.address, "fallback", deadline_s=5)
        await reservation.wait_committed()
        assert all(np.array_equal(d, s) for d, s in zip(dest, src, strict=True))
    finally:
        await sender.close()


@pytest.mark.asyncio
async def test_adjacent_pages_travel_as_spans_into_adjacent_or_scattered_pages(
    receiver: KVReceiver, sender: KVSender
) -> None:
    # Consecutive pages of one layer of a KV cache: one tensor, sliced.
    cache = torch.from_numpy(data(8 * 4096, 1)).view(8, 4096)
    pages = [cache[i] for i in range(8)]
    # Adjacent destinations (a fresh decode cache) and scattered ones (guard gaps).
    adjacent = np.zeros((8, 4096), np.uint8)
    arena, scattered = arena_views([4096] * 8)
    for name, dest in (("adjacent", list(adjacent)), ("scattered", scattered)):
        reservation = receiver.reserve(name, dest, deadline_s=10)
        # Pages 0-3 and 5-7 are runs; 4 is sent on its own in between.
        items = [(i, pages[i]) for i in (0, 1, 2, 3, 5, 6, 7)] + [(4, pages[4])]
        await sender.send(receiver.address, name, items, deadline_s=5, commit=True)
        await reservation.wait_committed()
        assert reservation.checksums[3] != 0
        for i in range(8):
            assert np.array_equal(np.asarray(dest[i]), pages[i].numpy()), (name, i)
    assert guards_intact(arena, scattered)


@pytest.mark.asyncio
async def test_a_sender_told_the_receivers_layout_sends_nothing_to_stage(
    receiver: KVReceiver, sender: KVSender
) -> None:
    cache = torch.from_numpy(data(8 * 4096, 3)).view(8, 4096)
    pages = [cache[i] for i in range(8)]
    adjacent = np.zeros((8, 4096), np.uint8)
    arena, scattered = arena_views([4096] * 8)
    # Destinations adjacent in runs: 0-2, 3 alone, 4-7.
    runs = np.zeros((9, 4096), np.uint8)
    mixed = [runs[0], runs[1], runs[2], scattered[3], runs[5], runs[6], runs[7], runs[8]]
    expected_breaks = {"adjacent": [], "scattered": list(range(1, 8)), "mixed": [3, 4]}
    for name, dest in (("adjacent", list(adjacent)), ("scattered", scattered), ("mixed", mixed)):
        reservation = receiver.reserve(name, dest, deadline_s=10)
        assert reservation.breaks() == expected_breaks[name]
        before = receiver.staged_bytes
        items = [(i, pages[i]) for i in range(8)]
        await sender.send(
            receiver.address,
            name,
            items,
            deadline_s=5,
            commit=True,
            receiver_breaks=reservation.breaks(),
        )
        await reservation.wait_committed()
        assert receiver.staged_bytes == before, name
        for i in range(8):
            assert np.array_equal(np.asarray(dest[i]), pages[i].numpy()), (name, i)
    # A sender that does not know the layout still delivers, through a staging copy.
    dest = arena_views([4096] * 8)[1]
    reservation = receiver.reserve("unknown", dest, deadline_s=10)
    await sender.send(
        receiver.address, "unknown", [(i, pages[i]) for i in range(8)], deadline_s=5, commit=True
    )
    await reservation.wait_committed()
    assert receiver.staged_bytes > 0
    assert all(np.array_equal(np.asarray(dest[i]), pages[i].numpy()) for i in range(8))
    assert guards_intact(arena, scattered)


@pytest.mark.asyncio
async def test_a_fetch_carries_the_askers_layout_to_the_holder() -> None:
    slot = data(4 * 1000, 5)  # one stored block: four layer chunks side by side
    holder_rx, holder_tx = KVReceiver(), KVSender()
    asker_rx, asker_tx = KVReceiver(), KVSender()
    seen: list[frozenset[int] | None] = []

    async def serve(order: FetchOrder) -> None:
        seen.append(order.breaks)
        items = [(i, slot[i * 1000 : (i + 1) * 1000]) for i in range(4)]
        await holder_tx.send(
            order.reply_to,
            order.request_id,
            items,
            deadline_s=order.remaining_s(),
            commit=True,
            receiver_breaks=order.breaks,
        )

    try:
        holder = await holder_rx.start()
        holder_rx.set_fetch_handler(serve)
        me = await asker_rx.start()
        # The chunks land a "layer" apart, as in an engine's cache.
        layers = np.zeros((4, 3000), np.uint8)
        dest = [layers[i, :1000] for i in range(4)]
        reservation = asker_rx.reserve("f", dest, deadline_s=10)
        await asker_tx.request_fetch(
            holder, "f", ["b"], reply_to=me, deadline_s=5, breaks=reservation.breaks()
        )
        await reservation.wait_committed()
        assert seen == [frozenset({1, 2, 3})]
        assert asker_rx.staged_bytes == 0
        assert all(np.array_equal(dest[i], slot[i * 1000 : (i + 1) * 1000]) for i in range(4))
    finally:
        for closable in (asker_tx, asker_rx, holder_tx, holder_rx):
            await closable.close()


@pytest.mark.asyncio
async def test_a_corrupt_page_inside_a_span_is_named_and_may_be_resent(
    receiver: KVReceiver,
) -> None:
    block = data(4 * 1000, 2)
    sources = [block[i * 1000 : (i + 1) * 1000] for i in range(4)]

    corrupted: list[int] = []

    def corrupt_page_two(request_id: str, items: Sequence[tuple[int, Any]]) -> None:
        for index, buf in items:
            if index == 2 and not corrupted:  # after its checksum: the bytes sent differ
                buf[0] ^= 0xFF
                corrupted.append(index)

    sender = KVSender(after_checksum=corrupt_page_two)
    try:
        dest = [np.zeros(1000, np.uint8) for _ in range(4)]
        reservation = receiver.reserve("span-bad", dest, deadline_s=10)
        with pytest.raises(ChecksumMismatch) as refused:
            await sender.send(receiver.address, "span-bad", list(enumerate(sources)), deadline_s=5)
        assert refused.value.indices == (2,)
        assert reservation.received == {0, 1, 3} and not reservation.done
        sources[2][0] ^= 0xFF  # repaired
        await sender.send(receiver.address, "span-bad", [(2, sources[2])], deadline_s=5)
        await sender.commit(receiver.address, "span-bad", deadline_s=5)
        await reservation.wait_committed()
        assert all(np.array_equal(d, s) for d, s in zip(dest, sources, strict=True))
    finally:
        await sender.close()


@pytest.mark.asyncio
async def test_send_segments_is_one_round_trip_with_its_commit(
    receiver: KVReceiver, sender: KVSender
) -> None:
    src = [data(50_000, i) for i in range(6)]
    dest = [np.zeros(50_000, np.uint8) for _ in range(6)]
    reservation = receiver.reserve("batch", dest, deadline_s=10)
    segments = [[(0, src[0]), (1, src[1])], [(2, src[2])], [(3, src[3]), (4, src[4]), (5, src[5])]]
    await sender.send_segments(receiver.address, "batch", segments, deadline_s=5)
    assert reservation.done  # committed by the time the call returns
    await reservation.wait_committed()
    assert all(np.array_equal(d, s) for d, s in zip(dest, src, strict=True))

    # A batch that leaves an index out: the piggybacked commit fails the reservation.
    short = receiver.reserve("short", [np.zeros(10, np.uint8) for _ in range(2)], deadline_s=10)
    with pytest.raises(ReservationRefused) as refused:
        await sender.send_segments(
            receiver.address, "short", [[(0, np.ones(10, np.uint8))]], deadline_s=5
        )
    assert refused.value.reason is Reason.INCOMPLETE
    with pytest.raises(ReservationRefused):
        await short.wait_committed()


@pytest.mark.asyncio
async def test_spans_that_do_not_add_up_are_malformed(receiver: KVReceiver) -> None:
    from yb_dataplane.transport import ucx_env
    from yb_dataplane.transport.handshake import connect
    from yb_dataplane.transport.wire import CTRL_TAG, REPLY_TAG, Nack

    receiver.reserve("spans", [np.zeros(8, np.uint8), np.zeros(8, np.uint8)], deadline_s=10)
    ucx = ucx_env.acquire()
    link = await connect(ucx, receiver.address, name="raw", timeout_s=5)
    try:
        header = SegmentHeader(0, "spans", [0, 1], [8, 8], [1, 2], [3])
        await link.send_frame(header, CTRL_TAG)
        reply = await link.recv_frame(REPLY_TAG)
        assert isinstance(reply, Nack) and reply.reason is Reason.MALFORMED
    finally:
        await link.close()
        ucx_env.release()
    receiver.cancel("spans")


@pytest.mark.asyncio
async def test_a_factory_refusal_carries_its_reason(receiver: KVReceiver, sender: KVSender) -> None:
    def factory(request_id: str, header: SegmentHeader) -> list[np.ndarray] | None:
        raise ReservationRefused("held already", reason=Reason.DUPLICATE)

    receiver.set_reservation_factory(factory)
    with pytest.raises(ReservationRefused, match="held already") as refused:
        await sender.send(receiver.address, "put.x", [(0, data(100, 3))], deadline_s=5)
    assert refused.value.reason is Reason.DUPLICATE


@pytest.mark.asyncio
async def test_a_sender_that_drops_its_connection_says_goodbye(receiver: KVReceiver) -> None:
    sender = KVSender()
    receiver.reserve("hi", [np.zeros(64, np.uint8)], deadline_s=10)
    await sender.send(receiver.address, "hi", [(0, data(64, 1))], deadline_s=5, commit=True)
    assert receiver.connections == 1
    await sender.close()
    # Nothing else would tell the receiver: the sender's process lives on (it is this one).
    async with asyncio.timeout(3):
        while receiver.connections:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_hello_in_another_protocol_version_is_refused_with_the_reason(
    receiver: KVReceiver,
) -> None:
    from yb_dataplane.transport import ucx_env
    from yb_dataplane.transport.handshake import frame_array, new_tag_base
    from yb_dataplane.transport.link import Link
    from yb_dataplane.transport.wire import REPLY_TAG, Hello, Welcome, encode_frame

    ucx = ucx_env.acquire()
    endpoint = await ucx.create_endpoint_from_worker_address(
        ucx_env.address_from(receiver.address.worker), endpoint_error_handling=True
    )
    link = Link(endpoint, "old", recv_base=new_tag_base())
    try:
        hello = Hello(99, ucx_env.worker_address(), link.recv_base, "old")
        await endpoint.send(
            frame_array(encode_frame(hello)), tag=receiver.address.hello_tag, force_tag=True
        )
        async with asyncio.timeout(5):
            answer = await link.recv_frame(REPLY_TAG)
        assert isinstance(answer, Welcome) and answer.recv_base == 0
        assert "protocol version 99" in answer.reason
    finally:
        await link.close()
        ucx_env.release()
    assert receiver.connections == 0


@pytest.mark.asyncio
async def test_a_receiver_answers_only_the_peers_its_check_vouches_for(
    receiver: KVReceiver,
) -> None:
    vouched: list[bytes] = []

    async def nobody(worker: bytes) -> bool:
        vouched.append(worker)
        return False

    receiver.set_peer_check(nobody)
    receiver.reserve("stranger", [np.zeros(64, np.uint8)], deadline_s=10)
    sender = KVSender(connect_timeout_s=1.0)
    try:
        with pytest.raises(PeerUnreachable, match="did not answer"):
            await sender.send(receiver.address, "stranger", [(0, data(64, 2))], deadline_s=5)
        assert receiver.connections == 0
        # The check saw the sender's own worker address (this process's).
        assert vouched and vouched[0] == receiver.address.worker

        async def everybody(worker: bytes) -> bool:
            return True

        receiver.set_peer_check(everybody)
        # A sender of its own: the short connect timeout above is for the refusal, and
        # this connect must not depend on how fast a loaded machine answers.
        trusted = KVSender(connect_timeout_s=20.0)
        try:
            await trusted.send(
                receiver.address, "stranger", [(0, data(64, 2))], deadline_s=30, commit=True
            )
        finally:
            await trusted.close()
    finally:
        await sender.close()


@pytest.mark.asyncio
async def test_a_commit_delivers_its_note_to_the_reservation(
    receiver: KVReceiver, sender: KVSender
) -> None:
    # On the segment that commits, on a commit of its own, and none: the owner reads
    # it once `wait_committed()` returned, and only from a commit that succeeded.
    src = [data(1000, i) for i in range(2)]
    on_segment = receiver.reserve("seg", [np.zeros(1000, np.uint8) for _ in src], deadline_s=10)
    await sender.send(receiver.address, "seg", [(0, src[0])], deadline_s=5)
    await sender.send(receiver.address, "seg", [(1, src[1])], deadline_s=5, commit=True, note=b"a")
    await on_segment.wait_committed()
    assert on_segment.note == b"a"

    alone = receiver.reserve("alone", [np.zeros(1000, np.uint8)], deadline_s=10)
    await sender.send(receiver.address, "alone", [(0, src[0])], deadline_s=5)
    assert alone.note == b""
    await sender.commit(receiver.address, "alone", deadline_s=5, note=b"b" * 4096)
    await alone.wait_committed()
    assert alone.note == b"b" * 4096

    plain = receiver.reserve("plain", [np.zeros(1000, np.uint8)], deadline_s=10)
    await sender.send(receiver.address, "plain", [(0, src[0])], deadline_s=5, commit=True)
    await plain.wait_committed()
    assert plain.note == b""

    # A commit refused (an index missing) delivers nothing.
    short = receiver.reserve("short", [np.zeros(1000, np.uint8) for _ in src], deadline_s=10)
    await sender.send(receiver.address, "short", [(0, src[0])], deadline_s=5)
    with pytest.raises(ReservationRefused):
        await sender.commit(receiver.address, "short", deadline_s=5, note=b"c")
    with pytest.raises(ReservationRefused):
        await short.wait_committed()
    assert short.note == b""
    # A note without a commit is a caller's mistake.
    with pytest.raises(ValueError, match="note"):
        await sender.send(receiver.address, "x", [(0, src[0])], deadline_s=5, note=b"d")


@pytest.mark.asyncio
async def test_ucx_progresses_on_the_project_s_progress_thread(receiver: KVReceiver) -> None:
    """The context's progress runs on `ucx_env`'s thread mode (the epoll timeout of
    `PROGRESS_EPOLL_TIMEOUT_MS`, not ucxx's 1 ms): a ucxx whose layout no longer lets
    it be installed fails here instead of quietly waking a thousand times a second."""
    from ucxx._lib_async import application_context

    from yb_dataplane.transport import ucx_env

    task = application_context.ProgressTasks.get(asyncio.get_running_loop())
    assert isinstance(task, ucx_env._ThreadMode)
    assert ucx_env.PROGRESS_EPOLL_TIMEOUT_MS > 1
