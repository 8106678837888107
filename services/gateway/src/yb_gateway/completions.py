"""The two generation endpoints: validate, admit, then stream or collect the answer.

A request's steps, and why they are ordered so:

1. Parse and check everything that needs no cluster (fields unknown or not
   implemented, which the decoder refuses; the model; limits after tokenizing), so a
   bad request costs no event in the log.
2. `RequestSession.start()` — admission, decision, hand-off — runs before any byte of
   the response, so rejection and unavailability are real status codes even for
   `stream: true`. The client may hang up meanwhile: the wait races the connection.
3. Streaming: litestar's `Stream` iterates `_sse`; when the client disconnects it
   cancels the iteration and `_sse`'s `finally` releases the session (which cancels
   the request on the bus). Non-streaming: the collection races the connection too.
   A client too slow to read its answer is disconnected by the connection's stall
   deadline (`yb_gateway.slow_clients`) and ends the same way; the reason it was
   dropped is noted in the request's state and becomes the cancel's reason.

In every case the session is released exactly once and the request is counted once
in `yb_gateway_requests_total`; a completed one also gets its SLO verdict from the
times its token chunks went to the client (`metrics.RequestTiming`), and a refused
one (429, 503) is counted by its error code.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry.context import Context

from yb_core.config import YbConfig
from yb_core.telemetry import bind_request, extract_context, get_logger
from yb_gateway.choices import Choices
from yb_gateway.errors import ApiError, unavailable
from yb_gateway.metrics import CLIENT_CLOSED, GatewayMetrics, RequestTiming
from yb_gateway.prompt import PreparedRequest, PromptEncoder, check_common, prepare
from yb_gateway.render import SSE_DONE, ChatFormat, ResponseFormat, TextFormat, sse_error
from yb_gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from yb_gateway.session import RequestSession, StreamError
from yb_gateway.slow_clients import DROPPED_STATE_KEY

log = get_logger(__name__)

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    # Once the body has been read, the ASGI server answers `receive()` only when the
    # connection closes (uvicorn returns `http.disconnect`).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client disconnects first (then cancel it and raise)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
        gone_task.cancel()
        await asyncio.gather(gone_task, return_exceptions=True)
    if work_task in done:
        return work_task.result()
    raise ClientDisconnected


@dataclass(eq=False)
class _Exchange:
    """One request between admission and its last byte; settled exactly once."""

    session: RequestSession
    fmt: ResponseFormat
    choices: Choices
    # The request's scope state: where the connection notes that it dropped a slow
    # client (`slow_clients.DROPPED_STATE_KEY`).
    state: dict[str, Any]
    # When its token chunks went out, for its SLO verdict.
    timing: RequestTiming
    settled: bool = False


class RequestSessions(Protocol):
    """What the generation endpoints ask of their gateway: the tokenizer, once loaded,
    and a session on the bus for each request they admit, released exactly once."""

    @property
    def encoder(self) -> PromptEncoder | None:
        """The tokenizer; None while it loads or after its load failed."""
        ...

    @property
    def encoder_state(self) -> str:
        """Why `encoder` is None ("loading", "failed: ..."), or "loaded"."""
        ...

    async def wait_for_bus(self) -> None:
        """Return once the bus can take a request, or its grace period is over."""
        ...

    def open_session(
        self,
        request_id: str,
        endpoint: str,
        prepared: PreparedRequest,
        arrived: float,
        trace_parent: Context | None = None,
    ) -> RequestSession:
        """A session for an admitted request; an `ApiError` (503) if none can open."""
        ...

    async def release(self, session: RequestSession, reason: str) -> None:
        """Close `session`, cancelling it on the bus if it is unfinished."""
        ...


class CompletionsEndpoint:
    """Serves `/v1/chat/completions` and `/v1/completions` for one gateway, counting
    every request once in `metrics`."""

    def __init__(self, sessions: RequestSessions, cfg: YbConfig, metrics: GatewayMetrics) -> None:
        self._sessions = sessions
        self._cfg = cfg
        self._metrics = metrics

    async def chat(
        self, request: Request[Any, Any, Any], body: ChatCompletionRequest
    ) -> Response[Any]:
        """A chat completion (streamed or not)."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(request_id, self._cfg.model.name)
        return await self._serve(request, body, fmt, "chat.completions")

    async def complete(
        self, request: Request[Any, Any, Any], body: CompletionRequest
    ) -> Response[Any]:
        """A text completion (streamed or not)."""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        fmt = TextFormat(request_id, self._cfg.model.name)
        return await self._serve(request, body, fmt, "completions")

    async def _serve(
        self,
        request: Request[Any, Any, Any],
        body: ChatCompletionRequest | CompletionRequest,
        fmt: ResponseFormat,
        endpoint: str,
    ) -> Response[Any]:
        sessions, cfg, metrics = self._sessions, self._cfg, self._metrics
        arrived = time.monotonic()
        request_id = fmt.request_id
        request.state.request_id = request_id
        metrics.in_flight.inc()
        with bind_request(request_id):
            try:
                check_common(body, cfg.model.name)
                encoder = sessions.encoder
                if encoder is None:
                    raise unavailable(
                        f"The tokenizer is not loaded ({sessions.encoder_state}).",
                        code="tokenizer_not_ready",
                    )
                prepared = await prepare(body, encoder, cfg.model, cfg.gateway)
                fmt.prepared(prepared.sampling.logprobs, encoder.tokens, prepared.echo)
                await sessions.wait_for_bus()
                session = sessions.open_session(
                    request_id,
                    endpoint,
                    prepared,
                    arrived,
                    trace_parent=extract_context(dict(request.headers)),
                )
            except BaseException as exc:
                # Nothing reached the bus: only the books need settling.
                metrics.in_flight.dec()
                if isinstance(exc, ApiError):
                    metrics.finished(exc.status, exc.code)
                else:
                    metrics.finished(500)
                _tag(exc, request_id)
                raise
            log.info(
                "request_admitting",
                endpoint=endpoint,
                prompt_tokens=len(prepared.token_ids),
                max_tokens=prepared.max_tokens,
                stream=prepared.stream,
                user=body.user,
            )
            exchange = _Exchange(
                session,
                fmt,
                Choices(prepared.n, prepared.output.tools),
                request.scope.setdefault("state", {}),
                RequestTiming(arrived),
            )
            try:
                await until_disconnect(request, session.start())
                if prepared.stream:
                    return Stream(
                        self._sse(exchange),
                        media_type="text/event-stream",
                        headers={**SSE_HEADERS, "X-Request-Id": request_id},
                        # Runs after the response even when the client left before the
                        # body was iterated (then `_sse` never starts, so its `finally`
                        # cannot be the only place that settles).
                        background=BackgroundTask(
                            self._settle, exchange, CLIENT_CLOSED, "client disconnected"
                        ),
                    )
                await until_disconnect(request, _collect(exchange))
            except ClientDisconnected:
                await self._settle(exchange, CLIENT_CLOSED, "client disconnected")
                return Response(b"", status_code=CLIENT_CLOSED)
            except StreamError as exc:
                await self._settle(exchange, exc.status, exc.message)
                raise _tag(exc.api_error(), request_id) from exc
            except ApiError as exc:
                await self._settle(exchange, exc.status, exc.message, exc.code)
                _tag(exc, request_id)
                raise
            except BaseException as exc:
                await self._settle(exchange, 500, f"gateway error: {exc!r}")
                raise
            await self._settle(exchange, 200, "")
            return Response(
                fmt.whole(exchange.choices.states, session.finish_reason, _usage(exchange)),
                media_type="application/json",
                headers={"X-Request-Id": request_id},
            )

    async def _settle(
        self, exchange: _Exchange, status: int, reason: str, code: str | None = None
    ) -> None:
        """Count the request once and release its session (cancelling it if unfinished)."""
        if exchange.settled:
            return
        exchange.settled = True
        if status == CLIENT_CLOSED and (dropped := exchange.state.get(DROPPED_STATE_KEY)):
            reason = f"client dropped: {dropped}"
        self._metrics.in_flight.dec()
        self._metrics.finished(status, code)
        session = exchange.session
        if status == 200:
            gcfg = self._cfg.gateway
            self._metrics.completed(
                exchange.timing,
                prompt_tokens=session.prompt_tokens,
                cached_tokens=session.cached_tokens,
                ttft_slo_s=gcfg.ttft_slo_s,
                tbt_slo_s=gcfg.tbt_slo_s,
            )
        log.info(
            "request_finished",
            request_id=session.request_id,
            status=status,
            reason=reason or None,
            prompt_tokens=session.prompt_tokens,
            completion_tokens=session.completion_tokens,
            cached_tokens=session.cached_tokens,
        )
        await self._sessions.release(session, reason)

    async def _sse(self, exchange: _Exchange) -> AsyncIterator[bytes]:
        """The SSE body. Ends the exchange on every way out: completion, a broken
        stream, or the client leaving (litestar cancels the iteration)."""
        session, fmt, choices = exchange.session, exchange.fmt, exchange.choices
        continuous = session.prepared.continuous_usage
        status, reason = CLIENT_CLOSED, "client disconnected"
        try:
            if (opening := fmt.opening(len(choices.states))) is not None:
                yield opening
            # The frame of the stream's last chunk: it goes out with the closing frames
            # in one write (nothing is left to wait for once that chunk came), not one
            # write (and one ASGI message) each.
            last = b""
            async for chunk in session.chunks():
                if DROPPED_STATE_KEY in exchange.state:
                    # The connection was dropped: uvicorn now accepts every write
                    # without waiting, so chunks already queued would run the stream
                    # to its end as if delivered. It ends here, cancelled.
                    return
                if chunk.token_ids or chunk.text:
                    exchange.timing.token(time.monotonic())
                update = choices.add(chunk)
                if not update.empty:
                    frame = fmt.delta(update, _usage(exchange) if continuous else None)
                    if session.ended:
                        last = frame
                    else:
                        yield frame
            # Generation is complete: a client leaving during the last frames is not
            # a cancelled request.
            status, reason = 200, ""
            frames = [last]
            for state in choices.states:
                finish = state.finish_reason(session.finish_reason)
                frames.append(
                    fmt.closing(state.index, finish, _usage(exchange) if continuous else None)
                )
            if session.prepared.include_usage:
                frames.append(fmt.usage_frame(_usage(exchange)))
            frames.append(SSE_DONE)
            yield b"".join(frames)
        except StreamError as exc:
            # The 200 has gone out: the error travels in the stream, which still ends
            # with [DONE] so that clients waiting for it stop reading.
            log.warning("stream_failed", request_id=session.request_id, error=exc.message)
            status, reason = exc.status, exc.message
            yield sse_error(exc.body())
            yield SSE_DONE
        finally:
            await self._settle(exchange, status, reason)


def _tag(exc: BaseException, request_id: str) -> BaseException:
    # Error answers carry the request id too, so a client can quote it.
    if isinstance(exc, ApiError):
        exc.headers.setdefault("X-Request-Id", request_id)
    return exc


async def _collect(exchange: _Exchange) -> None:
    async for chunk in exchange.session.chunks():
        if chunk.token_ids or chunk.text:
            exchange.timing.token(time.monotonic())
        exchange.choices.add(chunk)


def _usage(exchange: _Exchange) -> Usage:
    """The request's counts: its prompt once, the completion tokens of all choices."""
    session = exchange.session
    completion = exchange.choices.completion_tokens
    return Usage(
        prompt_tokens=session.prompt_tokens,
        completion_tokens=completion,
        total_tokens=session.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=session.cached_tokens),
    )
