"""The decode engine service.

Prefill instances talk to it on `yb.job.decode.<id>` (core NATS request/reply):
`ReserveKV` sets aside pages and posts UCX receives into exactly those pages;
`StartDecode` admits the request into the continuous batch once the UCX commit is
verified; `AbortReservation` frees the pages. One engine loop steps the batch while
it has work and streams each request's tokens, numbered, to its gateway's token
subject. Cancellations from the log abort a request wherever it is.

Token chunks are core NATS messages, so a gateway that moves to another NATS node
loses those sent meanwhile. Every chunk published is kept (`TokenHistory`, for a
while after its stream ends too), and a gateway that missed some asks on
`yb.resend.<id>` (`ResendTokens`): they are published again on the stream's token
subject, answered from the event loop, never behind the engine.

Nothing is held for a request that nobody will finish: a reservation whose KV stops
arriving (the prefill instance died: its UCX connection broke, or the deadline
passed) is freed and its gateway told at once with an error chunk, and a request
still decoding at its deadline is ended there (its gateway gave up on it then), so
even a request whose gateway vanished without a word frees its pages.

With `decode.piggyback` on it also takes short prompts into its batch, as the
conductor plans them (`yb_decode.piggyback`): the gateway hands such a job to
`yb.job.prefill.<id>` as to a prefill instance, and its tokens stream as any other.

Told to stop, it drains first (`decode.drain_timeout_s`, the shell's stop step 0): it
refuses new reservations ("decode instance shutting down": the prefill fails the job
blaming this instance, and the gateway re-plans it elsewhere) and piggybacked jobs
decided after its `InstanceDraining`, while the reservations it holds are committed
and handed over, and its streams run to their end. What still runs at the deadline
ends with a 503, which the gateway re-plans from the tokens its client has.

The bus, presence, cancellations, peers, the UCX transport and the shutdown order are
the data-plane shell's (`yb_dataplane.worker.WorkerShell`); `DecodeWorker` is what is
decode's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Histogram

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import BusError
from yb_core.config import YbConfig
from yb_core.failpoints import Failpoints
from yb_core.outbox import Outbox
from yb_core.telemetry import (
    bind_request,
    extract_context,
    get_logger,
    trace_carrier,
    trace_id_hex,
    tracer,
)
from yb_dataplane.block_upload import BlockUploader
from yb_dataplane.prefix_fetch import BlockFetcher
from yb_dataplane.transport import Reservation, TransferError
from yb_dataplane.worker import Capacity, Worker, WorkerContext, WorkerShell, decided_before
from yb_decode.history import TokenHistory
from yb_decode.page_wait import PageQueue, may_grant
from yb_decode.piggyback import PiggybackJobs
from yb_engine.host import EngineGauges, EngineHost
from yb_engine.kv_cache import OutOfPages

if TYPE_CHECKING:
    from yb_engine.batcher import DecodeBatcher, TokenOutput

log = get_logger(__name__)
_tracer = tracer(__name__)


@dataclass
class Pending:
    """A request between `ReserveKV` and `StartDecode`: pages reserved, KV arriving."""

    reserve: pr.ReserveKV
    trace_headers: dict[str, str]
    pages: list[int]
    reservation: Reservation
    commit: asyncio.Task[bool]
    # Set aside for the choices' copies of the last prompt page (n > 1).
    copy_pages: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Abort:
    """Why a running request is aborted: what its client is told, and how it ends
    (`abort`: cancelled; `error`: failed)."""

    message: str
    status: int
    finish: str


@dataclass
class Stream:
    """A request in the batch: where its tokens go and how many have gone.

    `completion_tokens` counts every choice's tokens, those a resumed request's client
    had before this attempt included (the chunks carry the running total)."""

    request_id: str
    subject: str
    prompt_tokens: int
    reused_tokens: int
    ttft_started: float
    span: trace.Span
    attempt: int = 0
    # The choices not finished yet; the stream ends with the last.
    open_choices: set[int] = field(default_factory=lambda: {0})
    deadline: float = 0.0  # wall clock; 0: none
    # The span of its phase under `span`: the wait for the first token, then the
    # stream (non-recording when untraced).
    phase_span: trace.Span = trace.INVALID_SPAN
    seq: int = 0
    completion_tokens: int = 0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    # The prompt's logprobs (`StartDecode.prompt_logprobs`), until they are streamed
    # ahead of the first token.
    prompt_logprobs: list[pr.TokenLogprob] = field(default_factory=list)


class DecodeService(WorkerShell["DecodeWorker"]):
    """Receives prompt KV over UCX and decodes with continuous batching."""

    role = "decode"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg, cfg.decode, cfg.decode.drain_timeout_s)
        # Registered now, so /metrics shows them while the model loads.
        self.metrics = DecodeMetrics(self.registry)
        self.gauges = EngineGauges(self.registry)

    async def build(self, context: WorkerContext) -> DecodeWorker:
        """Load the model; the batcher runs on it."""
        from yb_engine.batcher import DecodeBatcher

        engine = await EngineHost.load(self.cfg, self.cfg.decode, self.instance_id)
        batcher = DecodeBatcher(
            engine.runner,
            engine.allocator,
            engine.model.tokenizer,
            self.cfg.decode.max_batch_size,
        )
        return DecodeWorker(context, engine, batcher, self.metrics, self.gauges)


class DecodeMetrics:
    """What a decode instance exports besides the engine's gauges and the transport's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Histogram(
            "yb_decode_step_seconds",
            "Duration of one decode step (the TBT)",
            registry=registry,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        )
        self.requests = Counter(
            "yb_decode_requests_total", "Requests by outcome", ["outcome"], registry=registry
        )
        self.tokens = Counter("yb_decode_tokens_total", "Tokens generated", registry=registry)
        self.resent = Counter(
            "yb_decode_resent_chunks",
            "Token chunks published again because a gateway asked (it lost them)",
            registry=registry,
        )
        self.kv_bytes = Counter(
            "yb_decode_kv_bytes_received",
            "Prompt KV bytes received over UCX into reserved pages (verified commits)",
            registry=registry,
        )
        self.prompts = Counter(
            "yb_decode_piggybacked_jobs",
            "Piggybacked jobs (prompts prefilled inside the batch) by outcome: "
            "accepted, refused, failed",
            ["outcome"],
            registry=registry,
        )
        self.reused = Counter(
            "yb_decode_reused_tokens",
            "Piggybacked prompt tokens loaded from the pool instead of computed, by tier",
            ["tier"],
            registry=registry,
        )
        self.reserve_waits = Counter(
            "yb_decode_reservations_waited_total",
            "Reservations that found too few pages free and waited for some to free",
            registry=registry,
        )
        self.preemptions = Counter(
            "yb_decode_preemptions_total",
            "Batch lines that gave their batch slot up to a waiting request of a higher "
            "priority (their KV stays in their pages)",
            registry=registry,
        )
        self.puts = Counter(
            "yb_decode_block_puts_total",
            "Piggybacked prompts' blocks put into the host's kvstore, by outcome",
            ["outcome"],
            registry=registry,
        )


