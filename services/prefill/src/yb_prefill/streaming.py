"""Layer-wise streaming of a prompt's KV to the decode instance while prefill runs.

The runner calls `on_layer(layer, start, end)` on the engine thread as soon as a layer
has written the KV of tokens [start, end). Each page that became complete (or the last,
partial page once the prompt is done) is queued for sending; a task on the event loop
sends the queued pages in order over UCX, straight from the prefill cache's pages, so
transfer overlaps the compute of later layers and chunks.

On CUDA the hook fires when the layer's kernels are *launched*, not finished: the
pages may not hold their KV yet. So `on_layer` also records a CUDA event on the
engine thread's current stream (the one those kernels went to), and a page goes to
UCX only once the event of its layer has completed. The sending task polls the
event (`query()`, which never blocks) with short sleeps on the event loop, within the
transfer's deadline: the loop keeps serving other work, and nothing synchronises the
device. On CPU the kernels have run when the hook fires, and no event is recorded.

Traced, a stream is one `kv transfer` span, from `start()` to the decode instance's
verified commit (or the abort), with one `kv_segment_sent` event per UCX message
(its pages, bytes and layers). Not a span per layer: a prompt of a few chunks on a
30-layer model makes hundreds of layer hand-offs, and spans that many would bury
the request's phases in Jaeger; events on one span show the same thing where it
matters, on the timeline beside the `prefill compute` span: how much of the
transfer overlapped the compute, and the tail left after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from yb_core.telemetry import tracer
from yb_dataplane.transport import KVSender, PeerAddress, TransferTimeout
from yb_dataplane.transport.deadline import Deadline

if TYPE_CHECKING:
    import torch

    from yb_engine.kv_cache import PagedKVCache

# Buffer items of one segment: (index in the decode reservation, source page view).
Segment = list[tuple[int, "torch.Tensor"]]


class LayerEvent(Protocol):
    """Completion of the work launched before it: a `torch.cuda.Event`, recorded."""

    def query(self) -> bool:
        """True once that work has finished (never blocks)."""
        ...


#: Makes the event of a layer whose kernels were just launched (called on the engine
#: thread, from `on_layer`).
EventFactory = Callable[[], LayerEvent]

#: Queued: a segment, and the event its pages must wait for (None: ready now).
Queued = tuple[Segment, LayerEvent | None]

_tracer = tracer(__name__)

#: Polling of layer events: first sleep, and the longest (seconds). A layer of a
#: prefill chunk takes a fraction of a millisecond to milliseconds on a GPU.
_POLL_FIRST_S: Final = 0.0001
_POLL_MAX_S: Final = 0.002


def cuda_layer_event() -> LayerEvent:
    """A CUDA event recorded now on the calling thread's current stream."""
    import torch

    event: LayerEvent = torch.cuda.Event()
    event.record()  # type: ignore[attr-defined]
    return event


async def wait_for_events(events: Sequence[LayerEvent], deadline: Deadline) -> None:
    """Return once every event has completed; TransferTimeout at `deadline`.

    Polls `query()` with sleeps that grow from `_POLL_FIRST_S` to `_POLL_MAX_S`: never
    blocks the event loop and never synchronises the device.
    """
    delay = _POLL_FIRST_S
    for event in events:
        while not event.query():
            remaining = deadline.remaining()
            if remaining <= 0:
                raise TransferTimeout("the layer's kernels did not finish before the deadline")
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)


#: Segments in flight at once (each waits for the receiver's verification).
WINDOW = 4
#: Queued pages are merged into one segment up to this many bytes.
MAX_SEGMENT_BYTES = 32 << 20
MAX_SEGMENT_PAGES = 4096
#: A request's whole KV up to this many bytes goes out as one segment, with its
#: commit, once every page is computed: streaming it layer by layer overlaps next to
#: nothing (its transfer takes microseconds) and costs a round trip, and the Python
#: work of a send and a receive, per segment. The commit waits for the first token
#: anyway, so the request is handed over no later.
WHOLE_TRANSFER_BYTES = 256 << 10


