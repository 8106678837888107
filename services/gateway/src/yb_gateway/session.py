"""One request's life on the bus: admit, wait for the decision, hand off, relay tokens.

`RequestSession` is the only place that talks to the cluster for a request:

1. `start()` publishes `RequestAdmitted`, waits (bounded) for the conductor's
   decision, routes the request's token subject to itself (`TokenRoutes`: the gateway
   has one subscription for all of them) and hands the `PrefillJob` to
   the chosen prefill instance. Everything that can fail here fails before the HTTP
   response has started, so it becomes a proper status code (429, 503).
2. `chunks()` yields the decode instance's `TokenChunk`s in order, each wait bounded
   (first token, then between tokens, never past the request's deadline), and turns
   an engine error or a timeout into `StreamError`. Chunks are core NATS messages and
   may be lost (while this gateway moves to another NATS node): on a gap in `seq`,
   after a reconnect (`bus_reconnected()`) and when the stream goes quiet, the
   session asks the decode instance to publish them again (`yb_gateway.recovery`),
   and only a gap that cannot be filled ends the stream with `token_stream_gap`.
3. `close()` always runs (the endpoint guarantees it even when the client vanished):
   it stops routing its tokens and, when the request did not finish on its own, publishes
   `RequestCancelled` so every engine frees it. It never raises.

`abort()` is how a stopping gateway ends the session from outside: whatever the
session waits for is interrupted with a 503. `instance_down()` is how it learns that
an engine the request depends on was declared dead (the decode instance, or the
prefill instance while no token of the current attempt has come yet).

Re-plans. When such an engine is declared dead, or an engine ends the stream with a
503 (a KV transfer that broke, an engine shutting down), and the request has re-plans
left (`gateway.replan_budget`, default 1), the stream does not end: the session logs
`RequestReplanned` (attempt k, the failed instance, the block hashes of the prompt
plus the tokens the client already received, what is left to generate), waits for
the conductor's decision for attempt k and hands a `PrefillJob` with those tokens
(`generated_tokens` of them output already) to the new prefill instance. Each attempt
streams to a token subject of its own, from seq 0: what an older attempt still sends
is never read, so no token is lost or repeated. Without re-plans left, or for a
request of `n` > 1 choices (whose choices' tokens cannot continue as one prompt), the
stream ends with a 503 at once rather than at the token timeout, and `close()`
cancels it everywhere. A stream ends when all `n` choices have finished.

A piggybacked decision (`RequestScheduled.piggyback`) names the decode instance as
its prefill instance too. Nothing changes here: the job goes to that instance's
prefill job subject, its death is a decode instance's at any point of the stream
(`instance_down` tests the decode instance first), an engine error before the first
token blames it as the prefill side, and resends and cancels go where they go for
any request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from yb_core import events as ev
from yb_core import protocol
from yb_core.bus import Bus, BusError, BusUnavailable
from yb_core.config import YbConfig
from yb_core.hashing import block_hashes
from yb_core.model_files import identity_of
from yb_core.telemetry import child_span, get_logger, inject_headers, tracer, wall_time_ns
from yb_gateway.decisions import DecisionRouter
from yb_gateway.errors import ApiError, rejected, unavailable
from yb_gateway.metrics import GatewayMetrics
from yb_gateway.prompt import PreparedRequest
from yb_gateway.recovery import RESEND_TIMEOUT_S, StreamRecovery
from yb_gateway.schemas import ErrorBody, ErrorDetail, PromptTokensDetails, Usage
from yb_gateway.token_routes import TokenRoutes

log = get_logger(__name__)
_tracer = tracer(__name__)


class _Refused(Exception):
    """An engine refused a first attempt's job and said another may take it (it is
    draining); `start` re-plans the request around it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StreamError(Exception):
    """The token stream ended abnormally; `status` is what a client is told."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def body(self) -> ErrorBody:
        """The OpenAI error object for an SSE error event."""
        kind = "service_unavailable_error" if self.status == 503 else "server_error"
        return ErrorBody(
            error=ErrorDetail(message=self.message, type=kind, param=None, code=self.code)
        )

    def api_error(self) -> ApiError:
        """The same error as a plain HTTP answer (non-streaming requests)."""
        kind = "service_unavailable_error" if self.status == 503 else "server_error"
        return ApiError(self.status, self.message, type=kind, code=self.code)


class _Abort:
    """Queued to wake a session that the gateway ends from outside."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _EngineLost:
    """Queued when an engine that attempt `attempt` depends on is declared dead."""

    __slots__ = ("attempt", "instance_id", "message", "role")

    def __init__(self, role: str, instance_id: str, attempt: int, message: str) -> None:
        self.role = role
        self.instance_id = instance_id
        self.attempt = attempt
        self.message = message