class DecodeWorker(Worker):
    """Reservations, the continuous batch and the token streams of one engine."""

    def __init__(
        self,
        context: WorkerContext,
        engine: EngineHost,
        batcher: DecodeBatcher,
        metrics: DecodeMetrics,
        gauges: EngineGauges,
    ) -> None:
        self.instance_id = context.instance_id
        self.cfg = context.cfg
        self.bus = context.bus
        self.receiver = context.receiver
        self.peers = context.peers
        self.tasks = context.tasks
        self.ucx_address = context.address.to_wire()
        self.engine = engine
        self.batcher = batcher
        self.gauges = gauges
        self.gauges.follow(engine)
        self.metrics = metrics
        self._pending: dict[str, Pending] = {}
        self._streams: dict[str, Stream] = {}
        # Why a stream is being aborted: a cancel, or its deadline.
        self._aborts: dict[str, _Abort] = {}
        self._work = asyncio.Event()
        self._draining = False
        # While it drains: where its `InstanceDraining` is in the log (0: refuse all).
        self._drain_seq = 0
        # Reservations waiting for pages (`ReserveKV.wait_s`).
        self._page_queue = PageQueue()
        # The newest control message being handled of each request (`_on_control`).
        self._controls: dict[str, asyncio.Task[None]] = {}
        # Test-only fault injection: inert (None) unless YB_FAILPOINTS arms it.
        self.failpoints = Failpoints.from_text(self.cfg.failpoints, self.instance_id)
        self._hold_at_token = self.failpoints.count("decode.token")
        # What was streamed, for gateways that lost chunks on the way.
        self.history = TokenHistory()
        # Progress and outcomes reach the log in order without the engine loop or a
        # first token waiting for them.
        self.outbox = Outbox(context.bus)
        # Prompts prefilled inside the batch (`decode.piggyback`).
        self.piggyback = self.cfg.decode.piggyback
        fetcher = BlockFetcher(
            self.instance_id, engine.cache, context.peers, context.receiver, context.sender
        )
        uploader = BlockUploader(
            engine.cache, context.sender, deadline_s=self.cfg.decode.transfer_timeout_s
        )
        self.piggy = PiggybackJobs(self, fetcher, uploader)

    # --- lifecycle ------------------------------------------------------------------

    def preconnects_to(self, up: ev.InstanceUp) -> bool:
        # Piggybacking, it asks kvstores for prefixes and puts new blocks into them.
        return self.piggyback and up.role == "kvstore"

    def capacity(self) -> Capacity:
        return Capacity(
            kv_capacity_blocks=self.engine.cache.num_pages,
            kv_block_bytes=self.engine.kv.page_nbytes,
            kv_spec=self.engine.cache.spec,
            max_batch_size=self.cfg.decode.max_batch_size,
            attention_backend=self.engine.attention_backend,
            piggyback=self.piggyback,
            tensor_parallel=self.engine.tensor_parallel,
        )

    async def serve(self) -> None:
        """Take control messages, resend requests and (piggybacking) jobs, and step the
        batch."""
        await self.bus.subscribe(pr.decode_control_subject(self.instance_id), cb=self._on_control)
        if self.piggyback:
            await self.bus.subscribe(pr.prefill_job_subject(self.instance_id), cb=self.piggy.on_job)
        # Its own subscription, so its callback task never waits behind a control
        # message (a reservation waits for the engine thread).
        await self.bus.subscribe(pr.resend_subject(self.instance_id), cb=self._on_resend)
        self.tasks.spawn("engine", self._engine_loop())
        self.tasks.spawn("outbox", self.outbox.run())
        # A lost tensor-parallel rank fails this task, which takes the instance down.
        self.tasks.spawn("ranks", self.engine.watch_ranks())

    def refuse_work(self) -> None:
        self._draining = True
        self._drain_seq = 0
        self._page_queue.notify()  # the waiting reservations are refused now

    def drain(self, logged_seq: int) -> None:
        self.refuse_work()
        self._drain_seq = logged_seq

    def holds_work(self) -> bool:
        return bool(self._pending or self._streams or self.piggy.loading or self.piggy.uploads)

    @property
    def draining(self) -> bool:
        """Whether it refuses new work (it is stopping)."""
        return self._draining

    def refuses_job(self, job: pr.PrefillJob) -> bool:
        """Whether it refuses a piggybacked job because it is stopping: any, once it
        refuses all work; while it drains, those decided after its drain was logged
        (`decided_before`)."""
        return self._draining and not decided_before(job.decision, self._drain_seq)

    @property
    def reservations_waiting(self) -> int:
        """Reservations waiting for pages to free (`ReserveKV.wait_s`)."""
        return len(self._page_queue)

    def wake(self) -> None:
        """The batch has work: let the engine loop step."""
        self._work.set()

    async def settle(self) -> None:
        """Log the progress and outcomes of the requests served so far."""
        await self.outbox.flush(self.cfg.nats.request_timeout_s)

    async def release(self) -> None:
        """Free every reservation and end every running stream with an error, and
        log what is left to say."""
        for request_id in list(self._pending):
            await self._drop_pending(request_id, "decode instance shutting down")
        for stream in list(self._streams.values()):
            await self._end_stream(stream, error="decode instance shutting down", status=503)
        await self.outbox.flush(self.cfg.nats.request_timeout_s)

    async def close(self) -> None:
        self.engine.close()

    # --- control messages from prefill ---------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        """Take a control message and handle it in a task of its own, after the earlier
        ones of its request: nats-py runs this callback for one message at a time, and
        handling them here would make every reservation and hand-over wait for the
        engine thread's calls and the commits of all those before it."""
        try:
            message = pr.decode_control_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("malformed_control", error=str(exc))
            await self._respond(
                msg, pr.DecodeAck(request_id="", ok=False, reason=f"malformed message: {exc}")
            )
            return
        rid = message.request_id
        before = self._controls.get(rid)
        task = self.tasks.spawn(f"control:{rid}", self._control(msg, message, before))
        self._controls[rid] = task
        task.add_done_callback(functools.partial(self._control_done, rid))

    def _control_done(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._controls.get(request_id) is task:
            del self._controls[request_id]

    async def _control(
        self, msg: Msg, message: pr.DecodeControl, before: asyncio.Task[None] | None
    ) -> None:
        """Handle one control message and answer it, once `before` (the previous
        message of the same request) has been handled."""
        if before is not None:
            await asyncio.wait({before})
        try:
            await self._handle_control(msg, message)
        except Exception as exc:  # one message's bug must not stop the instance
            log.exception("control_failed", request_id=message.request_id, error=repr(exc))

    async def _handle_control(self, msg: Msg, message: pr.DecodeControl) -> None:
        match message:
            case pr.ReserveKV():
                headers = trace_carrier(msg.headers)
                # A child of the prefill's reservation request (its context came in
                # the request's headers).
                with _tracer.start_as_current_span(
                    "decode reserve", context=extract_context(headers)
                ) as span:
                    reply: pr.DecodeReply = await self._reserve(message, headers)
                    if span.is_recording():
                        span.set_attributes(_reserve_attributes(message, reply))
            case pr.StartDecode():
                reply = await self._start(message, trace_carrier(msg.headers))
            case pr.AbortReservation():
                await self._drop_pending(message.request_id, message.reason)
                reply = pr.DecodeAck(request_id=message.request_id, ok=True)
        await self._respond(msg, reply)

    async def _respond(self, msg: Msg, reply: pr.DecodeReply | pr.TokensResent) -> None:
        with contextlib.suppress(Exception):
            await msg.respond(pr.encode(reply))

    # --- piggybacked prompts' streams (their jobs: `piggyback.PiggybackJobs`) ---------

    def open_prompt_stream(
        self, job: pr.PrefillJob, trace_headers: dict[str, str], cached: int, started_ns: int
    ) -> None:
        """Track a piggybacked prompt's token stream from its acceptance, traced."""
        prompt_tokens = len(job.token_ids) - job.generated_tokens
        self._streams[job.request_id] = _new_stream(
            "decode piggyback",
            extract_context(trace_headers),
            started_ns,
            request_id=job.request_id,
            subject=job.token_subject,
            prompt_tokens=prompt_tokens,
            reused_tokens=cached,
            ttft_started=job.decision.time,
            attempt=job.attempt,
            open_choices=set(range(job.sampling.n)),
            deadline=job.deadline,
            completion_tokens=job.generated_tokens,
            max_tokens=job.sampling.max_tokens,
        )
        log.info(
            "piggyback_accepted",
            request_id=job.request_id,
            prompt_tokens=prompt_tokens,
            reused_tokens=cached,
            trace_id=trace_id_hex(trace_headers),
        )

    # --- resends to gateways that lost chunks ---------------------------------------

    async def _on_resend(self, msg: Msg) -> None:
        """Publish a stream's chunks again from the asked one on, then answer.

        Only history and the request tables are read, so the answer never waits for
        the engine. The chunks go to the stream's own token subject, not into the
        reply: only the gateway the stream is addressed to may read them.
        """
        try:
            ask = pr.resend_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("malformed_resend", error=str(exc))
            await self._respond(msg, pr.TokensResent(request_id="", state="unknown"))
            return
        rid = ask.request_id
        kept = self.history.get(rid)
        if kept is None:
            # Nothing published yet: before its first token, or never here.
            state: pr.StreamState = "unknown"
            if rid in self._streams:
                state = "streaming"
            elif rid in self._pending or rid in self.piggy.loading:
                state = "pending"
            await self._respond(msg, pr.TokensResent(request_id=rid, state=state))
            return
        # Taken before publishing: chunks of a live stream published meanwhile reach
        # the gateway by themselves.
        first_seq, next_seq = kept.first_seq, kept.next_seq
        payloads = kept.since(ask.from_seq)
        resent = 0
        try:
            for payload in payloads:
                await self.bus.publish_core(kept.subject, payload)
                resent += 1
        except BusError as exc:
            log.warning("resend_failed", request_id=rid, error=str(exc))
        if resent:
            self.metrics.resent.inc(resent)
            log.info("tokens_resent", request_id=rid, from_seq=ask.from_seq, resent=resent)
        reply = pr.TokensResent(
            request_id=rid,
            state="finished" if kept.finished else "streaming",
            first_seq=first_seq,
            next_seq=next_seq,
            resent=resent,
        )
        await self._respond(msg, reply)

    async def emit(self, request_id: str, subject: str, chunk: pr.TokenChunk) -> None:
        """Publish a chunk to its gateway, and keep it for a resend."""
        payload = pr.encode(chunk)
        self.history.record(request_id, subject, chunk.seq, payload)
        try:
            await self.bus.publish_core(subject, payload)
        except BusError as exc:
            # Kept all the same: the gateway asks for it once it misses it.
            log.warning("token_publish_failed", request_id=request_id, error=str(exc))

    async def _reserve(self, req: pr.ReserveKV, trace_headers: dict[str, str]) -> pr.ReserveReply:
        cache = self.engine.cache
        rid = req.request_id
        if self._draining:
            return pr.ReserveRefused(request_id=rid, reason="decode instance shutting down")
        if refused := await self.replace_older_attempt(rid, req.attempt):
            return pr.ReserveRefused(request_id=rid, reason=refused)
        # max_tokens counts the tokens a resumed request had generated already.
        total = req.num_tokens - req.generated_tokens + req.sampling.max_tokens
        if total > self.cfg.model.max_model_len:
            return pr.ReserveRefused(
                request_id=rid,
                reason=f"prompt plus max_tokens ({total}) exceeds {self.cfg.model.max_model_len}",
            )
        # Each page arrives cut at the sender's choice of head runs, which must refine
        # this instance's own (a tensor-parallel instance's ranks each hold a run).
        cuts = req.head_cuts or [0, cache.spec.heads]
        if (
            cuts != sorted(set(cuts))
            or (cuts[0], cuts[-1]) != (0, cache.spec.heads)
            or not set(cache.head_cuts) <= set(cuts)
        ):
            return pr.ReserveRefused(
                request_id=rid,
                reason=f"KV head cuts {cuts} do not refine this instance's {cache.head_cuts}",
            )
        num_pages = cache.pages_for(req.num_tokens)
        # The choices of n > 1 each need a copy of the last prompt page: set aside now,
        # so a request admitted is never refused for them after its prefill.
        copies = self.batcher.copies_needed(req.num_tokens, req.sampling.n)
        allocated = await self._allocate(req, num_pages + copies)
        if isinstance(allocated, str):
            return pr.ReserveRefused(request_id=rid, reason=allocated)
        pages, copy_pages = allocated[:num_pages], allocated[num_pages:]
        # Index `(layer * k + j) * num_pages + i` (`KVReserved`): piece-major.
        buffers = []
        for layer in range(cache.num_layers):
            by_page = [cache.pieces(layer, page, cuts) for page in pages]
            buffers += [of_page[j] for j in range(len(cuts) - 1) for of_page in by_page]
        # The reservation lasts until the request's deadline: the prefill computes
        # while it streams, and a long prompt on a busy engine takes longer than any
        # one transfer. A prefill that dies meanwhile is the conductor's to declare,
        # and its cancellation frees the pages at once.
        deadline_s = self.cfg.decode.transfer_timeout_s
        if req.deadline:
            deadline_s = max(0.1, req.deadline - time.time())
        reservation = self.receiver.reserve(rid, buffers, deadline_s=deadline_s)
        commit = self.tasks.spawn(f"commit:{rid}", self._await_commit(rid, reservation))
        self._pending[rid] = Pending(
            req, trace_headers or req.trace_headers, pages, reservation, commit, copy_pages
        )
        return pr.KVReserved(
            request_id=rid,
            ucx_address=self.ucx_address,
            num_pages=num_pages,
            num_layers=cache.num_layers,
            page_nbytes=cache.page_nbytes,
            block_size=cache.block_size,
            breaks=reservation.breaks(),
            handover_on_commit=True,
            head_cuts=req.head_cuts,
        )

    async def _allocate(self, req: pr.ReserveKV, needed: int) -> list[int] | str:
        """`needed` pages for a reservation, waiting up to `req.wait_s` (and no later
        than its deadline) for them behind the reservations that came first
        (`yb_decode.page_wait`); or why not."""
        allocator = self.engine.allocator
        if needed > allocator.num_pages:
            return f"out of KV pages: need {needed}, the instance has {allocator.num_pages}"
        queue = self._page_queue
        if not queue:
            try:
                return await self.engine.call(allocator.allocate, needed)
            except OutOfPages as exc:
                if req.wait_s <= 0:
                    return f"out of KV pages: {exc}"
        elif req.wait_s <= 0:
            return f"out of KV pages: {len(queue)} reservations are waiting for pages"
        loop = asyncio.get_running_loop()
        wait_s = req.wait_s
        if req.deadline:
            wait_s = min(wait_s, req.deadline - time.time())
        started = loop.time()
        until = started + wait_s
        ticket = queue.join(req.request_id, req.priority)
        self.metrics.reserve_waits.inc()
        try:
            while not self._draining:
                seen = queue.generation
                if queue.is_head(ticket) and may_grant(
                    needed, allocator.num_free, self.batcher.num_running
                ):
                    with contextlib.suppress(OutOfPages):
                        pages = await self.engine.call(allocator.allocate, needed)
                        log.info(
                            "reservation_waited",
                            request_id=req.request_id,
                            pages=needed,
                            waited_s=round(loop.time() - started, 3),
                        )
                        return pages
                left = until - loop.time()
                if left <= 0:
                    return (
                        f"out of KV pages: need {needed}, only {allocator.num_free} free "
                        f"after waiting {wait_s:.1f}s"
                    )
                await queue.changed(seen, left)
            return "decode instance shutting down"
        finally:
            queue.leave(ticket)

    async def replace_older_attempt(self, rid: str, attempt: int) -> str:
        """Make way for a re-planned request's reservation or piggybacked job: an older
        attempt of it held here (reserved, loading its prefix, prefilling or
        decoding) is dropped without a word to the gateway, which reads only the
        newest attempt's stream. Why it is refused ('' if it is not): this attempt or
        a newer one is here already."""
        pending = self._pending.get(rid)
        loading = self.piggy.loading.get(rid)
        stream = self._streams.get(rid)
        held = (
            pending.reserve.attempt
            if pending
            else loading.job.attempt
            if loading
            else stream.attempt
            if stream
            else None
        )
        if held is None:
            return ""
        if held >= attempt:
            return f"request already reserved here (attempt {held})"
        log.info("attempt_replaced", request_id=rid, old=held, new=attempt)
        if pending is not None:
            await self._drop_pending(rid, f"replaced by attempt {attempt}")
        if loading is not None:
            loading.silent = True
            loading.task.cancel()
            await asyncio.wait({loading.task})
        if stream is not None:
            await self.engine.call(self.batcher.discard, rid)
            self.piggy.prompts.pop(rid, None)
            self._aborts.pop(rid, None)
            # No `RequestFinished`: the request lives on in the new attempt.
            self._streams.pop(rid, None)
            self.history.finish(rid)
            stream.phase_span.end()
            stream.span.set_status(Status(StatusCode.ERROR, f"replaced by attempt {attempt}"))
            stream.span.end()
        return ""

    async def _await_commit(self, request_id: str, reservation: Reservation) -> bool:
        """True once the KV is committed; frees a reservation that never commits.

        A commit with a note carries the hand-over (`StartDecode`): the request is
        admitted here, at once, and no control message follows. A failed transfer is
        the peer's problem, not this service's: it returns False rather than raising,
        which the supervisor would take for a crash.
        """
        try:
            await reservation.wait_committed()
        except TransferError as exc:
            log.warning("kv_transfer_failed", request_id=request_id, error=str(exc))
            # Not `_drop_pending`: that would cancel this very task.
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                self.receiver.cancel(request_id)
                await self.engine.call(self.free, pending.pages + pending.copy_pages)
                reason = (
                    f"KV transfer from prefill instance {pending.reserve.prefill_instance} "
                    f"failed: {exc}"
                )
                await self._fail_reservation(pending, reason)
            return False
        pending = self._pending.get(request_id)
        if pending is not None and self.engine.cache.has_replicas:
            # Heads kept by several ranks arrived once, into the first of them.
            await self.engine.call(self.engine.cache.replicate, pending.pages)
        if reservation.note:
            await self._take_over(request_id, reservation.note)
        return True

    async def _take_over(self, request_id: str, note: bytes) -> None:
        """Admit a request whose hand-over came with its commit. Nobody waits for an
        answer: when it cannot start, the gateway is told here, as the prefill
        instance would have been told and would have told it."""
        started_ns = time.time_ns()
        # Taken from the pending ones before any wait: a cancel from now on finds a
        # stream or nothing, never a reservation this task is admitting.
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return  # dropped (cancelled) while the commit was on its way
        start: pr.DecodeControl | None = None
        reason = f"the hand-over with the commit is no StartDecode for {request_id}"
        try:
            start = pr.decode_control_decoder.decode(note)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reason = f"unreadable hand-over: {exc}"
        if isinstance(start, pr.StartDecode) and start.request_id == request_id:
            ack = await self._admit(pending, start, start.trace_headers, started_ns)
            if ack.ok:
                return
            reason = ack.reason  # its pages were freed
        else:
            await self.engine.call(self.free, pending.pages + pending.copy_pages)
        log.warning("hand_over_failed", request_id=request_id, reason=reason)
        await self._fail_reservation(
            pending, f"decode instance {self.instance_id} did not start the request: {reason}"
        )

    async def _fail_reservation(self, pending: Pending, reason: str) -> None:
        """Tell the gateway now that its request will not start here (its KV will
        not come, or came and could not be admitted); its pages are free already.

        The prefill instance may be dead (which is why its KV stopped), so nobody
        else would: the client would wait for a first token until its timeout.
        If the prefill lives it reports the failure too; the gateway reads the
        first report and the log de-duplicates the second.
        """
        reserve = pending.reserve
        chunk = pr.TokenChunk(
            request_id=reserve.request_id,
            seq=0,
            finished=True,
            finish_reason="error",
            error=reason,
            error_status=503,
            prompt_tokens=reserve.num_tokens - reserve.generated_tokens,
            attempt=reserve.attempt,
        )
        await self.emit(reserve.request_id, reserve.token_subject, chunk)
        self.history.finish(reserve.request_id)
        self.metrics.requests.labels("failed").inc()
        self.log_event(
            ev.RequestFinished(
                request_id=reserve.request_id,
                instance_id=self.instance_id,
                outcome="failed",
                reason=reason,
                prompt_tokens=reserve.num_tokens - reserve.generated_tokens,
                attempt=reserve.attempt,
            )
        )

    async def _start(self, start: pr.StartDecode, trace_headers: dict[str, str]) -> pr.DecodeAck:
        """Admit a reserved request once its KV is committed, and open its stream.

        The stream's span is a child of the prefill's hand-over (`trace_headers`, the
        reservation's context when they carry none) and opens here, so it includes
        the commit's verification and the admission into the batch.
        """
        started_ns = time.time_ns()
        rid = start.request_id
        pending = self._pending.get(rid)
        if pending is None:
            return pr.DecodeAck(request_id=rid, ok=False, reason="no reservation for request")
        try:
            # The commit already happened on the sender's side; allow a moment for its
            # verification here (usually over already: no wait to set up then).
            if pending.commit.done():
                committed = pending.commit.result()
            else:
                committed = await asyncio.wait_for(asyncio.shield(pending.commit), timeout=5.0)
        except TimeoutError:
            committed = False
        if not committed:
            await self._drop_pending(rid, "KV not committed")
            return pr.DecodeAck(request_id=rid, ok=False, reason="KV not committed")
        if self._pending.pop(rid, None) is None:
            # Its commit carried a hand-over too: admitted (or failed) there.
            return pr.DecodeAck(request_id=rid, ok=False, reason="handed over with the commit")
        return await self._admit(pending, start, trace_headers, started_ns)

    async def _admit(
        self,
        pending: Pending,
        start: pr.StartDecode,
        trace_headers: dict[str, str],
        started_ns: int,
    ) -> pr.DecodeAck:
        """Add a committed request (taken from the pending ones) to the batch and open
        its stream; on failure its pages are freed."""
        rid = start.request_id
        cache = self.engine.cache
        self.metrics.kv_bytes.inc(len(pending.pages) * cache.num_layers * cache.page_nbytes)
        reserve = pending.reserve
        try:
            await self.engine.call(
                functools.partial(
                    self.batcher.add,
                    rid,
                    reserve.prompt_token_ids,
                    pending.pages,
                    start.first_token,
                    reserve.sampling,
                    first_tokens=start.first_tokens or None,
                    first_logprobs=start.first_logprobs or None,
                    generated_tokens=reserve.generated_tokens,
                    priority=reserve.priority,
                    copy_pages=pending.copy_pages,
                    preemptible=reserve.preemptible,
                )
            )
        except ValueError as exc:
            await self.engine.call(self.free, pending.pages + pending.copy_pages)
            return pr.DecodeAck(request_id=rid, ok=False, reason=str(exc))
        await self._open_stream(pending, start, trace_headers, started_ns)
        self._work.set()
        return pr.DecodeAck(request_id=rid, ok=True)

    async def _open_stream(
        self,
        pending: Pending,
        start: pr.StartDecode,
        trace_headers: dict[str, str],
        started_ns: int,
    ) -> None:
        """Track an admitted request's token stream, traced, and say its KV is in."""
        rid = start.request_id
        reserve = pending.reserve
        self._streams[rid] = _new_stream(
            "decode",
            extract_context(trace_headers or pending.trace_headers),
            started_ns,
            request_id=rid,
            subject=reserve.token_subject,
            prompt_tokens=start.prompt_tokens,
            reused_tokens=start.reused_tokens,
            ttft_started=reserve.ttft_started,
            attempt=reserve.attempt,
            open_choices=set(range(reserve.sampling.n)),
            deadline=reserve.deadline,
            completion_tokens=reserve.generated_tokens,
            max_tokens=reserve.sampling.max_tokens,
            prompt_logprobs=start.prompt_logprobs,
        )
        with bind_request(rid):
            log.info(
                "decode_started",
                prompt_tokens=start.prompt_tokens,
                trace_id=trace_id_hex(pending.trace_headers),
            )
        self.log_event(
            ev.RequestProgress(
                request_id=rid,
                instance_id=self.instance_id,
                stage="kv_committed",
                computed_tokens=start.prompt_tokens,
                reused_tokens=start.reused_tokens,
            )
        )

    async def _drop_pending(self, request_id: str, reason: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        log.info("reservation_dropped", request_id=request_id, reason=reason)
        self.receiver.cancel(request_id)
        if not pending.commit.done():
            pending.commit.cancel()
        await self.engine.call(self.free, pending.pages + pending.copy_pages)
        self._page_queue.notify()

    def free(self, pages: list[int]) -> None:
        self.engine.allocator.free(pages)

    def on_cancel(self, request_id: str, reason: str) -> None:
        if self.piggy.cancel(request_id, reason):
            return
        if request_id in self._pending:
            self.tasks.spawn(
                f"cancel:{request_id}", self._drop_pending(request_id, f"cancelled: {reason}")
            )
        elif request_id in self._streams:
            self._abort(request_id, _Abort(f"The request was cancelled: {reason}", 503, "abort"))

    def _abort(self, request_id: str, why: _Abort) -> None:
        """Stop decoding a request; the batcher frees its pages and the next step
        reports it, which ends its stream with `why`."""
        if request_id in self._aborts:
            return
        self._aborts[request_id] = why
        self.tasks.spawn(f"abort:{request_id}", self._run_abort(self.batcher, request_id))

    async def _run_abort(self, batcher: DecodeBatcher, request_id: str) -> None:
        if not await self.engine.call(batcher.abort, request_id):
            self._aborts.pop(request_id, None)  # it finished on its own meanwhile
        self._page_queue.notify()
        self._work.set()

    def _expire_streams(self) -> None:
        """Abort the requests whose deadline passed: their gateway gave up on them."""
        now = time.time()
        for stream in list(self._streams.values()):
            if stream.deadline and stream.deadline < now:
                why = _Abort("The request ran past its deadline.", 504, "error")
                self._abort(stream.request_id, why)

    # --- the engine loop ------------------------------------------------------------

    async def _engine_loop(self) -> None:
        batcher = self.batcher
        while True:
            await self._work.wait()
            if not batcher.has_work():
                self._work.clear()
                continue
            self._expire_streams()
            preempted = batcher.preemptions
            outputs, kept = await self.engine.call(_step, batcher)
            self.metrics.step.observe(batcher.last_step_seconds)
            self.metrics.preemptions.inc(batcher.preemptions - preempted)
            self.gauges.batch.set(batcher.num_running)
            self.gauges.queue.set(batcher.num_waiting + batcher.num_prefilling)
            if kept:
                self.piggy.store(kept)
            # A running stream's next page comes before filling the pool: while the
            # free pages could not give each running request one more, the uploads'
            # puts not yet posted are skipped and their pages come back at once.
            self.piggy.uploader.pages_wanted = uploads_yield(
                self.engine.allocator.num_free, batcher.num_running
            )
            if self.piggy.prompts:
                self.piggy.progress(outputs)
            if self._page_queue:
                self._page_queue.notify()  # a step frees the pages of what ended
            await self._deliver(outputs)

    async def _deliver(self, outputs: list[TokenOutput]) -> None:
        now = time.time()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.token_id is not None:
                stream.completion_tokens += 1
                self.metrics.tokens.inc()
                if not stream.first_token_at:
                    stream.first_token_at = now
                    if stream.span.is_recording():
                        _stream_phase(stream, now)
                else:
                    stream.gaps.append(now - stream.last_token_at)
                stream.last_token_at = now
            if out.finished and out.finish_reason == "abort":
                # An abort carries no token: the stream ends with why it was aborted.
                why = self._aborts.pop(out.request_id, _Abort("cancelled", 503, "abort"))
                await self._end_stream(
                    stream, error=why.message, status=why.status, reason=why.finish
                )
            elif out.finished:
                if out.finish_reason == "kv_exhausted":
                    # Cut short for lack of KV pages: the client sees a normal end by
                    # length (what it got is valid); operators see why in the log.
                    log.warning(
                        "request_cut_short",
                        request_id=out.request_id,
                        reason=out.message or "kv_exhausted",
                    )
                await self._send(stream, out)
                stream.open_choices.discard(out.index)
                if not stream.open_choices:
                    await self._finish(stream, out.finish_reason or "stop", "")
            else:
                await self._send(stream, out)
                if (
                    self._hold_at_token is not None
                    and out.token_id is not None
                    and stream.completion_tokens == self._hold_at_token
                ):
                    await self._park(stream.request_id)

    async def _park(self, request_id: str) -> None:
        """Failpoint `decode.token`: hold this request, and only it, where it is.

        Parked before the next step (this runs between steps), so the client has
        exactly N tokens and the request keeps its pages until the test lets it go
        or cancels it; the rest of the batch goes on stepping.
        """
        batcher = self.batcher
        if await self.engine.call(batcher.park, request_id):
            self.tasks.spawn(f"hold:{request_id}", self.hold(batcher, request_id))

    async def hold(
        self, batcher: DecodeBatcher, request_id: str, point: str = "decode.token"
    ) -> None:
        outcome = await self.failpoints.hold(
            point,
            request_id,
            cancelled=lambda: request_id not in self._streams or request_id in self._aborts,
        )
        if outcome != "cancelled":  # a cancelled one is the abort's to end
            await self.engine.call(batcher.unpark, request_id)
            self._work.set()

    async def _send(self, stream: Stream, out: TokenOutput) -> None:
        if stream.prompt_logprobs:
            await self._send_prompt_logprobs(stream)
        chunk = pr.TokenChunk(
            request_id=stream.request_id,
            seq=stream.seq,
            token_ids=[] if out.token_id is None else [out.token_id],
            text=out.text_delta,
            finished=out.finished,
            finish_reason=_openai_reason(out.finish_reason) if out.finished else None,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.completion_tokens,
            cached_tokens=stream.reused_tokens,
            index=out.index,
            attempt=stream.attempt,
            logprobs=[out.logprob] if out.logprob is not None else [],
        )
        stream.seq += 1
        await self.emit(stream.request_id, stream.subject, chunk)

    async def _send_prompt_logprobs(self, stream: Stream) -> None:
        """The prompt's logprobs, ahead of the stream's first token: chunks without
        tokens, of at most `PROMPT_LOGPROBS_PER_CHUNK` entries each (a long prompt's
        would not fit one NATS message), numbered and kept for resends as any."""
        entries, stream.prompt_logprobs = stream.prompt_logprobs, []
        step = pr.PROMPT_LOGPROBS_PER_CHUNK
        for start in range(0, len(entries), step):
            chunk = pr.TokenChunk(
                request_id=stream.request_id,
                seq=stream.seq,
                prompt_tokens=stream.prompt_tokens,
                cached_tokens=stream.reused_tokens,
                attempt=stream.attempt,
                prompt_logprobs=entries[start : start + step],
            )
            stream.seq += 1
            await self.emit(stream.request_id, stream.subject, chunk)

    async def _end_stream(
        self, stream: Stream, *, error: str, status: int, reason: str = "error"
    ) -> None:
        chunk = pr.TokenChunk(
            request_id=stream.request_id,
            seq=stream.seq,
            finished=True,
            finish_reason="error",
            error=error,
            error_status=status,
            attempt=stream.attempt,
        )
        stream.seq += 1
        await self.emit(stream.request_id, stream.subject, chunk)
        await self._finish(stream, reason, error)

    async def _finish(self, stream: Stream, reason: str, error: str) -> None:
        self._streams.pop(stream.request_id, None)
        self.history.finish(stream.request_id)
        span = stream.span
        if span.is_recording():
            stream.phase_span.end()
            span.set_attributes(
                {
                    "yb.completion_tokens": stream.completion_tokens,
                    "yb.finish_reason": reason,
                }
            )
            if error:
                span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        outcome: ev.RequestOutcome = (
            "cancelled" if reason == "abort" else "failed" if error else "completed"
        )
        self.metrics.requests.labels(outcome).inc()
        ttft = stream.first_token_at - stream.ttft_started if stream.ttft_started else 0.0
        self.log_event(
            ev.RequestFinished(
                request_id=stream.request_id,
                instance_id=self.instance_id,
                outcome=outcome,
                reason=error or reason,
                prompt_tokens=stream.prompt_tokens,
                output_tokens=stream.completion_tokens,
                ttft_s=max(0.0, ttft),
                tbt_mean_s=sum(stream.gaps) / len(stream.gaps) if stream.gaps else 0.0,
                attempt=stream.attempt,
            )
        )

    def log_event(self, event: ev.AnyEvent) -> None:
        self.outbox.put(event)

    def load_report(self) -> ev.LoadReport:
        batcher = self.batcher
        allocator = self.engine.allocator
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="decode",
            queued_requests=len(self._pending)
            + len(self._page_queue)
            + len(self.piggy.loading)
            + batcher.num_waiting
            + batcher.num_prefilling,
            running_requests=batcher.num_running,
            kv_used_blocks=allocator.num_used,
            kv_total_blocks=self.engine.cache.num_pages,
            last_step_s=batcher.last_step_seconds,
        )


def uploads_yield(free_pages: int, running: int) -> bool:
    """Whether the blocks kept for the pool should give their pages back: when the
    free pages could not give each of the `running` requests the page its next token
    may need (the batch ends the newest one when a page is missing)."""
    return free_pages < running


def _step(batcher: DecodeBatcher) -> tuple[list[TokenOutput], dict[str, dict[int, int]]]:
    """Engine thread: one step, and the pages of the piggybacked prompts it computed
    that are kept for their upload (`DecodeBatcher.take_kept`): handed over in the
    same call, so none is left without an owner."""
    return batcher.step(), batcher.take_kept()


def _new_stream(
    name: str, context: Context, started_ns: int, *, max_tokens: int, **fields: Any
) -> Stream:
    """A stream with its span (`name`, a child of `context`) and the span of its wait
    for the first token, both opened at `started_ns`."""
    span = _tracer.start_span(
        name, context=context, kind=trace.SpanKind.CONSUMER, start_time=started_ns
    )
    phase_span: trace.Span = trace.INVALID_SPAN
    if span.is_recording():
        span.set_attributes(
            {
                "yb.request_id": fields["request_id"],
                "yb.prompt_tokens": fields["prompt_tokens"],
                "yb.reused_tokens": fields["reused_tokens"],
                "yb.max_tokens": max_tokens,
            }
        )
        phase_span = _tracer.start_span(
            "decode first token", context=trace.set_span_in_context(span), start_time=started_ns
        )
    return Stream(span=span, phase_span=phase_span, **fields)


def _stream_phase(stream: Stream, first_token_at: float) -> None:
    """The first token is out (at `first_token_at`, wall clock): its wait ends, the
    stream's span begins."""
    at_ns = int(first_token_at * 1e9)
    stream.phase_span.end(end_time=at_ns)
    stream.phase_span = _tracer.start_span(
        "decode stream", context=trace.set_span_in_context(stream.span), start_time=at_ns
    )


def _reserve_attributes(reserve: pr.ReserveKV, reply: pr.DecodeReply) -> dict[str, AttributeValue]:
    """What a trace shows of a reservation: the request's size and the answer."""
    attributes: dict[str, AttributeValue] = {
        "yb.request_id": reserve.request_id,
        "yb.prefill_instance": reserve.prefill_instance,
        "yb.prompt_tokens": reserve.num_tokens,
    }
    match reply:
        case pr.KVReserved():
            attributes["yb.pages"] = reply.num_pages
            attributes["yb.page_bytes"] = reply.page_nbytes
            attributes["yb.layers"] = reply.num_layers
        case pr.ReserveRefused():
            attributes["yb.refused"] = reply.reason
    return attributes


def _openai_reason(reason: str | None) -> str:
    # OpenAI knows "stop" and "length"; a request cut for lack of KV ends by length.
    match reason:
        case "stop" | None:
            return "stop"
        case "length" | "kv_exhausted":
            return "length"
        case other:
            return other
