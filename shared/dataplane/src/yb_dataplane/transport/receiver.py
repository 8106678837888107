"""The receiving side: reservations, connections offered by hello, verification, commit.

A receiver does not listen on a socket. It announces its UCX worker address and a
hello tag (`PeerAddress`); a sender's `Hello` arrives in the worker's tag matching,
and the receiver connects back to the worker address the hello carries (`wire`).
What can reach it is what UCX's transports expose on the interface the receiver was
bound to (`ucx_env.Binding`, from the service's `ucx_host`).

A receiver accepts bytes only into memory it reserved for a request, only into indices
of that reservation that are not written yet, and only of exactly the reserved size.
Everything else is refused with a `Nack` naming the reason; the refused payloads are
drained into a scratch sink (past `DRAIN_LIMIT` bytes the connection is closed
instead), so the sender's stream stays in step and no UCX message is left unmatched.

Accepted bytes land directly in the reserved buffers (the receive is posted into them
as soon as the segment header is validated), device buffers included: adjacent device
destinations take a span as one `DeviceRegion`, so nothing is staged when the sender
knows this side's layout. Each host buffer's xxh3-64 is checked against the header
when it lands (device memory is not hashed: see `buffers.checksum`): a mismatch
refuses that buffer (it is never counted as received, and a commit that misses it
fails). `wait_committed()` resolves only when the sender commits and every index has
been written and verified. A commit may carry a note for the reservation's owner
(`Reservation.note`, set before `wait_committed()` returns): a message that would
otherwise follow the commit on another channel, one round trip later.

Failure is bounded in time: each reservation has a deadline, and a sender connection
that breaks (process killed, closed) fails every uncommitted reservation it was
feeding. When a reservation ends while receives are still posted into it (deadline,
cancel, close), the connection they were posted on is closed: that is the only way to
make UCX let go of the buffers, and the caller may reuse them as soon as `cancel()`
returns. Other requests streaming over that same connection then fail too, and their
sender reconnects on its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from yb_core.netaddr import is_wildcard
from yb_dataplane.transport import ucx_env
from yb_dataplane.transport.address import PeerAddress
from yb_dataplane.transport.buffers import (
    NO_CHECKSUM,
    XXH3_64,
    BufferLike,
    breaks,
    checksum,
    copy_into,
    is_device,
    joined,
    nbytes,
    to_ucx,
)
from yb_dataplane.transport.deadline import Deadline
from yb_dataplane.transport.errors import (
    ChecksumMismatch,
    PeerUnreachable,
    Reason,
    ReservationRefused,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    error_for,
)
from yb_dataplane.transport.handshake import Goodbyes, frame_array, new_tag_base
from yb_dataplane.transport.link import Link, MessageTruncated, Posted, full_tag
from yb_dataplane.transport.ucx_env import UCXError, UCXTruncated, forget_traceback
from yb_dataplane.transport.wire import (
    CTRL_TAG,
    DRAIN_LIMIT,
    MAX_HELLO,
    MAX_SEGMENT_BUFFERS,
    PROTOCOL_VERSION,
    REPLY_TAG,
    Ack,
    Bye,
    Commit,
    FetchRequest,
    FrameError,
    Hello,
    Message,
    Nack,
    SegmentHeader,
    Welcome,
    data_tag,
    decode_frame,
    encode_frame,
)

log = logging.getLogger(__name__)

#: How long a reply or a drain may take before the connection is declared stuck.
_REPLY_TIMEOUT_S: Final = 10.0
_DRAIN_TIMEOUT_S: Final = 30.0
#: How many ended request ids are remembered, to explain late segments for them.
_TOMBSTONES: Final = 4096

#: How long making an endpoint may take (to this worker, or back to a hello's sender).
_CONNECT_TIMEOUT_S: Final = 5.0

#: How long a hello may wait for `set_peer_check`'s verdict.
_PEER_CHECK_TIMEOUT_S: Final = 2.0

#: `set_peer_check`'s callable: is this worker address one the cluster announced?
PeerCheck = Callable[[bytes], Awaitable[bool]]

#: `set_reservation_factory`'s callable: buffers for an unknown request, or None.
ReservationFactory = Callable[[str, SegmentHeader], Sequence[BufferLike] | None]


@dataclass(frozen=True, slots=True)
class FetchOrder:
    """A remote's request that this process send blocks `keys` into its reservation.

    The handler looks the keys up, sends the blocks with its `KVSender` to `reply_to`
    under `request_id` (indices in the order of `keys`, or as agreed by the caller),
    commits, and returns; raising a `TransferError` refuses the fetch with its reason.
    """

    request_id: str
    keys: tuple[str, ...]
    reply_to: PeerAddress
    deadline: Deadline
    #: The asker's layout (None from an asker that did not send it): pass it to
    #: `KVSender.send(receiver_breaks=...)`.
    breaks: frozenset[int] | None = None

    def remaining_s(self) -> float:
        """Seconds left before the asker gives up; use it as the sends' `deadline_s`."""
        return self.deadline.remaining()


