"""Activations between pipeline stages: one chunk at a time over the KV data plane.

A stage of a prefill group passes each chunk's hidden states to the next stage with a
typed header (a msgspec struct the caller chooses, e.g. the engine's `HiddenHeader`).
Both travel over UCX with `KVSender` into reservations of the next stage's `KVReceiver`,
one reservation per chunk, so the bytes land once, where the next stage reads them.

Per request the upstream side (`ActivationSender`):

1. `open(request_id)`: one byte into `{request_id}/open`, a two-index reservation the
   downstream side creates on arrival. Its first segment ties the reservation to the
   upstream connection: if the upstream process dies, the receiver fails it
   (`PeerUnreachable`), and every wait of the request ends with that error at once
   instead of at its deadline.
2. `send(request_id, chunk_index, header, payload)`: the encoded header (index 0) and the
   payload bytes (index 1) into `{request_id}/{chunk_index}`, committed in the same round
   trip; it returns once the downstream side verified both.
3. `close(request_id, complete=...)`: the status byte into `{request_id}/open`, committed:
   `complete=False` says the upstream gave up (a chunk that never came is then an error
   naming the upstream's abort, not a timeout).

The downstream side (`ActivationReceiver`) creates those reservations when their first
segment arrives (it owns its receiver's reservation factory), hands out requests in the
order they were opened (`next_request`) and chunks by index (`receive`), and tells when
the upstream closed a request (`wait_closed`). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import msgspec
import numpy as np

from yb_dataplane.transport import (
    BufferLike,
    KVReceiver,
    KVSender,
    PeerAddress,
    Reservation,
    ReservationRefused,
    SegmentHeader,
    TransferCancelled,
    TransferError,
)
from yb_dataplane.transport.deadline import Deadline

H = TypeVar("H", bound=msgspec.Struct)

_OPEN: Final = "open"
_STATUS_COMPLETE: Final = 1
_STATUS_ABORTED: Final = 2
#: Largest encoded chunk header accepted (a header is tens of bytes).
MAX_HEADER_BYTES: Final = 4096


class UpstreamAborted(TransferError):
    """The previous stage closed the request without sending the chunk waited for."""


def _open_id(request_id: str) -> str:
    return f"{request_id}/{_OPEN}"


def _chunk_id(request_id: str, chunk_index: int) -> str:
    return f"{request_id}/{chunk_index}"


def _split(reservation_id: str) -> tuple[str, str]:
    request_id, _, tail = reservation_id.rpartition("/")
    return request_id, tail


class ActivationSender(Generic[H]):
    """Sends chunks of one or more requests to the next stage's `ActivationReceiver`,
    reached at `peer`, over `sender` (shared with other traffic, e.g. KV to decode)."""

    def __init__(self, sender: KVSender, peer: PeerAddress) -> None:
        self.sender = sender
        self.peer = peer
        self._encoder = msgspec.msgpack.Encoder()

    async def open(self, request_id: str, *, deadline_s: float) -> None:
        """Announce `request_id` downstream (before its first chunk)."""
        if "/" in request_id or not request_id:
            raise ValueError(f"request id {request_id!r}: non-empty, without '/'")
        marker = np.ones(1, dtype=np.uint8)
        await self.sender.send(
            self.peer, _open_id(request_id), [(0, marker)], deadline_s=deadline_s
        )

    async def send(
        self,
        request_id: str,
        chunk_index: int,
        header: H,
        payload: BufferLike,
        *,
        deadline_s: float,
    ) -> None:
        """Send chunk `chunk_index` of an open request: `header` and `payload`'s bytes,
        which must not change until this returns."""
        encoded = np.frombuffer(self._encoder.encode(header), dtype=np.uint8)
        await self.sender.send(
            self.peer,
            _chunk_id(request_id, chunk_index),
            [(0, encoded), (1, payload)],
            deadline_s=deadline_s,
            commit=True,
        )

    async def close(self, request_id: str, *, complete: bool, deadline_s: float) -> None:
        """End `request_id` downstream: every chunk was sent (`complete`), or none
        more will be. Call it after every `send` of the request returned."""
        status = np.full(1, _STATUS_COMPLETE if complete else _STATUS_ABORTED, dtype=np.uint8)
        await self.sender.send(
            self.peer, _open_id(request_id), [(1, status)], deadline_s=deadline_s, commit=True
        )


@dataclass
class _Inbound:
    """What the receiving side knows of one request."""

    opened: Reservation
    status: np.ndarray
    chunks: dict[int, asyncio.Future[tuple[Reservation, list[np.ndarray]]]] = field(
        default_factory=dict
    )


class ActivationReceiver(Generic[H]):
    """Takes the chunks an `ActivationSender` sends to `receiver`'s address.

    Installs itself as `receiver`'s reservation factory: the receiver serves this
    channel only. `request_deadline_s` bounds how long a request may stay open (its
    `open` reservation's deadline); `max_chunk_bytes` refuses larger payloads.
    Call everything on the receiver's event loop. With `queue_requests` (the
    default), every opened request id also queues for `next_request`; a side that
    takes requests by id only (a driver hearing back from the last stage, a stage
    told of its requests some other way) turns it off, so nothing piles up there.
    """

    def __init__(
        self,
        receiver: KVReceiver,
        header_type: type[H],
        *,
        request_deadline_s: float = 600.0,
        max_chunk_bytes: int = 1 << 30,
        queue_requests: bool = True,
    ) -> None:
        self.receiver = receiver
        self._decoder = msgspec.msgpack.Decoder(header_type)
        self._max_chunk_bytes = max_chunk_bytes
        self._queue_requests = queue_requests
        self._requests: dict[str, _Inbound] = {}
        # Requests someone waits for before their upstream opened them.
        self._awaited: dict[str, asyncio.Future[_Inbound]] = {}
        self._opened: asyncio.Queue[str] = asyncio.Queue()
        self._pending_buffers: dict[str, list[np.ndarray]] = {}
        receiver.set_reservation_factory(
            self._buffers_for, deadline_s=request_deadline_s, on_reserved=self._reserved
        )

    def _buffers_for(self, reservation_id: str, header: SegmentHeader) -> Sequence[np.ndarray]:
        request_id, tail = _split(reservation_id)
        if tail == _OPEN:
            if request_id in self._requests or list(header.indices) != [0]:
                raise ReservationRefused(f"{reservation_id}: opened twice or malformed")
            buffers = [np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.uint8)]
        else:
            if request_id not in self._requests or not tail.isdigit():
                raise ReservationRefused(f"{reservation_id}: chunk of a request never opened")
            if list(header.indices) != [0, 1]:
                raise ReservationRefused(f"{reservation_id}: a chunk is a header and a payload")
            header_size, payload_size = header.sizes
            if header_size > MAX_HEADER_BYTES or payload_size > self._max_chunk_bytes:
                raise ReservationRefused(
                    f"{reservation_id}: {header_size}+{payload_size} bytes exceed the limits"
                )
            buffers = [np.empty(size, dtype=np.uint8) for size in header.sizes]
        self._pending_buffers[reservation_id] = buffers
        return buffers

    def _reserved(self, reservation: Reservation) -> None:
        buffers = self._pending_buffers.pop(reservation.request_id)
        request_id, tail = _split(reservation.request_id)
        if tail == _OPEN:
            inbound = self._requests[request_id] = _Inbound(reservation, buffers[1])
            if self._queue_requests:
                self._opened.put_nowait(request_id)
            awaited = self._awaited.pop(request_id, None)
            if awaited is not None:
                awaited.set_result(inbound)
            return
        inbound = self._requests[request_id]
        self._chunk_future(inbound, int(tail)).set_result((reservation, buffers))

    @staticmethod
    def _chunk_future(
        inbound: _Inbound, index: int
    ) -> asyncio.Future[tuple[Reservation, list[np.ndarray]]]:
        future = inbound.chunks.get(index)
        if future is None:
            future = inbound.chunks[index] = asyncio.get_running_loop().create_future()
        return future

    async def next_request(self, *, deadline_s: float) -> str:
        """The id of the next request an upstream opened (in the order opened)."""
        if not self._queue_requests:
            raise RuntimeError("this receiver does not queue requests (queue_requests=False)")
        return await Deadline.after(deadline_s).run(self._opened.get(), "waiting for a request")

    async def receive(
        self, request_id: str, chunk_index: int, *, deadline_s: float
    ) -> tuple[H, np.ndarray]:
        """Chunk `chunk_index` of an open request: its header and payload bytes.

        Waits for the upstream to open the request if it has not yet. Raises
        PeerUnreachable when the upstream's connection broke first, UpstreamAborted when
        the upstream closed the request without this chunk, TransferTimeout at the
        deadline.
        """
        deadline = Deadline.after(deadline_s)
        what = f"chunk {chunk_index} of {request_id}"
        inbound = await self._opened_request(request_id, deadline)
        arrival = self._chunk_future(inbound, chunk_index)
        if not arrival.done():
            closed = asyncio.ensure_future(inbound.opened.wait_committed())
            either: set[asyncio.Future[Any]] = {arrival, closed}
            try:
                await deadline.run(asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED), what)
            finally:
                closed.cancel()
            if not arrival.done():
                upstream_failure = None if closed.cancelled() else closed.exception()
                if upstream_failure is not None:
                    raise upstream_failure
                raise UpstreamAborted(
                    f"{what}: the previous stage closed the request "
                    f"({'complete' if self._complete(inbound) else 'aborted'}) without it"
                )
        reservation, (header_bytes, payload) = arrival.result()
        await deadline.run(reservation.wait_committed(), what)
        del inbound.chunks[chunk_index]
        return self._decoder.decode(header_bytes.tobytes()), payload

    async def wait_closed(self, request_id: str, *, deadline_s: float) -> bool:
        """Wait for the upstream to close `request_id`: True when it sent every chunk,
        False when it aborted. Raises PeerUnreachable when its connection broke first."""
        deadline = Deadline.after(deadline_s)
        inbound = await self._opened_request(request_id, deadline)
        await deadline.run(inbound.opened.wait_committed(), f"close of {request_id}")
        return self._complete(inbound)

    async def _opened_request(self, request_id: str, deadline: Deadline) -> _Inbound:
        inbound = self._requests.get(request_id)
        if inbound is not None:
            return inbound
        awaited = self._awaited.get(request_id)
        if awaited is None:
            awaited = self._awaited[request_id] = asyncio.get_running_loop().create_future()
        return await deadline.run(asyncio.shield(awaited), f"opening of {request_id}")

    @staticmethod
    def _complete(inbound: _Inbound) -> bool:
        return int(inbound.status[0]) == _STATUS_COMPLETE

    def forget(self, request_id: str) -> None:
        """Drop `request_id`: its reservations still open are cancelled."""
        awaited = self._awaited.pop(request_id, None)
        if awaited is not None:
            awaited.cancel()
        inbound = self._requests.pop(request_id, None)
        if inbound is None:
            return
        self.receiver.cancel(inbound.opened.request_id)
        for future in inbound.chunks.values():
            if future.done():
                self.receiver.cancel(future.result()[0].request_id)
            else:
                future.set_exception(TransferCancelled(f"{request_id} forgotten"))
                future.exception()  # nobody waits for it any more


@dataclass(frozen=True)
class ReservationTarget:
    """One remote reservation as a destination: `request_id` at `peer`, over `sender`.

    What a pipeline stage streams its layers' KV pages into (decode's reservation, in
    the KV protocol's layout), several stages each sending their own indices.
    """

    sender: KVSender
    peer: PeerAddress
    request_id: str

    async def send(self, items: Sequence[tuple[int, BufferLike]], *, deadline_s: float) -> None:
        """Send one segment of (index, buffer) items (see `KVSender.send`)."""
        await self.sender.send(self.peer, self.request_id, items, deadline_s=deadline_s)

    async def commit(self, *, deadline_s: float) -> None:
        """Commit the reservation: every sender's segments must have been verified."""
        await self.sender.commit(self.peer, self.request_id, deadline_s=deadline_s)