class _Tokens:
    """Queued for each message on an attempt's token subject."""

    __slots__ = ("attempt", "data")

    def __init__(self, attempt: int, data: bytes) -> None:
        self.attempt = attempt
        self.data = data


class _Reconnected:
    """Queued when the bus reconnected: chunks sent meanwhile may be lost."""

    __slots__ = ()


class _ResendAnswer:
    """Queued when resend request number `ask` is over: the decode instance's answer
    (None when it did not answer) and why not."""

    __slots__ = ("ask", "error", "reply")

    def __init__(self, ask: int, reply: protocol.TokensResent | None, error: str) -> None:
        self.ask = ask
        self.reply = reply
        self.error = error


_Item = _Tokens | _Abort | _EngineLost | _Reconnected | _ResendAnswer


class RequestSession:
    """One admitted request, from `RequestAdmitted` to its last token."""

    def __init__(
        self,
        *,
        request_id: str,
        endpoint: str,
        prepared: PreparedRequest,
        bus: Bus,
        gateway_id: str,
        cfg: YbConfig,
        router: DecisionRouter,
        tokens: TokenRoutes,
        metrics: GatewayMetrics,
        arrived: float,
        trace_parent: Context | None = None,
    ) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self._bus = bus
        self._gateway_id = gateway_id
        self._cfg = cfg
        self._router = router
        self._tokens = tokens
        self._metrics = metrics
        # Latencies are observed by tier (a configured, bounded set).
        self._ttft = metrics.ttft.labels(prepared.tier.name)
        self._inter_token = metrics.inter_token.labels(prepared.tier.name)
        self._arrived = arrived  # monotonic
        self._deadline = arrived + cfg.gateway.request_timeout_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        # The one resend request in flight, and those let go (cancelled by a
        # reconnect) that have not ended yet: owned here, awaited by `close()`.
        self._resend: asyncio.Task[None] | None = None
        self._ending_resends: set[asyncio.Task[None]] = set()
        self._asks = 0  # numbers resend requests: a superseded one's answer is ignored
        self._decision_future: asyncio.Future[ev.Decision] | None = None
        self._stream_subject: str | None = None  # routed to this session's queue
        self._aborted: str | None = None
        self._admitted = False
        self._ended = False  # finished on its own: nobody needs to be told to cancel
        self._closed = False
        self._last_token_at: float | None = None
        self.decision: ev.RequestScheduled | None = None
        # Re-plans: the attempt streaming now, how many more may follow, the token ids
        # the client has received (in order: what a re-plan's prompt continues with),
        # and whether the current attempt has sent a token yet.
        self.attempt = 0
        self.replans_left = cfg.gateway.replan_budget
        self.received: list[int] = []
        self._attempt_streaming = False
        self._finished_choices: set[int] = set()
        # Computed once: the same keys go to the conductor and to the prefill engine.
        self.block_hashes = block_hashes(
            prepared.token_ids, cfg.model.block_size, identity_of(cfg.model, cfg.model_cache_dir())
        )
        self.prompt_tokens = len(prepared.token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = "stop"
        # The request's span: the root of its trace, or a child of the client's own
        # when it sent a `traceparent`. It opens at the request's arrival, so that
        # the tokenization done before this session existed shows under it.
        arrived_ns = wall_time_ns(arrived)
        self.span = _tracer.start_span(
            f"gateway {endpoint}",
            context=trace_parent,
            kind=trace.SpanKind.SERVER,
            start_time=arrived_ns,
        )
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    "yb.request_id": request_id,
                    "yb.prompt_tokens": self.prompt_tokens,
                    "yb.max_tokens": prepared.max_tokens,
                }
            )
            # Validation, chat template, tokenization and block hashes: from arrival
            # to now.
            _tracer.start_span(
                "gateway tokenize",
                context=trace.set_span_in_context(self.span),
                start_time=arrived_ns,
                attributes={"yb.prompt_tokens": self.prompt_tokens},
            ).end()

    @property
    def ended(self) -> bool:
        """Whether the request finished on its own: every choice's last chunk came (in
        `chunks()`, the chunk just yielded was the stream's last)."""
        return self._ended

    # --- admission and hand-off -----------------------------------------------------

    async def start(self) -> None:
        """Admit, wait for the decision, send the job; raises `ApiError` on failure."""
        gcfg = self._cfg.gateway
        span = self.span
        with trace.use_span(span, end_on_exit=False):
            # The admission's context rides with `RequestAdmitted` in the log: the
            # conductor's decision span is its child.
            with child_span(_tracer, "gateway admission") as admission:
                decision = await self._decide(gcfg.decision_timeout_s)
                if admission.is_recording():
                    admission.set_attribute(
                        "yb.decision",
                        "rejected" if isinstance(decision, ev.RequestRejected) else "scheduled",
                    )
            match decision:
                case ev.RequestRejected():
                    # The conductor dropped it already: nothing to cancel.
                    self._ended = True
                    span.set_attribute("yb.rejected", decision.reason)
                    raise rejected(decision.reason, decision.retry_after_s)
                case ev.RequestScheduled():
                    self.decision = decision
                    if span.is_recording():
                        span.set_attributes(
                            {
                                "yb.prefill_instance": decision.prefill_instance,
                                "yb.decode_instance": decision.decode_instance,
                                "yb.reused_blocks": decision.reused_blocks,
                            }
                        )
            # The job carries the hand-off's context: prefill's spans are its children.
            with child_span(_tracer, "gateway hand-off") as hand_off:
                if hand_off.is_recording():
                    hand_off.set_attribute("yb.prefill_instance", decision.prefill_instance)
                try:
                    await self._hand_off(decision, gcfg.job_timeout_s)
                except _Refused as refused:
                    # The engine is draining (it was told to stop after the decision
                    # was made): re-plan around it rather than fail the request.
                    try:
                        await self._continue(refused.reason, decision.prefill_instance)
                    except StreamError as exc:
                        raise exc.api_error() from exc

    async def _decide(
        self, timeout_s: float, event: ev.RequestAdmitted | ev.RequestReplanned | None = None
    ) -> ev.Decision:
        """Log the admission (or `event`, a re-plan) and wait for the conductor's
        decision on the current attempt."""
        if self._aborted is not None:
            raise unavailable(self._aborted, code="shutting_down")
        cfg = self._cfg
        prepared = self.prepared
        if event is None:
            event = ev.RequestAdmitted(
                request_id=self.request_id,
                gateway_id=self._gateway_id,
                model=cfg.model.name,
                block_size=cfg.model.block_size,
                block_hashes=self.block_hashes,
                prompt_tokens=len(prepared.token_ids),
                max_tokens=prepared.max_tokens,
                priority=prepared.tier.priority,
                slo=prepared.tier.slo,
                deadline=time.time() + cfg.gateway.request_timeout_s,
                prompt_logprobs=prepared.sampling.prompt_logprobs is not None,
                service_tier=prepared.tier.name,
                batch=prepared.batch,
                batch_deadline=prepared.batch_deadline,
            )
        # Registered before publishing: a fast conductor may answer before `publish`
        # returns.
        self._decision_future = future = self._router.expect(self.request_id)
        until = time.monotonic() + timeout_s
        try:
            try:
                await self._bus.publish(event, timeout_s=min(cfg.nats.request_timeout_s, timeout_s))
            except BusUnavailable as exc:
                raise unavailable(
                    f"The event bus is unavailable: {exc}", code="bus_unavailable"
                ) from exc
            self._admitted = True
            while True:
                try:
                    decision = await asyncio.wait_for(
                        future, timeout=max(0.001, until - time.monotonic())
                    )
                except TimeoutError as exc:
                    raise unavailable(
                        f"No scheduling decision within decision_timeout_s={timeout_s:g}s.",
                        code="decision_timeout",
                    ) from exc
                if decision.attempt == self.attempt:
                    return decision
                # An earlier attempt's decision read again (the consumer reset itself).
                self._decision_future = future = self._router.expect(self.request_id)
        finally:
            self._router.forget(self.request_id)
            self._decision_future = None

    async def _hand_off(
        self,
        decision: ev.RequestScheduled,
        timeout_s: float,
        token_ids: list[int] | None = None,
        hashes: list[int] | None = None,
    ) -> None:
        attempt = self.attempt
        # One subject per attempt: what an older attempt still sends is never read.
        stream_id = self.request_id if not attempt else f"{self.request_id}-{attempt}"
        subject = protocol.token_subject(self._gateway_id, stream_id)

        def on_tokens(data: bytes) -> None:
            # Decoding is left to the consumer so that a bad payload surfaces as an
            # error in stream order.
            self._queue.put_nowait(_Tokens(attempt, data))

        # Routed before the job leaves (the gateway's subscription to every token
        # subject of its own exists since it connected), so no chunk arrives unrouted.
        self._tokens.route(subject, on_tokens)
        self._stream_subject = subject
        sampling = self.prepared.sampling
        if self.received and sampling.prompt_logprobs is not None:
            # The client has the prompt's logprobs (they come before its first token);
            # a re-plan's prompt goes on with output, whose logprobs it has too.
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        job = protocol.PrefillJob(
            request_id=self.request_id,
            token_ids=self.prepared.token_ids if token_ids is None else token_ids,
            block_hashes=self.block_hashes if hashes is None else hashes,
            sampling=sampling,
            decision=decision,
            token_subject=subject,
            deadline=time.time() + max(0.0, self._deadline - time.monotonic()),
            trace_headers=inject_headers(),
            priority=self.prepared.priority,
            attempt=attempt,
            generated_tokens=len(self.received) if attempt else 0,
            preemptible=self.prepared.batch,
        )
        # A piggybacked decision names the decode instance as its prefill instance too:
        # it takes the job on its prefill job subject, exactly as a prefill would.
        instance = decision.prefill_instance
        who = f"{'Decode' if decision.piggyback else 'Prefill'} instance {instance}"
        try:
            msg = await self._bus.request(
                protocol.prefill_job_subject(instance), protocol.encode(job), timeout_s=timeout_s
            )
            reply = protocol.job_reply_decoder.decode(msg.data)
        except BusUnavailable as exc:
            reason, code = f"{who} did not take the job: {exc}", "no_engine"
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reason, code = f"{who} sent an unreadable reply: {exc}", "no_engine"
        else:
            match reply:
                case protocol.JobAccepted():
                    return
                case protocol.JobRefused():
                    reason = f"{who} refused the job: {reply.reason}"
                    code = "job_refused"
                    if reply.retryable and not attempt and self._can_replan():
                        # Nothing streams yet: `start` re-plans it.
                        raise _Refused(reason)
                    # Nobody holds the request: the failure needs no cancel after it.
                    self._ended = True
        # Without a reply the job may still have arrived: `close()` will also publish
        # a cancel, so a late-starting engine drops it.
        await self._publish_failed(reason)
        raise unavailable(reason, code=code)

    # --- the token stream -----------------------------------------------------------

    async def chunks(self) -> AsyncIterator[protocol.TokenChunk]:
        """The request's token chunks in order, up to and including the finished one.

        Chunks that arrive ahead of a missing one are held, duplicates dropped, and
        the decode instance is asked for what is missing (see `yb_gateway.recovery`)
        while the first-token or between-token timeout and the deadline run.
        """
        gcfg = self._cfg.gateway
        delivered_at = time.monotonic()  # the idle timeouts run from the last chunk out
        order = StreamRecovery(delivered_at)
        try:
            while True:
                now = time.monotonic()
                while (chunk := order.next_ready(now)) is not None:
                    delivered_at = now
                    if chunk.error:
                        failed = self._replan_cause(chunk)
                        if failed is None:
                            self._account(chunk)
                            raise StreamError(
                                chunk.error_status or 502, chunk.error, code="engine_error"
                            )
                        order = await self._continue(chunk.error, failed)
                        delivered_at = now = time.monotonic()
                        continue
                    self._account(chunk)
                    if chunk.finished:
                        self._finished_choices.add(chunk.index)
                        if len(self._finished_choices) >= self.prepared.sampling.n:
                            self._ended = True
                        self.finish_reason = chunk.finish_reason or "stop"
                    yield chunk
                    if self._ended:
                        return
                    now = time.monotonic()
                if order.given_up(now):
                    raise self._gap_error(order, "no resend filled it in time")
                if self._resend is None and (trigger := order.due(now)) is not None:
                    self._ask_resend(order.asking(now), trigger)
                idle_s = (
                    gcfg.first_token_timeout_s if order.expected == 0 else gcfg.token_idle_timeout_s
                )
                idle_left = delivered_at + idle_s - now
                left_s = self._deadline - now
                if idle_left <= 0 or left_s <= 0:
                    if order.gap:
                        raise self._gap_error(order, "no resend filled it in time")
                    raise self._timeout_error(order.expected, idle_s, idle_left, left_s)
                wait_s = min(
                    idle_left, left_s, order.seconds_to_next(now, asking=self._resend is not None)
                )
                try:
                    # Never 0: `wait_for` would not even look at a waiting item then.
                    item = await asyncio.wait_for(self._queue.get(), timeout=max(wait_s, 0.001))
                except TimeoutError:
                    continue  # something is due: the loop's top decides what
                now = time.monotonic()
                match item:
                    case _Tokens() if item.attempt == self.attempt:
                        try:
                            chunk = protocol.token_decoder.decode(item.data)
                        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                            raise StreamError(
                                502, f"Unreadable token chunk: {exc}", code="bad_chunk"
                            ) from exc
                        order.add(chunk, now)
                    case _Tokens():
                        pass  # queued by an attempt given up since
                    case _ResendAnswer() if item.ask == self._asks:
                        self._resend_over()
                        if item.reply is None:
                            log.info(
                                "resend_unanswered", request_id=self.request_id, error=item.error
                            )
                        if why := order.answered(item.reply, now):
                            raise self._gap_error(order, why)
                    case _ResendAnswer():
                        pass  # asked before a reconnect, and asked again since
                    case _Reconnected():
                        # A request sent before the reconnect may be lost with it.
                        self._cancel_resend()
                        order.reconnected(now)
                    case _Abort():
                        raise StreamError(503, item.reason, code="shutting_down")
                    case _EngineLost() if item.attempt != self.attempt:
                        pass  # about an attempt given up since
                    case _EngineLost():
                        if item.role == "prefill" and self._attempt_streaming:
                            continue  # its work was done: decode has the request
                        if not self._can_replan():
                            raise StreamError(503, item.message, code="engine_failed")
                        order = await self._continue(
                            f"{item.role} instance {item.instance_id} declared down",
                            item.instance_id,
                        )
                        delivered_at = time.monotonic()
        finally:
            self._cancel_resend()

    # --- re-plans -------------------------------------------------------------------

    def _can_replan(self) -> bool:
        return (
            self.replans_left > 0
            and self.decision is not None
            and self._aborted is None
            # n choices share one prompt: they cannot continue as one longer prompt.
            and self.prepared.sampling.n == 1
            and len(self.received) < self.prepared.max_tokens
        )

    def _replan_cause(self, chunk: protocol.TokenChunk) -> str | None:
        """The instance to blame when an error chunk may be re-planned around: a 503 is
        an engine's failure (a KV transfer that broke, an engine stopping), not the
        request's. The chunk names the instance when it knows (a decode instance that
        refused the prefill its pages); else, before the attempt's first token the KV
        never arrived (its prefill side failed), and after it, decode did. None: end
        the stream with the error."""
        decision = self.decision
        if chunk.error_status != 503 or decision is None or not self._can_replan():
            return None
        if chunk.failed_instance:
            return chunk.failed_instance
        return decision.decode_instance if self._attempt_streaming else decision.prefill_instance

    async def _continue(self, reason: str, failed_instance: str) -> StreamRecovery:
        """Re-plan the request (see the module docstring) and hand it to its new
        prefill instance; the new attempt's stream order. Raises `StreamError` when
        the conductor refuses the re-plan or no engine takes it."""
        self._cancel_resend()
        self._forget_stream()
        cfg, prepared = self._cfg, self.prepared
        self.replans_left -= 1
        self.attempt += 1
        self._attempt_streaming = False
        token_ids = [*prepared.token_ids, *self.received]
        hashes = block_hashes(
            token_ids, cfg.model.block_size, identity_of(cfg.model, cfg.model_cache_dir())
        )
        replan = ev.RequestReplanned(
            request_id=self.request_id,
            gateway_id=self._gateway_id,
            attempt=self.attempt,
            reason=reason,
            failed_instance=failed_instance,
            model=cfg.model.name,
            block_size=cfg.model.block_size,
            block_hashes=hashes,
            prompt_tokens=len(token_ids),
            generated_tokens=len(self.received),
            max_tokens=prepared.max_tokens - len(self.received),
            replans_left=self.replans_left,
            priority=prepared.tier.priority,
            slo=prepared.tier.slo,
            deadline=time.time() + max(0.0, self._deadline - time.monotonic()),
            service_tier=prepared.tier.name,
            batch=prepared.batch,
        )
        log.info(
            "request_replanned",
            request_id=self.request_id,
            attempt=self.attempt,
            failed_instance=failed_instance,
            generated_tokens=len(self.received),
            reason=reason,
        )
        self.span.add_event(
            "replanned",
            {"yb.attempt": self.attempt, "yb.failed_instance": failed_instance, "reason": reason},
        )
        gcfg = cfg.gateway
        try:
            with (
                trace.use_span(self.span, end_on_exit=False),
                child_span(_tracer, "gateway re-plan") as span,
            ):
                if span.is_recording():
                    span.set_attribute("yb.attempt", self.attempt)
                decision = await self._decide(gcfg.decision_timeout_s, replan)
                if isinstance(decision, ev.RequestRejected):
                    raise StreamError(
                        503,
                        f"The request's {reason}; its re-plan was refused: {decision.reason}.",
                        code="replan_rejected",
                    )
                self.decision = decision
                await self._hand_off(decision, gcfg.job_timeout_s, token_ids, hashes)
        except ApiError as exc:
            raise StreamError(
                exc.status, f"The request's {reason}; {exc.message}", code=exc.code or "no_engine"
            ) from exc
        return StreamRecovery(time.monotonic())

    def bus_reconnected(self) -> None:
        """The bus moved to another NATS node: chunks published meanwhile are lost,
        so the stream asks its decode instance for them."""
        if not self._ended and self._aborted is None:
            self._queue.put_nowait(_Reconnected())

    def _ask_resend(self, from_seq: int, trigger: str) -> None:
        decision = self.decision
        if decision is None:  # not handed off: nobody streams yet
            return
        self._metrics.resends.labels(trigger).inc()
        self._asks += 1
        self._resend = asyncio.create_task(
            self._request_resend(self._asks, decision.decode_instance, from_seq),
            name=f"resend:{self.request_id}",
        )

    async def _request_resend(self, ask_no: int, decode_instance: str, from_seq: int) -> None:
        ask = protocol.ResendTokens(request_id=self.request_id, from_seq=from_seq)
        timeout_s = max(0.05, min(RESEND_TIMEOUT_S, self._deadline - time.monotonic()))
        reply: protocol.TokensResent | None = None
        error = ""
        try:
            msg = await self._bus.request(
                protocol.resend_subject(decode_instance), protocol.encode(ask), timeout_s=timeout_s
            )
            reply = protocol.resend_reply_decoder.decode(msg.data)
        except BusUnavailable as exc:
            error = str(exc)
            await self._look_up_verdict(decode_instance)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = f"unreadable answer from {decode_instance}: {exc}"
        self._queue.put_nowait(_ResendAnswer(ask_no, reply, error))

    async def _look_up_verdict(self, instance_id: str) -> None:
        """Ask the log whether `instance_id`, silent to a resend, was declared dead.

        The gateway learns verdicts from its reader of the instance stream, but a reader
        whose consumer is being re-created (after a NATS node came back, say) gets them
        seconds late, and the conductor cancels an orphaned request that is not re-planned
        within its grace period. The lookup bounds that: a stream whose decode instance
        stopped answering learns of the verdict within one resend of its publication.
        """
        timeout_s = min(RESEND_TIMEOUT_S, self._deadline - time.monotonic())
        if timeout_s <= 0:
            return
        try:
            logged = await self._bus.last_event(
                ev.instance_down_subject(instance_id), timeout_s=timeout_s
            )
        except BusError as exc:
            log.info("verdict_lookup_failed", request_id=self.request_id, error=str(exc))
            return
        if logged is not None and isinstance(logged.event, ev.InstanceDown):
            self.instance_down(instance_id, logged.event.reason, logged.seq)

    def _resend_over(self) -> None:
        task, self._resend = self._resend, None
        if task is None:
            return
        if task.done():
            task.result()  # re-raises what the request did not expect
        else:
            self._let_end(task)  # its answer is queued: it ends in a moment

    def _cancel_resend(self) -> None:
        task, self._resend = self._resend, None
        if task is not None and not task.done():
            task.cancel()
            self._let_end(task)

    def _let_end(self, task: asyncio.Task[None]) -> None:
        # Awaited by `close()`, not here: an async generator's `finally` may run where
        # it cannot await (a client that vanished).
        self._ending_resends.add(task)
        task.add_done_callback(self._ending_resends.discard)

    def _gap_error(self, order: StreamRecovery, why: str) -> StreamError:
        got = f"got chunk {order.first_held}" if order.gap else "the stream went quiet"
        return StreamError(
            502,
            f"Token stream broken: expected chunk {order.expected}, {got}; {why}.",
            code="token_stream_gap",
        )

    def _account(self, chunk: protocol.TokenChunk) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            self._attempt_streaming = True
            if chunk.index == 0:
                self.received.extend(chunk.token_ids)
        if chunk.token_ids or chunk.text:
            if self._last_token_at is None:
                self._ttft.observe(now - self._arrived)
                self.span.add_event("first_token")
            else:
                self._inter_token.observe(now - self._last_token_at)
            self._last_token_at = now
        self.completion_tokens += len(chunk.token_ids)
        # The engine's own counts, when it sends them, are the authority.
        if chunk.completion_tokens:
            self.completion_tokens = chunk.completion_tokens
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)

    def _timeout_error(
        self, expected: int, idle_s: float, idle_left: float, left_s: float
    ) -> StreamError:
        if left_s <= idle_left:
            return StreamError(
                504,
                f"The request ran past request_timeout_s={self._cfg.gateway.request_timeout_s:g}s.",
                code="request_timeout",
            )
        if expected == 0:
            return StreamError(
                504,
                f"No first token within first_token_timeout_s={idle_s:g}s.",
                code="first_token_timeout",
            )
        return StreamError(
            504, f"No token for token_idle_timeout_s={idle_s:g}s.", code="token_timeout"
        )

    def usage(self) -> Usage:
        """Token counts so far (final once the stream finished)."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    # --- ending ---------------------------------------------------------------------

    def instance_down(self, instance_id: str, reason: str, verdict_seq: int = 0) -> None:
        """An instance was declared dead: end the stream if it needed that one.

        `verdict_seq` is the verdict's position in the log. A verdict logged before this
        request was admitted is not about it: the conductor folds the log in order, so
        it decided knowing the verdict, and placed the request on that instance only
        because it had announced itself again. Such a verdict reaches a gateway late
        whenever its reader of the instance stream restarts or lags (the stream keeps
        each instance's last verdict), and must not end a request it never concerned.
        """
        decision = self.decision
        if decision is None or self._ended or self._aborted is not None:
            return
        if 0 < verdict_seq < decision.admitted_seq:
            return
        if instance_id == decision.decode_instance:
            role = "decode"
        elif not self._attempt_streaming and (
            instance_id == decision.prefill_instance or instance_id in decision.prefill_stages
        ):
            # A prefill group needs every stage: any one lost ends the prefill.
            role = "prefill"
        else:
            return
        self.span.add_event("engine_lost", {"instance": instance_id, "reason": reason})
        self._queue.put_nowait(
            _EngineLost(
                role,
                instance_id,
                self.attempt,
                f"The {role} instance {instance_id} serving this request failed "
                f"({reason or 'down'}); the request was cancelled, retry it.",
            )
        )

    def abort(self, reason: str) -> None:
        """End the session from outside (gateway stopping); its waits fail with 503."""
        if self._aborted is not None:
            return
        self._aborted = reason
        future = self._decision_future
        if future is not None and not future.done():
            future.set_exception(unavailable(reason, code="shutting_down"))
        self._queue.put_nowait(_Abort(reason))

    def _forget_stream(self) -> None:
        """Stop routing the current attempt's token subject here."""
        if self._stream_subject is not None:
            self._tokens.forget(self._stream_subject)
            self._stream_subject = None

    async def close(self, reason: str) -> None:
        """Stop routing its tokens and, if the request is still running somewhere,
        cancel it.

        Idempotent and never raises: it runs on every path out of a request,
        including a client that vanished and a gateway that is stopping.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._router.forget(self.request_id)
            self._cancel_resend()
            if self._ending_resends:
                await asyncio.gather(*self._ending_resends, return_exceptions=True)
            self._forget_stream()
            if self._admitted and not self._ended:
                await self._publish(ev.RequestCancelled(request_id=self.request_id, reason=reason))
        except Exception as exc:  # a close that raises would leak the rest of the cleanup
            log.error("session_close_failed", request_id=self.request_id, error=repr(exc))
        finally:
            span = self.span
            if reason and not self._ended:
                span.set_status(Status(StatusCode.ERROR, reason))
            if span.is_recording():
                span.set_attributes(
                    {
                        "yb.completion_tokens": self.completion_tokens,
                        "yb.cached_tokens": self.cached_tokens,
                        "yb.finish_reason": self.finish_reason,
                    }
                )
            span.end()

    async def _publish_failed(self, reason: str) -> None:
        await self._publish(
            ev.RequestFinished(
                request_id=self.request_id,
                instance_id=self._gateway_id,
                outcome="failed",
                reason=reason,
                prompt_tokens=len(self.prepared.token_ids),
                attempt=self.attempt,
            )
        )

    async def _publish(self, event: Any) -> None:
        # Best effort with a short deadline: the request is over for the client either
        # way, and the conductor's heartbeat bookkeeping covers a lost event.
        if not self._bus.connected:
            log.warning(
                "event_not_published",
                request_id=self.request_id,
                event=type(event).__name__,
                reason="bus disconnected",
            )
            return
        try:
            await self._bus.publish(event, timeout_s=self._cfg.nats.request_timeout_s)
        except BusUnavailable as exc:
            log.warning(
                "event_not_published",
                request_id=self.request_id,
                event=type(event).__name__,
                reason=str(exc),
            )