class LayerStreamer:
    """Ships each (layer, page) of one request to the decode reservation as it completes.

    Index `layer * num_pages + i` of the reservation is page `i` of the request in
    layer `layer` (the layout `KVReserved` announces); with `cuts` (a tensor-parallel
    side: `KVReserved.head_cuts`), each page goes as `k` pieces, index `(layer * k +
    j) * num_pages + i`, each straight from the rank that holds those heads. Made
    without a `peer`, it queues what completes until `direct()` says where the
    reservation is, so that compute need not wait for the reservation's round trip.

    With `commit_last`, the segment that completes the request (every page of every
    layer queued) goes out once the sends before it have returned, carrying the
    commit: the whole transfer of a short prompt is one round trip, not a send's
    then a commit's. `finish()` then has no commit left to make.

    Directed with `hand_over`, the commit carries a note for the receiver's owner
    (the decode instance's hand-over, given by `hand_over()` once the compute has
    sampled the first token): the segment that commits waits for it, within the
    deadline, and `finish()` commits with it when no segment did.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sender: KVSender,
        peer: PeerAddress | None,
        request_id: str,
        cache: PagedKVCache,
        block_table: Sequence[int],
        num_tokens: int,
        num_cached_tokens: int,
        deadline_s: float,
        receiver_breaks: Collection[int] | None = None,
        layer_event: EventFactory | None = None,
        *,
        commit_last: bool = False,
        whole_below: int = WHOLE_TRANSFER_BYTES,
        cuts: Sequence[int] | None = None,
    ) -> None:
        self._loop = loop
        self._cuts = list(cuts) if cuts is not None else cache.head_cuts
        self._k = len(self._cuts) - 1
        self._sender = sender
        self._peer = peer
        self._request_id = request_id
        self._cache = cache
        self._block_table = list(block_table)
        self._num_tokens = num_tokens
        self._deadline_s = deadline_s
        # The decode pages' layout: a run of pages shares a message only where the
        # decode pages are adjacent too, so each lands there without staging.
        self._receiver_breaks = receiver_breaks
        self._directed: asyncio.Future[None] = loop.create_future()
        # The note the commit carries, when directed to wait for one (`direct`).
        self._wants_note = False
        self._note: asyncio.Future[bytes] = loop.create_future()
        #: Resolved once a segment of this stream was verified by the receiver (the
        #: connection carries data now), or the stream ended either way.
        self.flowing: asyncio.Future[None] = loop.create_future()
        if peer is not None:
            self._directed.set_result(None)
        self._block_size = cache.block_size
        # Per layer, pages below this index are queued already. Pages wholly inside the
        # cached prefix are not computed, so no hook queues them: `queue_prefix` does.
        self._next_page = [num_cached_tokens // self._block_size] * cache.num_layers
        if layer_event is None and cache.device.type == "cuda":
            layer_event = cuda_layer_event
        self._layer_event = layer_event
        self._queue: asyncio.Queue[Queued | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._commit_last = commit_last
        # Sent whole (see `WHOLE_TRANSFER_BYTES`): decided on the first page queued.
        self._whole_below = whole_below if commit_last else 0
        self._whole = False
        # Every (layer, page) is queued exactly once: by `queue_prefix` or `on_layer`.
        self._pages_left = cache.num_layers * len(self._block_table)
        self._committed = False
        self.pages_sent = 0
        self.bytes_sent = 0  # counted only while traced
        self._span: trace.Span = trace.INVALID_SPAN
        self._span_open = False

    def start(self) -> None:
        """Start the sending task (on the event loop), and the transfer's span as a
        child of the current one when that one is traced."""
        if trace.get_current_span().is_recording():
            self._span = _tracer.start_span("kv transfer", kind=trace.SpanKind.PRODUCER)
            self._span.set_attributes(
                {
                    "yb.request_id": self._request_id,
                    "yb.pages": len(self._block_table),
                    "yb.layers": self._cache.num_layers,
                }
            )
            if self._peer is not None:
                self._span.set_attribute("yb.peer_host", self._peer.host)
            self._span_open = True
        self._task = self._loop.create_task(self._send_all(), name=f"stream:{self._request_id}")

    def direct(
        self,
        peer: PeerAddress,
        receiver_breaks: Collection[int] | None,
        *,
        hand_over: bool = False,
    ) -> None:
        """Where the reservation is (for a streamer made without a `peer`): what was
        queued meanwhile goes out now, in order. With `hand_over`, the commit waits
        for the note `hand_over()` gives it."""
        assert self._peer is None, "directed twice"
        self._peer = peer
        self._receiver_breaks = receiver_breaks
        self._wants_note = hand_over
        if self._span_open:
            self._span.set_attribute("yb.peer_host", peer.host)
        self._directed.set_result(None)

    def on_layer(self, layer: int, start: int, end: int) -> None:
        """Runner hook (engine thread, after the layer's kernels were launched): queue
        the pages of `layer` completed up to `end`, with the layer's event."""
        del start
        done_pages = len(self._block_table) if end >= self._num_tokens else end // self._block_size
        first = self._next_page[layer]
        if done_pages <= first:
            return
        self._next_page[layer] = done_pages
        segment = self._pages(layer, range(first, done_pages))
        # Recorded here, on the engine thread, so that it follows exactly the kernels
        # launched so far on the engine's stream.
        event = self._layer_event() if self._layer_event is not None else None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (segment, event))

    def queue_prefix(self, cached_pages: int) -> None:
        """Queue the cached prefix's pages of every layer (they need no compute).

        No event: their KV was written by steps that have finished (an engine step
        ends by reading its results back), or landed by a transfer already committed.
        """
        for layer in range(self._cache.num_layers):
            segment = self._pages(layer, range(cached_pages))
            if segment:
                self._queue.put_nowait((segment, None))

    def _pages(self, layer: int, pages: range) -> Segment:
        """The items of the request's `pages` in `layer`: each page's pieces, at their
        reservation indices."""
        num_pages, k = len(self._block_table), self._k
        pieces = [self._cache.pieces(layer, self._block_table[i], self._cuts) for i in pages]
        # Piece-major (`KVReserved`): a rank's pieces of consecutive pages join.
        return [
            ((layer * k + j) * num_pages + i, of_page[j])
            for j in range(k)
            for i, of_page in zip(pages, pieces, strict=True)
        ]

    def hand_over(self, note: bytes) -> None:
        """The note the commit carries (see the class docstring); call it once, before
        `finish()`."""
        self._note.set_result(note)

    async def finish(self) -> None:
        """Wait until every queued page is sent, then commit; raises on any failure."""
        assert self._task is not None, "start() first"
        try:
            self._queue.put_nowait(None)
            await self._task
            assert self._peer is not None  # the task ended after `direct()`
            if not self._committed:
                await self._sender.commit(
                    self._peer,
                    self._request_id,
                    deadline_s=self._deadline_s,
                    note=await self._commit_note(),
                )
        except BaseException as exc:
            self._end_span(exc)
            raise
        finally:
            _resolve(self.flowing)
        self._end_span(None)

    async def abort(self) -> None:
        """Stop sending (prefill failed or was cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        _resolve(self.flowing)
        self._end_span("aborted")

    def _end_span(self, failure: BaseException | str | None) -> None:
        """End the transfer's span once: its totals, and why it failed if it did."""
        if not self._span_open:
            return
        self._span_open = False
        span = self._span
        span.set_attributes({"yb.pages_sent": self.pages_sent, "yb.bytes_sent": self.bytes_sent})
        if isinstance(failure, BaseException):
            span.record_exception(failure)
            span.set_status(Status(StatusCode.ERROR, repr(failure)))
        elif failure is not None:
            span.set_status(Status(StatusCode.ERROR, failure))
        span.end()

    async def _send_all(self) -> None:
        """Send queued pages, up to `WINDOW` segments in flight, in queue order.

        Pages queued while earlier sends are in flight go out together in one segment
        (up to `MAX_SEGMENT_BYTES`): the prefix of a reused prompt is queued all at
        once, and one segment per layer would pay a round trip per layer. A small
        request (`whole_below`) waits for all its pages and sends them in one.
        """
        in_flight: set[asyncio.Task[int]] = set()
        ended = False
        try:
            await self._directed
            while not ended:
                first = await self._queue.get()
                if first is None:
                    break
                segment = list(first[0])
                events = [first[1]] if first[1] is not None else []
                nbytes = sum(_nbytes(page) for _, page in segment)
                if self._whole_below and segment:
                    total = self._pages_left * self._cache.page_nbytes
                    self._whole = total <= self._whole_below
                    self._whole_below = 0
                while (
                    # Held for the rest of a whole transfer, or merging what is queued.
                    (
                        (self._whole and len(segment) < self._pages_left * self._k)
                        or not self._queue.empty()
                    )
                    and nbytes < MAX_SEGMENT_BYTES
                    and len(segment) < MAX_SEGMENT_PAGES
                ):
                    more = await self._queue.get()
                    if more is None:
                        ended = True
                        break
                    segment += more[0]
                    if more[1] is not None:
                        events.append(more[1])
                    nbytes += sum(_nbytes(page) for _, page in more[0])
                self._pages_left -= len(segment) // self._k
                last = self._commit_last and self._pages_left == 0
                # The commit must follow every other send of the request.
                while in_flight and (last or len(in_flight) >= WINDOW):
                    done, in_flight = await asyncio.wait(
                        in_flight, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done:
                        self.pages_sent += task.result()
                if last:
                    note = await self._commit_note()
                    self.pages_sent += await self._send(segment, events, commit=True, note=note)
                    self._committed = True
                    continue
                in_flight.add(asyncio.ensure_future(self._send(segment, events)))
            if in_flight:
                done, in_flight = await asyncio.wait(in_flight)
                for task in done:
                    self.pages_sent += task.result()
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _commit_note(self) -> bytes:
        """The note for the commit (b"" unless directed to wait for one), within the
        deadline: it comes once the compute sampled the first token."""
        if not self._wants_note:
            return b""
        if not self._note.done():
            await asyncio.wait({self._note}, timeout=self._deadline_s)
            if not self._note.done():
                raise TransferTimeout("no hand-over for the commit before the deadline")
        return self._note.result()

    async def _send(
        self,
        segment: Segment,
        events: Sequence[LayerEvent],
        *,
        commit: bool = False,
        note: bytes = b"",
    ) -> int:
        assert self._peer is not None  # `_send_all` waits for `direct()`
        deadline = Deadline.after(self._deadline_s)
        if events:
            # Not one byte of these pages goes to UCX before their layers finished.
            await wait_for_events(events, deadline)
        await self._sender.send(
            self._peer,
            self._request_id,
            segment,
            deadline_s=deadline.remaining(),
            receiver_breaks=self._receiver_breaks,
            commit=commit,
            note=note,
        )
        _resolve(self.flowing)
        if self._span_open:
            nbytes = sum(_nbytes(page) for _, page in segment)
            self.bytes_sent += nbytes
            num_pages = len(self._block_table)
            layers = [index // (num_pages * self._k) for index, _ in segment]
            self._span.add_event(
                "kv_segment_sent",
                {
                    "pages": len(segment) // self._k,
                    "bytes": nbytes,
                    "layers": f"{min(layers)}-{max(layers)}",
                },
            )
        return len(segment) // self._k


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _nbytes(page: torch.Tensor) -> int:
    return int(page.numel() * page.element_size())
