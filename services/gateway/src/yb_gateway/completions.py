"""The two generation endpoints over HTTP: the request path (`runner`) tied to a
connection.

The endpoints add to `RequestRunner` only what is HTTP's:

1. The request id is on the connection's state (error handlers quote it) and in the
   `X-Request-Id` header of every answer; the trace context comes from the headers.
2. The start (admission, decision, hand-off) runs before any byte of the response,
   so rejection and unavailability are real status codes even for `stream: true`.
   The client may hang up meanwhile: the wait races the connection.
3. Streaming: litestar's `Stream` iterates `RequestRunner.sse`; when the client
   disconnects it cancels the iteration and the iterator's `finally` settles the
   request (which cancels it on the bus). Non-streaming: the collection races the
   connection too. A client too slow to read its answer is disconnected by the
   connection's stall deadline (`yb_gateway.slow_clients`) and ends the same way; the
   reason it was dropped is noted in the request's state and becomes the cancel's
   reason.

In every case the request is settled exactly once (`RequestRunner.settle`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from yb_core.config import YbConfig
from yb_core.telemetry import bind_request, extract_context
from yb_gateway.errors import ApiError
from yb_gateway.metrics import CLIENT_CLOSED, GatewayMetrics
from yb_gateway.render import ChatFormat, ResponseFormat, TextFormat
from yb_gateway.runner import RequestRunner, RequestSessions, tag
from yb_gateway.schemas import ChatCompletionRequest, CompletionRequest
from yb_gateway.session import StreamError

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


class CompletionsEndpoint:
    """Serves `/v1/chat/completions` and `/v1/completions` for one gateway, counting
    every request once in `metrics`."""

    def __init__(self, sessions: RequestSessions, cfg: YbConfig, metrics: GatewayMetrics) -> None:
        self._cfg = cfg
        #: The request path, shared with the batch worker.
        self.runner = RequestRunner(sessions, cfg, metrics)

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
        runner = self.runner
        arrived = time.monotonic()
        request_id = fmt.request_id
        request.state.request_id = request_id
        with bind_request(request_id):
            exchange = await runner.admit(
                body,
                fmt,
                endpoint,
                arrived=arrived,
                state=request.scope.setdefault("state", {}),
                trace_parent=extract_context(dict(request.headers)),
            )
            try:
                await until_disconnect(request, runner.start(exchange))
                if exchange.sessions[0].prepared.stream:
                    return Stream(
                        runner.sse(exchange),
                        media_type="text/event-stream",
                        headers={**SSE_HEADERS, "X-Request-Id": request_id},
                        # Runs after the response even when the client left before the
                        # body was iterated (then `sse` never starts, so its `finally`
                        # cannot be the only place that settles).
                        background=BackgroundTask(
                            runner.settle, exchange, CLIENT_CLOSED, "client disconnected"
                        ),
                    )
                await until_disconnect(request, runner.collect(exchange))
            except ClientDisconnected:
                await runner.settle(exchange, CLIENT_CLOSED, "client disconnected")
                return Response(b"", status_code=CLIENT_CLOSED)
            except StreamError as exc:
                await runner.settle(exchange, exc.status, exc.message)
                raise tag(exc.api_error(), request_id) from exc
            except ApiError as exc:
                await runner.settle(exchange, exc.status, exc.message, exc.code)
                tag(exc, request_id)
                raise
            except BaseException as exc:
                await runner.settle(exchange, 500, f"gateway error: {exc!r}")
                raise
            await runner.settle(exchange, 200, "")
            return Response(
                runner.whole(exchange),
                media_type="application/json",
                headers={"X-Request-Id": request_id},
            )
