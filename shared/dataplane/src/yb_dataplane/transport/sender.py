"""The sending side: one endpoint per peer, segments, commits, fetch requests.

`send()` checksums host buffers (xxh3-64, in place; device buffers are not hashed and
their segment says so), posts the segment header and every
buffer at once, and returns when the receiver has verified the segment (Ack) or raises
the receiver's refusal as a typed error. Sends to one peer may run concurrently (a
layer-wise streamer may keep several segments in flight): each buffer has its own UCX
tag, so their messages never mix.

A send that does not finish cleanly (deadline, cancellation, broken connection) closes
its connection: UCX may still be reading the caller's buffers, and closing the endpoint
is the only way to make it stop before `send()` returns and the caller reuses them.
The next call to that peer reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from yb_dataplane.transport import ucx_env
from yb_dataplane.transport.address import PeerAddress
from yb_dataplane.transport.buffers import (
    NO_CHECKSUM,
    XXH3_64,
    BufferLike,
    adjacent_key,
    checksum,
    is_device,
    joined,
    nbytes,
    to_ucx,
)
from yb_dataplane.transport.deadline import Deadline
from yb_dataplane.transport.errors import PeerUnreachable, error_for
from yb_dataplane.transport.handshake import Goodbyes, connect
from yb_dataplane.transport.link import Link, Posted
from yb_dataplane.transport.wire import (
    CTRL_TAG,
    MAX_SEGMENT_BUFFERS,
    REPLY_TAG,
    Ack,
    Bye,
    Commit,
    FetchRequest,
    FrameError,
    Nack,
    SegmentHeader,
    data_tag,
    encode_frame,
)

log = logging.getLogger(__name__)

#: Segments at least this large are checksummed off the event loop.
_HASH_OFFLOAD_BYTES: Final = 4 << 20
#: Largest span (adjacent buffers sent as one UCX message): big enough that per-message
#: costs vanish, small enough that the receiver verifies while later spans still move.
_SPAN_BYTES: Final = 8 << 20
#: Share of a fetch's deadline handed to the holder, so that its refusal still arrives
#: before the asker's own deadline passes.
_FETCH_DEADLINE_SHARE: Final = 0.9

#: `after_checksum` hook: (request_id, items) after checksums, before bytes move.
ChecksumHook = Callable[[str, Sequence[tuple[int, BufferLike]]], None]


def _poster(link: Link, frame: bytearray) -> Callable[[], Awaitable[list[Posted]]]:
    """A `post` for `_exchange` that sends one control frame."""

    async def post() -> list[Posted]:
        return [link.post_send(frame, CTRL_TAG)]

    return post


def _spans(
    targets: list[Any],
    sizes: list[int],
    indices: list[int],
    receiver_breaks: Collection[int] | None,
) -> tuple[list[int], list[Any]]:
    """Group buffers into DATA messages: (spans, message buffers).

    Consecutive items share a message when they lie back to back in memory here and,
    if the receiver told us its layout (`receiver_breaks`, see `buffers.breaks`), land
    back to back there too: consecutive reservation indices with no break between
    them. Then every message lands straight in its destination. With no
    `receiver_breaks`, only this side's adjacency counts and the receiver may have to
    stage a span. `spans` is empty when every message is a single buffer (the common
    header).
    """
    spans: list[int] = []
    messages: list[Any] = []
    run: list[Any] = []
    run_bytes = 0

    def flush() -> None:
        nonlocal run_bytes
        if run:
            view = joined(run) if len(run) > 1 else run[0]
            assert view is not None
            messages.append(view)
            spans.append(len(run))
            run.clear()
            run_bytes = 0

    previous: tuple[Hashable, int] | None = None  # (domain, end) of the previous buffer
    previous_index = -2
    for target, size, index in zip(targets, sizes, indices, strict=True):
        key = adjacent_key(target)
        apart_here = key is None or previous is None or (key[0], key[1]) != previous
        apart_there = receiver_breaks is not None and (
            index != previous_index + 1 or index in receiver_breaks
        )
        if run and (run_bytes + size > _SPAN_BYTES or apart_here or apart_there):
            flush()
        run.append(target)
        run_bytes += size
        previous = None if key is None else (key[0], key[1] + key[2])
        previous_index = index
    flush()
    if all(count == 1 for count in spans):
        spans = []
    return spans, messages


class _Peer:
    """A connection to one receiver: its link, sequence numbers, awaited replies."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._seqs = itertools.count()
        self.replies: dict[int, asyncio.Future[Ack | Nack]] = {}

    def expect(self) -> tuple[int, asyncio.Future[Ack | Nack]]:
        """A fresh sequence number and the future its reply will resolve."""
        seq = next(self._seqs)
        future: asyncio.Future[Ack | Nack] = asyncio.get_running_loop().create_future()
        self.replies[seq] = future
        return seq, future

    async def read_replies(self) -> None:
        """Resolve reply futures until the connection ends; then fail the rest."""
        why = "connection closed"
        try:
            while True:
                message = await self.link.recv_frame(REPLY_TAG)
                if isinstance(message, Bye):
                    why = f"the receiver dropped the connection ({message.reason})"
                    self.link.abort(notify=False)
                    break
                if not isinstance(message, Ack | Nack):
                    raise FrameError(f"{type(message).__name__} on the reply tag")
                future = self.replies.pop(message.seq, None)
                if future is not None and not future.done():
                    future.set_result(message)
        except (PeerUnreachable, FrameError) as exc:
            why = str(exc)
        except Exception as exc:
            log.exception("reply reader of %s failed", self.link.name)
            why = f"reply reader failed: {exc}"
        finally:
            # Also on cancellation (close): nobody may wait forever on this link.
            self.link.abort()
            for future in self.replies.values():
                if not future.done():
                    future.set_exception(PeerUnreachable(f"{self.link.name}: {why}"))
                    future.exception()  # the waiter may be gone already
            self.replies.clear()