#: `set_fetch_handler`'s callable.
FetchHandler = Callable[[FetchOrder], Awaitable[None]]


class Reservation:
    """Destination buffers reserved for one request, and the state of their filling.

    Created by `KVReceiver.reserve` (or by a reservation factory). `received` holds the
    indices written and verified so far; `wait_committed()` is the one thing to await.
    """

    def __init__(
        self,
        request_id: str,
        buffers: Sequence[BufferLike],
        deadline_s: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.request_id = request_id
        self._sources: list[BufferLike] = list(buffers)
        # Validated up front: a buffer UCX cannot write into fails `reserve`, not a
        # transfer half-way through.
        self._targets: list[Any] = [to_ucx(b, writable=True) for b in self._sources]
        self.sizes: tuple[int, ...] = tuple(nbytes(b) for b in self._sources)
        #: Indices written and verified so far.
        self.received: set[int] = set()
        #: The xxh3-64 of each received index: verified on a host buffer, as announced
        #: on a device buffer (0 there when the sender's was device memory too; 0
        #: until the index is received).
        self.checksums: list[int] = [0] * len(self._sources)
        self.deadline_s = deadline_s
        self._pending: set[int] = set()
        self._corrupt: set[int] = set()
        self._segments: set[asyncio.Future[None]] = set()
        # Links with receives currently posted into these buffers, with their count.
        self._posted: dict[Link, int] = {}
        self._done: asyncio.Future[None] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        #: What the sender attached to its commit (b"" when nothing): set once committed.
        self.note = b""
        #: Called (on the event loop) with each index as it is written and verified,
        #: before the commit: an owner that uses buffers as they land (a prefix whose
        #: layers are computed on as they arrive) learns of each here.
        self.on_received: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def done(self) -> bool:
        """True once committed or failed."""
        return self._done.done()

    @property
    def nbytes(self) -> int:
        """Total reserved bytes."""
        return sum(self.sizes)

    def breaks(self) -> list[int]:
        """This reservation's layout for its sender (see `buffers.breaks`): the indices
        whose buffer does not follow the previous one in memory. A sender that knows
        them sends nothing this side has to stage."""
        return breaks(self._targets)

    async def wait_committed(self) -> None:
        """Return once the sender committed and every buffer was written and verified.

        Raises TransferTimeout at the deadline, PeerUnreachable if the sender's
        connection broke first, ChecksumMismatch or ReservationRefused if the commit was
        refused, TransferCancelled after `cancel()` or `close()`. Bounded by the
        reservation's deadline; cancelling this call does not cancel the reservation.
        """
        if not self._done.done():
            # `wait` neither raises the stored error nor cancels the future when this
            # call is cancelled.
            await asyncio.wait([self._done])
        error = self._error()
        if error is not None:
            # A copy per waiter: raising the stored object would pile every waiter's
            # frames onto its traceback for as long as the reservation lives.
            raise copy.copy(error)

    def _finish(self, error: TransferError | None) -> bool:
        """Resolve once; True if this call did."""
        if self._done.done():
            return False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if error is None:
            self._done.set_result(None)
        else:
            self._done.set_exception(error)
            # Nobody may be waiting (the owner cancelled it): do not log it as lost.
            self._done.exception()
        return True

    def _error(self) -> TransferError | None:
        if not self._done.done():
            return None
        exc = self._done.exception()
        return exc if isinstance(exc, TransferError) else None


class KVReceiver:
    """Lands KV bytes in reserved buffers, from any `KVSender` that says hello.

    `start()` binds UCX to `host`'s interface (and `port`, if not 0, for its TCP
    transport; see `ucx_env.Binding`) and returns the address to announce. It only
    connects out to answer a hello, to the address that hello names.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._inbox: Any = None
        self._accepting: asyncio.Task[None] | None = None
        self._goodbyes = Goodbyes(REPLY_TAG)
        self._peer_check: PeerCheck | None = None
        self._address: PeerAddress | None = None
        self._reservations: dict[str, Reservation] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._links: set[Link] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._link_ids = itertools.count()
        self._factory: ReservationFactory | None = None
        self._factory_deadline_s = 30.0
        self._on_reserved: Callable[[Reservation], None] | None = None
        self._fetch_handler: FetchHandler | None = None
        self._scratch = np.empty(0, dtype=np.uint8)
        self._staging = _StagingPool()
        #: Bytes that landed in a staging buffer and were copied out: zero as long as
        #: every sender knows this side's layout (`Reservation.breaks()`).
        self.staged_bytes = 0
        self._m_staged: Counter | None = None
        self._closing: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._acquired = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> PeerAddress:
        """Start taking connections; returns the address senders should use. Idempotent.

        Raises ValueError when `host` is not an address of this machine.
        """
        if self._closing is not None:
            raise RuntimeError("KVReceiver is closed")
        if self._address is not None:
            return self._address
        binding = ucx_env.Binding.for_host(self._host, self._port)
        ucx = ucx_env.acquire(binding)
        self._loop = asyncio.get_running_loop()
        try:
            worker = ucx_env.worker_address()
            # Hellos match in the worker, from any endpoint; posting their receive
            # through an endpoint to ourselves is what lets `close()` take it back.
            self._inbox = await ucx_env.create_endpoint(worker, timeout_s=_CONNECT_TIMEOUT_S)
        except BaseException:
            ucx_env.release()
            raise
        self._acquired = True
        host = self._host
        if is_wildcard(host):
            host = ucx.get_address()
        self._address = PeerAddress(host, new_tag_base(), worker)
        self._accepting = self._loop.create_task(self._accept(), name="kv-accept")
        return self._address

    @property
    def address(self) -> PeerAddress:
        """The announced address (after `start()`)."""
        if self._address is None:
            raise RuntimeError("KVReceiver.start() first")
        return self._address

    async def close(self) -> None:
        """Stop listening, fail every open reservation, close every connection.

        Idempotent, and safe to call concurrently: later calls wait for the first.
        """
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        # 1. Stop taking connections.
        inbox, self._inbox = self._inbox, None
        if inbox is not None:
            ucx_env.abort_endpoint(inbox, "hello inbox")  # takes back the hello receive
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        # 2. Fail what is open (this also closes links with receives posted into them).
        for res in list(self._reservations.values()):
            self._fail(res, TransferCancelled(f"receiver closed; {res.request_id} dropped"))
        # 3. Close every connection, then wait for every task to finish.
        for link in list(self._links):
            link.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in list(self._links)))
        self._links.clear()
        await self._goodbyes.close()
        if self._acquired:
            self._acquired = False
            ucx_env.release()

    # -- reservations ----------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Senders connected now."""
        return len(self._links)

    def export_metrics(self, registry: CollectorRegistry) -> None:
        """Count staged bytes on `registry` as `yb_kv_staged_bytes_total` (zero when
        every sender knows this side's layout: the data plane's zero-copy check)."""
        self._m_staged = Counter(
            "yb_kv_staged_bytes",
            "Received KV bytes that went through a staging buffer (one extra copy)",
            registry=registry,
        )
        self._m_staged.inc(self.staged_bytes)

    def reserve(
        self, request_id: str, buffers: Sequence[BufferLike], *, deadline_s: float
    ) -> Reservation:
        """Reserve `buffers` (index = position in the list) for `request_id`.

        Bytes for the request are accepted from now until the commit or `deadline_s`
        seconds from now, whichever comes first. Buffers must be writable and
        C-contiguous (ValueError otherwise). Reserving an id that is open is an error.
        Like every method here, call it on the event loop's thread.
        """
        if self._address is None or self._closing is not None:
            raise RuntimeError("KVReceiver is not running (start() it, or it closed)")
        if request_id in self._reservations:
            raise ValueError(f"request {request_id!r} already has a reservation")
        if not buffers:
            raise ValueError("a reservation needs at least one buffer")
        return self._open(request_id, buffers, deadline_s)

    def _open(
        self, request_id: str, buffers: Sequence[BufferLike], deadline_s: float
    ) -> Reservation:
        assert self._loop is not None
        res = Reservation(request_id, buffers, deadline_s, self._loop)
        res._timer = self._loop.call_later(max(0.0, deadline_s), self._expire, res)
        self._reservations[request_id] = res
        self._tombstones.pop(request_id, None)
        return res

    def reservation(self, request_id: str) -> Reservation | None:
        """The open reservation for `request_id`, if any."""
        return self._reservations.get(request_id)

    def cancel(self, request_id: str) -> None:
        """Free the reservation of `request_id` (no-op if none is open).

        Its `wait_committed()` raises TransferCancelled. If receives are posted into
        its buffers, their connection is closed before this returns, so UCX no longer
        writes into them.
        """
        res = self._reservations.get(request_id)
        if res is not None:
            self._fail(res, TransferCancelled(f"reservation {request_id} cancelled"))

    def set_reservation_factory(
        self,
        factory: ReservationFactory | None,
        *,
        deadline_s: float = 30.0,
        on_reserved: Callable[[Reservation], None] | None = None,
    ) -> None:
        """Let segments for unknown requests create their reservation on arrival.

        For a store: when the first segment of an unreserved `request_id` arrives,
        `factory(request_id, header)` may return the destination buffers (the header
        says which indices and sizes are coming), or None to refuse (the sender sees
        `unknown_request`), or raise a `TransferError` to refuse with its reason and
        message (e.g. `duplicate` for a block held already). The reservation
        then behaves like a reserved one, with a deadline of `deadline_s`;
        `on_reserved(reservation)` is called synchronously right after, so the owner
        can watch `wait_committed()` (to index the block, or free the slots).
        """
        self._factory = factory
        self._factory_deadline_s = deadline_s
        self._on_reserved = on_reserved

    def set_peer_check(self, check: PeerCheck | None) -> None:
        """Answer only hellos whose sender's worker address `check` vouches for.

        A hello names the address to connect back to, and UCX unpacks a worker
        address with assertions, not errors: a forged one would abort this process.
        So a service passes its directory of announced instances (who announced
        through the authenticated bus), and a hello from anyone else goes unanswered
        (the sender sees its connect time out). Without a check every hello is
        answered: for tests and tools whose peers are their own.
        """
        self._peer_check = check

    def set_fetch_handler(self, handler: FetchHandler | None) -> None:
        """Serve `KVSender.request_fetch`: see `FetchOrder`. None refuses fetches."""
        self._fetch_handler = handler

    def _expire(self, res: Reservation) -> None:
        self._fail(
            res,
            TransferTimeout(f"reservation {res.request_id} not committed in {res.deadline_s}s"),
        )

    def _end(self, res: Reservation, why: str) -> None:
        if self._reservations.get(res.request_id) is res:
            del self._reservations[res.request_id]
        self._tombstones[res.request_id] = why
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _fail(self, res: Reservation, error: TransferError) -> None:
        if not res._finish(error):
            return
        self._end(res, f"{error.reason.value}: {error}")
        # Receives still posted into the buffers: only closing their connection makes
        # UCX let go before the owner reuses the memory.
        for link, count in list(res._posted.items()):
            if count > 0:
                log.info("closing %s: it has receives posted into %s", link.name, res.request_id)
                link.abort()

    def _commit(self, res: Reservation) -> None:
        if res._finish(None):
            self._end(res, "committed")

    # -- connections -------------------------------------------------------------------

    async def _accept(self) -> None:
        """Take hellos until closed; each one is answered on its own task."""
        hello = np.zeros(MAX_HELLO, dtype=np.uint8)
        assert self._address is not None
        tag = self._address.hello_tag
        while self._closing is None and self._inbox is not None:
            hello[:4] = 0
            try:
                await self._inbox.recv(hello, tag=tag, force_tag=True)
            except UCXTruncated as exc:
                forget_traceback(exc)
                log.warning("refused a hello larger than %d bytes", MAX_HELLO)
                continue
            except UCXError as exc:
                forget_traceback(exc)
                if self._closing is None:
                    log.error("the hello receive failed; no new connections: %s", exc)
                return
            try:
                message = decode_frame(hello.data)
            except FrameError as exc:
                log.warning("refused an unreadable hello: %s", exc)
                continue
            if not isinstance(message, Hello):
                log.warning("refused a %s sent as a hello", type(message).__name__)
                continue
            log.debug("hello from %r", message.name)
            task = asyncio.get_running_loop().create_task(
                self._welcome(message), name=f"welcome:{message.name}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _welcome(self, hello: Hello) -> None:
        """Connect back to a hello's sender and answer it; then serve the connection."""
        assert self._loop is not None
        if self._peer_check is not None:
            try:
                vouched = await asyncio.wait_for(
                    self._peer_check(hello.worker), _PEER_CHECK_TIMEOUT_S
                )
            except TimeoutError:
                vouched = False
            if not vouched:
                log.warning(
                    "ignored a hello from %r: its worker address is not one that an "
                    "announced instance of the cluster has",
                    hello.name,
                )
                return
        try:
            # Off the loop's thread and bounded: the sender's host may be reachable one
            # way only (its hello got here, nothing gets back).
            endpoint = await ucx_env.create_endpoint(hello.worker, timeout_s=_CONNECT_TIMEOUT_S)
        except TimeoutError:
            log.warning("cannot connect back to %r within %gs", hello.name, _CONNECT_TIMEOUT_S)
            return
        except (UCXError, RuntimeError, ValueError) as exc:
            forget_traceback(exc)
            log.warning("cannot connect back to %r: %s", hello.name, exc)
            return
        log.debug("connected back to %r", hello.name)
        if hello.version != PROTOCOL_VERSION or not hello.recv_base:
            why = f"protocol version {hello.version}; this receiver speaks {PROTOCOL_VERSION}"
            log.warning("refused a hello from %r: %s", hello.name, why)
            with contextlib.suppress(UCXError, TimeoutError):
                async with asyncio.timeout(_REPLY_TIMEOUT_S):
                    await endpoint.send(
                        frame_array(encode_frame(Welcome(0, why))),
                        tag=full_tag(hello.recv_base, REPLY_TAG),
                        force_tag=True,
                    )
            ucx_env.abort_endpoint(endpoint, f"refused hello from {hello.name}")
            return
        if self._closing is not None:
            ucx_env.abort_endpoint(endpoint, f"hello from {hello.name}")
            return
        link = Link(
            endpoint,
            f"rx{next(self._link_ids)}:{hello.name}",
            recv_base=new_tag_base(),
            send_base=hello.recv_base,
            peer_worker=hello.worker,
            on_abort=self._goodbyes.on_abort,
        )
        self._links.add(link)
        # Serving first posts the receive for the first control frame before the
        # sender, told it may start, sends one.
        serving = self._loop.create_task(self._serve(link), name=link.name)
        self._tasks.add(serving)
        serving.add_done_callback(self._tasks.discard)
        await self._reply(link, Welcome(link.recv_base))

    async def _serve(self, link: Link) -> None:
        """Read control frames from one sender until its connection ends."""
        request_ids: set[str] = set()
        try:
            while True:
                message = await link.recv_frame(CTRL_TAG)
                match message:
                    case SegmentHeader():
                        if self._on_segment(link, message):
                            # Only admitted segments tie a reservation to this link:
                            # refused junk must not fail someone else's transfer.
                            request_ids.add(message.request_id)
                    case Commit():
                        link.spawn(self._on_commit(link, message), f"commit{message.seq}")
                    case FetchRequest():
                        link.spawn(self._on_fetch(link, message), f"fetch{message.seq}")
                    case Bye():
                        log.info("%s: the sender dropped it (%s)", link.name, message.reason)
                        link.abort(notify=False)
                        break
                    case _:
                        raise FrameError(f"{type(message).__name__} on the control tag")
        except PeerUnreachable:
            pass  # the sender closed or died: the normal end of a connection
        except FrameError as exc:
            log.warning("closing %s: protocol violation: %s", link.name, exc)
        except Exception:
            log.exception("closing %s: unexpected failure", link.name)
        finally:
            link.abort()
            self._links.discard(link)
            for request_id in request_ids:
                res = self._reservations.get(request_id)
                if res is not None and not res.done:
                    self._fail(
                        res,
                        PeerUnreachable(f"sender connection lost before committing {request_id}"),
                    )
            await link.close()

    async def _reply(self, link: Link, message: Message) -> None:
        try:
            await Deadline.after(_REPLY_TIMEOUT_S).run(link.send_frame(message, REPLY_TAG), "reply")
        except TransferError as exc:
            log.info("closing %s: reply failed: %s", link.name, exc)
            link.abort()

    # -- segments ----------------------------------------------------------------------

    def _on_segment(self, link: Link, header: SegmentHeader) -> bool:
        """Admit (True) or refuse a segment.

        Synchronous and in header order, so admission decisions never race each other.
        """
        try:
            res = self._admit(header)
        except TransferError as exc:
            link.spawn(self._refuse(link, header, exc), f"refuse{header.seq}")
            return False
        assert self._loop is not None
        settled: asyncio.Future[None] = self._loop.create_future()
        res._segments.add(settled)
        res._posted[link] = res._posted.get(link, 0) + 1
        link.spawn(self._receive(link, res, header, settled), f"seg{header.seq}")
        return True

    def _admit(self, header: SegmentHeader) -> Reservation:
        """The reservation this segment may write into; raises a refusal otherwise."""
        rid = header.request_id
        count = len(header.indices)
        if not 0 < count <= MAX_SEGMENT_BUFFERS or not (
            len(header.sizes) == len(header.checksums) == count
        ):
            raise error_for(Reason.MALFORMED, f"segment {header.seq} of {rid}: bad lengths")
        if min(header.sizes) < 0:
            raise error_for(Reason.MALFORMED, f"segment {header.seq} of {rid}: negative size")
        if not _spans_valid(header):
            raise error_for(Reason.MALFORMED, f"segment {header.seq} of {rid}: bad spans")
        if header.checksum not in (XXH3_64, NO_CHECKSUM):
            raise error_for(
                Reason.MALFORMED,
                f"segment {header.seq} of {rid}: unknown checksum {header.checksum!r}",
            )
        res = self._reservations.get(rid)
        if res is None and self._factory is not None:
            res = self._from_factory(header)
        if res is None:
            why = self._tombstones.get(rid, "never reserved")
            raise error_for(Reason.UNKNOWN_REQUEST, f"no reservation for {rid} ({why})")
        seen: set[int] = set()
        for index, size in zip(header.indices, header.sizes, strict=True):
            if not 0 <= index < len(res):
                raise error_for(
                    Reason.BAD_INDEX,
                    f"{rid}: index {index} outside the reservation of {len(res)} buffers",
                    (index,),
                )
            if index in seen or index in res.received or index in res._pending:
                raise error_for(
                    Reason.DUPLICATE,
                    f"{rid}: index {index} already written or in flight",
                    (index,),
                )
            if size != res.sizes[index]:
                raise error_for(
                    Reason.SIZE_MISMATCH,
                    f"{rid}: index {index} is {size} bytes, reserved {res.sizes[index]}",
                    (index,),
                )
            seen.add(index)
        res._pending |= seen
        return res

    def _from_factory(self, header: SegmentHeader) -> Reservation | None:
        assert self._factory is not None
        try:
            buffers = self._factory(header.request_id, header)
        except TransferError:
            raise  # the factory's own refusal: its reason and message reach the sender
        except Exception:
            log.exception("reservation factory failed for %s", header.request_id)
            return None
        if not buffers:
            return None
        res = self._open(header.request_id, buffers, self._factory_deadline_s)
        if self._on_reserved is not None:
            self._on_reserved(res)
        return res

    async def _receive(
        self,
        link: Link,
        res: Reservation,
        header: SegmentHeader,
        settled: asyncio.Future[None],
    ) -> None:
        """Land one admitted segment in its reserved buffers, verify, reply."""
        seq = header.seq
        corrupt: list[int] = []
        oversized: list[int] = []
        broken: BaseException | None = None
        try:
            # Post every receive now, straight into the reserved buffers: each rendezvous
            # moves its bytes as soon as UCX matches it. A span (adjacent buffers on the
            # sender's side) lands in one message: straight into its destinations if
            # they are adjacent here too (always, when the sender knew this side's
            # layout), else into a staging buffer, copied out below.
            receives: list[tuple[int, int, np.ndarray | None, Posted]] = []
            first = 0
            for message, count in enumerate(header.message_spans()):
                targets = [res._targets[i] for i in header.indices[first : first + count]]
                dest = joined(targets)
                staged = None
                if dest is None:
                    staged = self._staging.take(sum(header.sizes[first : first + count]))
                    dest = staged
                    self.staged_bytes += staged.nbytes
                    if self._m_staged is not None:
                        self._m_staged.inc(staged.nbytes)
                try:
                    posted = link.post_recv(dest, data_tag(seq, message))
                except PeerUnreachable as exc:
                    broken = exc  # the sender died before this segment's payloads
                    break
                receives.append((first, count, staged, posted))
                first += count
            for first, count, staged, receive in receives if broken is None else ():
                positions = range(first, first + count)
                try:
                    await receive.wait()
                except MessageTruncated:
                    # Larger than announced; consumed, not kept.
                    oversized += [header.indices[p] for p in positions]
                    continue
                except PeerUnreachable as exc:
                    broken = exc
                    break
                offset = 0
                for pos in positions:
                    index = header.indices[pos]
                    size = header.sizes[pos]
                    if res.done:
                        break  # cancelled meanwhile: its buffers are the owner's again
                    if staged is not None:
                        try:
                            copy_into(res._targets[index], staged[offset : offset + size])
                        except TypeError:
                            corrupt.append(index)
                            continue
                        finally:
                            offset += size
                    # Verify as each buffer lands, while later ones are still moving.
                    verified = _verified(res._targets[index], header, pos)
                    if verified is None:
                        corrupt.append(index)
                    else:
                        res.received.add(index)
                        res.checksums[index] = verified
                        if res.on_received is not None:
                            res.on_received(index)
                if staged is not None:
                    self._staging.give(staged)
        finally:
            res._pending.difference_update(header.indices)
            res._posted[link] -= 1
            if not res.done:
                res._corrupt.update(corrupt)
            settled.set_result(None)
            res._segments.discard(settled)
        if broken is not None:
            # The connection broke under this segment; `_serve` fails the reservation.
            link.abort()
            return
        error = res._error()
        if error is not None:
            reply: Message = Nack(seq, error.reason, str(error), list(header.indices))
        elif oversized:
            reply = Nack(
                seq,
                Reason.SIZE_MISMATCH,
                f"{res.request_id}: payload larger than announced",
                oversized,
            )
        elif corrupt:
            reply = Nack(
                seq,
                Reason.CHECKSUM,
                f"{res.request_id}: checksum mismatch on {len(corrupt)} buffer(s)",
                corrupt,
            )
        elif header.commit:
            reply = await self._commit_reply(res, seq, header.note)
        else:
            reply = Ack(seq)
        await self._reply(link, reply)

    def _scratch_for(self, size: int) -> np.ndarray:
        if self._scratch.nbytes < size:
            self._scratch = np.empty(size, dtype=np.uint8)
        return self._scratch

    async def _refuse(self, link: Link, header: SegmentHeader, error: TransferError) -> None:
        """Drain a refused segment's payloads into scratch, then nack it.

        Concurrent drains share one scratch buffer: its content is garbage either way.
        """
        malformed = (
            len(header.sizes) != len(header.indices)
            or any(s < 0 for s in header.sizes)
            or not _spans_valid(header)
        )
        sizes: list[int] = []
        if not malformed:
            first = 0
            for count in header.message_spans():
                sizes.append(sum(header.sizes[first : first + count]))
                first += count
        log.info("refusing segment %d of %s: %s", header.seq, header.request_id, error)
        if malformed or sum(sizes) > DRAIN_LIMIT:
            await self._reply(link, Nack(header.seq, error.reason, str(error), list(error.indices)))
            log.warning("closing %s: refused segment too large or malformed to drain", link.name)
            link.abort()
            return
        scratch = self._scratch_for(max(sizes, default=0))
        try:
            drains = [
                link.post_recv(scratch[:size], data_tag(header.seq, pos))
                for pos, size in enumerate(sizes)
            ]
            await Deadline.after(_DRAIN_TIMEOUT_S).run(self._drain(drains), "drain")
        except TransferError:
            link.abort()  # broken, or a sender that never sent what it announced
            return
        await self._reply(link, Nack(header.seq, error.reason, str(error), list(error.indices)))

    @staticmethod
    async def _drain(drains: list[Posted]) -> None:
        for drain in drains:
            with contextlib.suppress(MessageTruncated):  # longer than announced: consumed
                await drain.wait()

    # -- commit and fetch ----------------------------------------------------------------

    async def _on_commit(self, link: Link, commit: Commit) -> None:
        rid = commit.request_id
        res = self._reservations.get(rid)
        if res is None:
            why = self._tombstones.get(rid, "never reserved")
            await self._reply(
                link, Nack(commit.seq, Reason.UNKNOWN_REQUEST, f"no reservation for {rid} ({why})")
            )
            return
        await self._reply(link, await self._commit_reply(res, commit.seq, commit.note))

    async def _commit_reply(self, res: Reservation, seq: int, note: bytes) -> Message:
        """Commit `res` (with the sender's `note`) if every buffer arrived verified; the
        reply to send either way."""
        rid = res.request_id
        if res._segments:
            # Segments still landing (a sender may commit right after its last send
            # returned on its side): judge once they settle. Bounded by the
            # reservation's deadline, which closes their connection when it passes.
            await asyncio.wait(list(res._segments))
        error = res._error()
        if error is None:
            missing = [i for i in range(len(res)) if i not in res.received]
            if not missing:
                res.note = note
                self._commit(res)
                return Ack(seq)
            corrupt = sorted(res._corrupt.intersection(missing))
            if corrupt:
                error = ChecksumMismatch(
                    f"{rid}: {len(corrupt)} buffer(s) failed their checksum", indices=tuple(corrupt)
                )
            else:
                error = ReservationRefused(
                    f"{rid}: commit with {len(missing)} of {len(res)} buffers missing "
                    f"(first: {missing[:8]})",
                    reason=Reason.INCOMPLETE,
                    indices=tuple(missing[:64]),
                )
            self._fail(res, error)
        return Nack(seq, error.reason, str(error), list(error.indices))

    async def _on_fetch(self, link: Link, request: FetchRequest) -> None:
        handler = self._fetch_handler
        if handler is None:
            await self._reply(
                link, Nack(request.seq, Reason.FETCH_FAILED, "this process serves no fetches")
            )
            return
        try:
            reply_to = PeerAddress.parse(request.reply_to)
        except ValueError as exc:
            await self._reply(link, Nack(request.seq, Reason.MALFORMED, str(exc)))
            return
        order = FetchOrder(
            request.request_id,
            tuple(request.keys),
            reply_to,
            Deadline.after(request.deadline_ms / 1000),
            None if request.breaks is None else frozenset(request.breaks),
        )
        reply: Message
        try:
            await order.deadline.run(handler(order), f"fetch {request.request_id}")
            reply = Ack(request.seq)
        except TransferError as exc:
            reply = Nack(request.seq, exc.reason, str(exc), list(exc.indices))
        except Exception as exc:
            log.exception("fetch handler failed for %s", request.request_id)
            reply = Nack(request.seq, Reason.FETCH_FAILED, f"{type(exc).__name__}: {exc}")
        await self._reply(link, reply)


def _verified(target: Any, header: SegmentHeader, pos: int) -> int | None:
    """The checksum to record for buffer `pos` of a segment that landed in `target`,
    or None if it fails verification.

    Device memory is never hashed here (that would copy it to the host on the event
    loop): a device destination takes the announced checksum as it is. A host
    destination of an unchecksummed segment (a device sender) is hashed, so that a
    store still knows the checksum of every block it holds.
    """
    announced = header.checksums[pos]
    if is_device(target):
        return announced if header.checksum == XXH3_64 else 0
    actual = checksum(target)
    if header.checksum == XXH3_64 and actual != announced:
        return None
    return actual


def _spans_valid(header: SegmentHeader) -> bool:
    """Spans, if any, are positive and cover the segment's buffers exactly."""
    spans = header.spans
    if not spans:
        return True
    return (
        len(spans) <= MAX_SEGMENT_BUFFERS and min(spans) > 0 and sum(spans) == len(header.indices)
    )


class _StagingPool:
    """Reusable staging buffers for spans whose destinations are not adjacent.

    A span lands in one of these and is copied out buffer by buffer: one extra copy
    of the span instead of one UCX message per buffer (a kvstore block is one span
    of all its layers, which land in an engine's pages one layer apart). Buffers are
    reused, so a steady stream of spans costs no allocation or page faults. A buffer
    whose receive was aborted is simply never given back.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []

    def take(self, size: int) -> np.ndarray:
        for i, buf in enumerate(self._free):
            if buf.nbytes >= size:
                del self._free[i]
                return buf[:size]
        return np.empty(size, dtype=np.uint8)

    def give(self, view: np.ndarray) -> None:
        buf = view.base if isinstance(view.base, np.ndarray) else view
        if len(self._free) < self._keep:
            self._free.append(buf)