class KVSender:
    """Sends KV buffers into reservations on remote `KVReceiver`s.

    Keeps one UCX endpoint per peer and reconnects after an error. A peer that does
    not answer the handshake is reported after `connect_timeout_s`. `preconnect`
    makes the connection ahead of the first transfer. `after_checksum`
    is a test hook, called after a segment's
    checksums are computed and before its bytes move (tests use it to corrupt the
    source and prove that the receiver notices).
    """

    def __init__(
        self, *, connect_timeout_s: float = 3.0, after_checksum: ChecksumHook | None = None
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._after_checksum = after_checksum
        self._peers: dict[PeerAddress, _Peer] = {}
        self._connecting: dict[PeerAddress, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._hasher: ThreadPoolExecutor | None = None
        self._closing: asyncio.Task[None] | None = None
        self._ucx: Any = None
        self._goodbyes = Goodbyes(CTRL_TAG)
        self._link_ids = itertools.count()
        #: Connections made so far (handshakes completed), pre-connects included.
        self.connects = 0

    # -- public API --------------------------------------------------------------------

    async def send(
        self,
        peer: PeerAddress,
        request_id: str,
        items: Sequence[tuple[int, BufferLike]],
        *,
        deadline_s: float,
        checksums: Sequence[int] | None = None,
        commit: bool = False,
        receiver_breaks: Collection[int] | None = None,
        note: bytes = b"",
    ) -> None:
        """Send one segment: each (index, buffer) into the reservation's buffer `index`.

        Bytes go from `buffer`'s memory straight into the receiver's reserved buffer (no
        serialization or staging copy). Returns once the receiver verified every buffer
        of the segment. Raises ReservationRefused / SizeMismatch / ChecksumMismatch when
        the receiver refuses, PeerUnreachable, or TransferTimeout after `deadline_s`.
        The buffers must not change until this returns.

        `checksums` (one xxh3-64 per item) may be given when the caller knows them
        already (a store that verified them when the bytes arrived); the receiver
        verifies them all the same. Otherwise they are computed here.

        Buffers that lie back to back in memory, in item order (consecutive pages of
        one layer of a KV cache), travel as one UCX message (a *span*) when they land
        back to back on the receiver too: `receiver_breaks` is the receiver's layout
        (`Reservation.breaks()`, sent back in its reservation reply or fetch request).
        Without it the receiver may have to stage a span (one extra copy there).

        `commit=True` also commits the request once this segment is verified, in the
        same round trip (then it must be the request's last send: every other send
        for it must have returned). Raises what `commit()` raises if the commit fails.
        `note` rides on the commit, as in `commit()`.
        """
        await self.send_segments(
            peer,
            request_id,
            [items],
            deadline_s=deadline_s,
            checksums=None if checksums is None else [checksums],
            commit=commit,
            receiver_breaks=receiver_breaks,
            note=note,
        )

    async def send_segments(
        self,
        peer: PeerAddress,
        request_id: str,
        segments: Sequence[Sequence[tuple[int, BufferLike]]],
        *,
        deadline_s: float,
        checksums: Sequence[Sequence[int]] | None = None,
        commit: bool = True,
        receiver_breaks: Collection[int] | None = None,
        note: bytes = b"",
    ) -> None:
        """Send several segments at once and (by default) commit, in one round trip.

        Like concurrent `send()`s followed by `commit()`, but every header and
        payload is posted in one go, in order, and the last header carries the commit
        (the receiver admits headers in order, so it judges the commit after every
        segment of the batch has landed): a whole transfer costs one round trip.
        `checksums`, if given, has one list per segment; `receiver_breaks` and `note`
        as in `send()`. Returns once every segment is
        verified (and the request committed); raises the first refusal otherwise.
        """
        if not segments:
            raise ValueError("nothing to send")
        if note and not commit:
            raise ValueError("a note rides on a commit only")
        if checksums is not None and len(checksums) != len(segments):
            raise ValueError(f"{len(checksums)} checksum lists for {len(segments)} segments")
        deadline = Deadline.after(deadline_s)
        self._check_open()
        breaks = None if receiver_breaks is None else frozenset(receiver_breaks)
        prepared: list[tuple[list[int], list[int], list[Any]]] = []
        for items in segments:
            if not items:
                raise ValueError("a segment needs at least one buffer")
            if len(items) > MAX_SEGMENT_BUFFERS:
                raise ValueError(f"a segment holds at most {MAX_SEGMENT_BUFFERS} buffers")
            prepared.append(
                (
                    [index for index, _ in items],
                    [nbytes(buffer) for _, buffer in items],
                    [to_ucx(buffer, writable=False) for _, buffer in items],
                )
            )
        given = None if checksums is None else [list(c) for c in checksums]
        if given is not None:
            for items, c in zip(segments, given, strict=True):
                if len(c) != len(items):
                    raise ValueError(f"{len(c)} checksums for {len(items)} buffers")
        connection = await self._connect(peer, deadline)
        link = connection.link
        expected = [connection.expect() for _ in segments]
        seqs = [seq for seq, _ in expected]

        async def post() -> list[Posted]:
            # Segment by segment, in order: hash (on a thread when large, so the
            # previous segment's bytes move meanwhile), then post the header and the
            # payloads together; the receiver posts its receives when the header lands
            # and each rendezvous completes as soon as it is matched.
            posted: list[Posted] = []
            for n, (seq, (indices, sizes, targets)) in enumerate(zip(seqs, prepared, strict=True)):
                # Hash the views already made for UCX (no second conversion per buffer).
                # Device memory is not hashed (see `buffers.checksum`): its segment
                # says so, and the receiver does not verify it.
                algorithm = XXH3_64
                if given is not None:
                    sums = given[n]
                elif any(is_device(target) for target in targets):
                    algorithm, sums = NO_CHECKSUM, [0] * len(targets)
                else:
                    sums = await self._checksums(targets, sum(sizes))
                if self._after_checksum is not None:
                    self._after_checksum(request_id, segments[n])
                spans, messages = _spans(targets, sizes, indices, breaks)
                last = n == len(segments) - 1
                header = SegmentHeader(
                    seq,
                    request_id,
                    indices,
                    sizes,
                    sums,
                    spans,
                    commit and last,
                    algorithm,
                    note if last else b"",
                )
                frame = encode_frame(header)  # ValueError: too many buffers for one header
                posted.append(link.post_send(frame, CTRL_TAG))
                posted += [link.post_send(m, data_tag(seq, pos)) for pos, m in enumerate(messages)]
            return posted

        what = f"segment {seqs[0]}" if len(seqs) == 1 else f"segments {seqs[0]}-{seqs[-1]}"
        what += f" of {request_id} to {peer.label}" + (" (with its commit)" if commit else "")
        answers = await self._exchange(
            connection, seqs, [reply for _, reply in expected], post, deadline, what
        )
        for answer in answers:
            self._raise_for(answer, what)

    async def commit(
        self, peer: PeerAddress, request_id: str, *, deadline_s: float, note: bytes = b""
    ) -> None:
        """Tell the receiver `request_id` is complete; raises if it refuses.

        Call it after every `send()` for the request has returned. The receiver refuses
        (ReservationRefused, ChecksumMismatch) if an index is missing or corrupt, or
        if it has no such reservation; either way the reservation is then over. `note`
        (small: it travels in the control frame) reaches the reservation's owner with
        the commit (`Reservation.note`).
        """
        deadline = Deadline.after(deadline_s)
        self._check_open()
        connection = await self._connect(peer, deadline)
        seq, reply = connection.expect()
        what = f"commit of {request_id} to {peer.label}"
        frame = encode_frame(Commit(seq, request_id, note))
        (answer,) = await self._exchange(
            connection, [seq], [reply], _poster(connection.link, frame), deadline, what
        )
        self._raise_for(answer, what)

    async def request_fetch(
        self,
        holder: PeerAddress,
        request_id: str,
        keys: Sequence[str],
        *,
        reply_to: PeerAddress,
        deadline_s: float,
        breaks: Sequence[int] | None = None,
    ) -> None:
        """Ask `holder` to send the blocks `keys` into reservation `request_id` at `reply_to`.

        The fetch path of the block store: reserve on your own receiver first, then call
        this with your receiver's address; the holder's fetch handler sends and commits
        with its own `KVSender`. Returns once the holder reports the commit done, so
        the reservation's `wait_committed()` has resolved by then; raises the holder's
        refusal (e.g. ReservationRefused for unknown keys), PeerUnreachable or
        TransferTimeout. `breaks` is the reservation's layout (`Reservation.breaks()`),
        which the holder needs to send every message straight into its destination.
        """
        deadline = Deadline.after(deadline_s)
        self._check_open()
        connection = await self._connect(holder, deadline)
        seq, reply = connection.expect()
        budget_ms = int(deadline.remaining() * _FETCH_DEADLINE_SHARE * 1000)
        message = FetchRequest(
            seq,
            request_id,
            list(keys),
            reply_to.to_wire(),
            budget_ms,
            None if breaks is None else list(breaks),
        )
        what = f"fetch of {request_id} from {holder.label}"
        frame = encode_frame(message)
        (answer,) = await self._exchange(
            connection, [seq], [reply], _poster(connection.link, frame), deadline, what
        )
        self._raise_for(answer, what)

    async def preconnect(self, peer: PeerAddress) -> bool:
        """Connect to `peer` now, so that the first transfer to it pays no handshake.

        Creating an endpoint and the hello round trip take about 0.2 s; a service
        calls this when a peer it may send to is announced. Never raises: a failure
        is logged and the first send to `peer` connects again (True if connected).
        """
        if self._closing is not None:
            return False
        try:
            await self._connect(peer, Deadline.after(self._connect_timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "pre-connect to %s failed (the first transfer connects again): %s",
                peer.label,
                exc,
            )
            return False
        return True

    def connected(self, peer: PeerAddress) -> bool:
        """Whether a live connection to `peer` is held now."""
        connection = self._peers.get(peer)
        return connection is not None and connection.link.alive

    async def close(self) -> None:
        """Close every connection and stop every task. Idempotent.

        Calls in flight fail with PeerUnreachable.
        """
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        peers = list(self._peers.values())
        self._peers.clear()
        for connection in peers:
            connection.link.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(connection.link.close() for connection in peers))
        await self._goodbyes.close()
        if self._hasher is not None:
            # At most one segment's checksums (milliseconds) can still be running.
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self._hasher = None
        if self._ucx is not None:
            self._ucx = None
            ucx_env.release()

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing is not None:
            raise PeerUnreachable("KVSender is closed")

    async def _checksums(self, buffers: list[BufferLike], total: int) -> list[int]:
        if total < _HASH_OFFLOAD_BYTES:
            return [checksum(buffer) for buffer in buffers]
        # xxhash releases the GIL: hashing a big segment on a thread keeps the event
        # loop serving other segments' completions meanwhile.
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="yb-xxh3")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._hasher, lambda: [checksum(buffer) for buffer in buffers]
        )

    async def _connect(self, peer: PeerAddress, deadline: Deadline) -> _Peer:
        connection = self._peers.get(peer)
        if connection is not None and connection.link.alive:
            return connection
        lock = self._connecting.setdefault(peer, asyncio.Lock())
        async with lock:
            connection = self._peers.get(peer)
            if connection is not None and connection.link.alive:
                return connection
            if connection is not None:
                self._drop(connection)
            if self._ucx is None:
                self._ucx = ucx_env.acquire()  # held until close()
            timeout = max(0.05, min(self._connect_timeout_s, deadline.remaining()))
            link = await deadline.run(
                connect(
                    self._ucx,
                    peer,
                    name=f"tx{next(self._link_ids)}:{peer.label}",
                    timeout_s=timeout,
                    on_abort=self._goodbyes.on_abort,
                ),
                f"connect to {peer.label}",
            )
            if self._closing is not None:
                link.abort()
                raise PeerUnreachable("KVSender is closed")
            connection = _Peer(link)
            self._peers[peer] = connection
            self.connects += 1
            reader = asyncio.get_running_loop().create_task(
                connection.read_replies(), name=f"replies:{link.name}"
            )
            self._tasks.add(reader)
            reader.add_done_callback(self._tasks.discard)
            return connection

    def _drop(self, connection: _Peer) -> None:
        """Close a connection (posted sends included) and forget it."""
        connection.link.abort()
        # Reap the link's leftover tasks in the background; close() awaits the reaper.
        reaper = asyncio.get_running_loop().create_task(connection.link.close())
        self._tasks.add(reaper)
        reaper.add_done_callback(self._tasks.discard)
        for peer, known in list(self._peers.items()):
            if known is connection:
                del self._peers[peer]

    async def _exchange(
        self,
        connection: _Peer,
        seqs: list[int],
        replies: list[asyncio.Future[Ack | Nack]],
        post: Callable[[], Awaitable[list[Posted]]],
        deadline: Deadline,
        what: str,
    ) -> list[Ack | Nack]:
        """Post the sends, wait for them, then the replies; close the link on any failure."""
        try:
            await deadline.run(self._post_and_wait(post), what)
            return [await deadline.run(reply, what) for reply in replies]
        except asyncio.CancelledError:
            self._drop(connection)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller cancelled us
            raise PeerUnreachable(f"{what}: connection closed") from None
        except Exception:  # a refusal, a broken link, or a header too large to post
            self._drop(connection)
            raise
        finally:
            for seq in seqs:
                connection.replies.pop(seq, None)

    @staticmethod
    async def _post_and_wait(post: Callable[[], Awaitable[list[Posted]]]) -> None:
        for send in await post():  # all posted already: waiting in order costs nothing
            await send.wait()

    @staticmethod
    def _raise_for(answer: Ack | Nack, what: str) -> None:
        if isinstance(answer, Nack):
            raise error_for(
                answer.reason, f"{what} refused: {answer.message}", tuple(answer.indices)
            )
