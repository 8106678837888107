"""One generation request from its body to its answer, with or without HTTP.

`RequestRunner` is the request path that the HTTP endpoints (`completions`) and the
batch worker (`batches`) share; what is HTTP's (the connection, its disconnect, the
response objects) stays with the endpoints. A request's steps, and why they are
ordered so:

1. `admit()`: parse and check everything that needs no cluster (the model; limits
   after tokenizing; the decoder refused unknown fields already), so a bad request
   costs no event in the log; then open a session per prompt on the bus. A failure
   here is counted and raised as an `ApiError`.
2. `start()`: admission, decision, hand-off for every session, before any byte of
   the answer, so rejection and unavailability are real status codes even for a
   stream.
3. `collect()` folds the whole answer (`whole()` renders it), or `sse()` streams it.
   `settle()` ends the request: it is released exactly once (which cancels it on the
   bus if unfinished) and counted once in `yb_gateway_requests_total`; a completed
   one also gets its SLO verdict from the times its token chunks came
   (`metrics.RequestTiming`), a refused one (429, 503) is counted by its error code.
   `sse()` settles on every way out; the caller settles otherwise.

`run()` is the whole path for a caller without a connection (a batch line): it never
raises but for its own cancellation, which cancels the request on the bus; the answer
or the error comes back as a `RunResult` with its status code and JSON body.

A completion whose `prompt` lists several prompts runs one session per prompt, all
admitted before the answer starts (one refused fails the request, and the others are
cancelled); their chunks interleave as they come, choice j of prompt p numbered
`p * n + j` as OpenAI does, and the usage sums theirs. With `echo` and `logprobs`, a
prompt's own logprobs come from its engine before its first token; a streamed
answer opens that prompt's choices (their echo frames) once they are all in.

A request's class of service is its service tier (`tiers`), named by its body's
`service_tier` (or `priority`) for the endpoints and batch lines alike, and resolved
before anything else is checked but the model: its SLOs and priority go to the
cluster, its name into the answer (`service_tier`) and the tier-labelled metrics.
`RunOptions` says how a request runs beyond its body: whether it is a batch line,
and when that line is due. A batch line is logged as such (`RequestAdmitted.batch`
and `batch_deadline`), and the conductor admits it only into the capacity
interactive traffic leaves idle: otherwise it is refused (429, `batch_held`), which
the batch worker tries again until the line's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
from opentelemetry.context import Context

from yb_core.config import YbConfig
from yb_core.protocol import TokenChunk, TokenLogprob
from yb_core.telemetry import bind_request, get_logger
from yb_gateway.choices import Choices, ChoiceUpdate
from yb_gateway.errors import ApiError, from_decode_error, unavailable
from yb_gateway.metrics import CLIENT_CLOSED, GatewayMetrics, RequestTiming
from yb_gateway.prompt import PreparedRequest, PromptEncoder, check_common, prepare_all
from yb_gateway.render import SSE_DONE, ResponseFormat, sse_error
from yb_gateway.schemas import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from yb_gateway.session import RequestSession, StreamError
from yb_gateway.slow_clients import DROPPED_STATE_KEY
from yb_gateway.tiers import ServedTier, resolve_tier

log = get_logger(__name__)

S = TypeVar("S", bound=msgspec.Struct)

_json = msgspec.json.Encoder()


def decode_body(raw: bytes, kind: type[S]) -> S:
    """Strictly decode a JSON body into `kind`; 400 in OpenAI's format otherwise,
    naming the field that is unknown or not implemented (`REFUSED_FIELDS`)."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise from_decode_error(exc, REFUSED_FIELDS.get(kind)) from exc


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a request runs beyond what its body says: `batch` for a line of a batch,
    due by `deadline` (wall-clock seconds; 0: none). Both go to the conductor in
    `RequestAdmitted`, which admits a batch line only into idle capacity."""

    batch: bool = False
    deadline: float = 0.0


#: An ordinary request over HTTP.
DEFAULT_RUN = RunOptions()


@dataclass(frozen=True, slots=True)
class RunResult:
    """What a request without a connection got: the status code, its request id and
    the JSON body (the completion, or an OpenAI error object), and the seconds a
    refusal asked to wait before trying again (its Retry-After; 0 without one)."""

    status: int
    request_id: str
    body: bytes
    retry_after_s: float = 0.0

    @classmethod
    def of_error(cls, request_id: str, error: ApiError) -> RunResult:
        """The result that carries `error`."""
        retry_after = error.headers.get("Retry-After", "")
        wait = float(retry_after) if retry_after.isdigit() else 0.0
        return cls(error.status, request_id, _json.encode(error.body()), wait)


@dataclass(eq=False)
class Exchange:
    """One request between admission and its last byte; settled exactly once. It has
    a session per prompt (one but for a completion that lists several)."""

    sessions: list[RequestSession]
    fmt: ResponseFormat
    choices: Choices
    # The request's scope state: where the connection notes that it dropped a slow
    # client (`slow_clients.DROPPED_STATE_KEY`); empty without a connection.
    state: dict[str, Any]
    # When its token chunks went out, for its SLO verdict.
    timing: RequestTiming
    settled: bool = False
    # Per prompt, with `echo` and `logprobs`: its own logprobs so far, the attempt they
    # came from (a re-planned one sends them anew), and whether all are in.
    prompt_entries: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_attempt: list[int] = field(default_factory=list)
    prompt_done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = len(self.sessions)
        self.prompt_entries = [[] for _ in range(count)]
        self.prompt_attempt = [0] * count
        self.prompt_done = [not self._expected(p) for p in range(count)]
        for p, session in enumerate(self.sessions):
            if self._waits(p) and self.prompt_done[p]:  # a one-token prompt: all in
                self.fmt.prompt_in(p, session.prepared.token_ids, [])

    def _waits(self, prompt: int) -> bool:
        return self.sessions[prompt].prepared.sampling.prompt_logprobs is not None

    def _expected(self, prompt: int) -> int:
        """How many of its own logprobs prompt `prompt` waits for (its tokens but the
        first), 0 when it asked for none."""
        if not self._waits(prompt):
            return 0
        return len(self.sessions[prompt].prepared.token_ids) - 1

    def opened_at_start(self) -> list[int]:
        """The prompts whose choices wait for the prompt's logprobs and have them all
        before any chunk (a one-token prompt)."""
        return [p for p in range(len(self.sessions)) if self._waits(p) and self.prompt_done[p]]

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens, all together."""
        return sum(s.prompt_tokens for s in self.sessions)

    @property
    def cached_tokens(self) -> int:
        """The prompts' tokens whose KV was reused, all together."""
        return sum(s.cached_tokens for s in self.sessions)

    def finish_default(self, index: int) -> str:
        """The finish reason of choice `index` when its engine gave none."""
        return self.sessions[index // self.sessions[0].prepared.n].finish_reason

    def fold(self, prompt: int, chunk: TokenChunk) -> tuple[ChoiceUpdate, bool]:
        """Fold a chunk of prompt `prompt`'s session into the choices; what it adds,
        and whether it completed that prompt's own logprobs (its choices open then).

        Raises `StreamError` (502) when a token comes before all the prompt's logprobs:
        a prompt's logprobs, once asked for, are never silently missing.
        """
        prepared = self.sessions[prompt].prepared
        completed = False
        if not self.prompt_done[prompt]:
            completed = self._take_prompt_logprobs(prompt, chunk)
        if prepared.echo_only:
            # `max_tokens: 0`: the token the cluster generated is not part of the answer.
            chunk = msgspec.structs.replace(
                chunk,
                token_ids=[],
                text="",
                logprobs=[],
                completion_tokens=0,
                finish_reason="length" if chunk.finished else None,
            )
        if prompt:
            chunk = msgspec.structs.replace(chunk, index=prompt * prepared.n + chunk.index)
        return self.choices.add(chunk), completed

    def _take_prompt_logprobs(self, prompt: int, chunk: TokenChunk) -> bool:
        entries = self.prompt_entries[prompt]
        if chunk.attempt != self.prompt_attempt[prompt]:
            # A re-planned attempt computes them again, from the first.
            self.prompt_attempt[prompt] = chunk.attempt
            entries.clear()
        entries.extend(chunk.prompt_logprobs)
        expected = self._expected(prompt)
        if len(entries) == expected:
            self.prompt_done[prompt] = True
            self.fmt.prompt_in(prompt, self.sessions[prompt].prepared.token_ids, entries)
            return True
        if len(entries) > expected or chunk.token_ids or chunk.text or chunk.finished:
            raise StreamError(
                502,
                f"The engine sent {len(entries)} of the prompt's {expected} logprobs (one "
                "for each prompt token after the first) before its first generated token.",
                code="prompt_logprobs_missing",
            )
        return False


class RequestSessions(Protocol):
    """What the request path asks of its gateway: the tokenizer, once loaded, and a
    session on the bus for each request it admits, released exactly once."""

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


class RequestRunner:
    """Runs the generation requests of one gateway, counting every one once in
    `metrics`; see the module docstring for the steps."""

    def __init__(self, sessions: RequestSessions, cfg: YbConfig, metrics: GatewayMetrics) -> None:
        self._sessions = sessions
        self._cfg = cfg
        self._metrics = metrics

    async def admit(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        fmt: ResponseFormat,
        endpoint: str,
        *,
        arrived: float,
        state: dict[str, Any],
        trace_parent: Context | None = None,
        options: RunOptions = DEFAULT_RUN,
    ) -> Exchange:
        """Check, tokenize and open the request's sessions on the bus (not started).

        Raises `ApiError` (with the request id in its headers) once the request is
        counted; nothing reached the bus then.
        """
        sessions, cfg, metrics = self._sessions, self._cfg, self._metrics
        request_id = fmt.request_id
        metrics.in_flight.inc()
        tier: ServedTier | None = None
        try:
            check_common(body, cfg.model.name)
            tier = resolve_tier(body.service_tier, body.priority, cfg.gateway)
            encoder = sessions.encoder
            if encoder is None:
                raise unavailable(
                    f"The tokenizer is not loaded ({sessions.encoder_state}).",
                    code="tokenizer_not_ready",
                )
            prompts = await prepare_all(body, encoder, cfg.model, cfg.gateway, tier)
            if options.batch:
                prompts = [
                    dataclasses.replace(p, batch=True, batch_deadline=options.deadline)
                    for p in prompts
                ]
            prepared = prompts[0]
            fmt.prepared(
                prepared.sampling.logprobs,
                encoder.tokens,
                [p.echo for p in prompts],
                prepared.n,
                service_tier=tier.name,
            )
            await sessions.wait_for_bus()
            opened: list[RequestSession] = []
            try:
                for p, one in enumerate(prompts):
                    # A prompt after the first is a request of its own on the bus.
                    rid = request_id if not p else f"{request_id}-p{p}"
                    opened.append(
                        sessions.open_session(
                            rid, endpoint, one, arrived, trace_parent=trace_parent
                        )
                    )
            except BaseException:
                for session in opened:
                    await sessions.release(session, "not admitted")
                raise
        except BaseException as exc:
            # Nothing reached the bus: only the books need settling.
            metrics.in_flight.dec()
            name = tier.name if tier is not None else None
            if isinstance(exc, ApiError):
                metrics.finished(exc.status, exc.code, tier=name)
            else:
                metrics.finished(500, tier=name)
            tag(exc, request_id)
            raise
        log.info(
            "request_admitting",
            endpoint=endpoint,
            prompt_tokens=sum(len(p.token_ids) for p in prompts),
            prompts=len(prompts) if len(prompts) > 1 else None,
            max_tokens=prepared.max_tokens,
            stream=prepared.stream,
            user=body.user,
            prompt_logprobs=prepared.sampling.prompt_logprobs,
            tier=tier.name,
            batch=options.batch or None,
        )
        return Exchange(
            opened,
            fmt,
            Choices(prepared.n * len(prompts), prepared.output.tools),
            state,
            RequestTiming(arrived),
        )

    async def start(self, exchange: Exchange) -> None:
        """Admit every session (each prompt's) at once; the first failure is raised,
        the starts still under way then are cancelled (`settle` cancels on the bus
        what was admitted)."""
        sessions = exchange.sessions
        if len(sessions) == 1:
            await sessions[0].start()
            return
        starts = [asyncio.ensure_future(s.start()) for s in sessions]
        try:
            await asyncio.gather(*starts)
        finally:
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)

    async def collect(self, exchange: Exchange) -> None:
        """Fold the whole answer into `exchange.choices`; `StreamError` if it broke."""
        async with contextlib.aclosing(_chunks(exchange.sessions)) as chunks:
            async for prompt, chunk, _ in chunks:
                if chunk.token_ids or chunk.text:
                    exchange.timing.token(time.monotonic())
                exchange.fold(prompt, chunk)

    def whole(self, exchange: Exchange) -> bytes:
        """The collected answer as one JSON body."""
        return exchange.fmt.whole(
            exchange.choices.states, exchange.sessions[0].finish_reason, _usage(exchange)
        )

    async def run(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        fmt: ResponseFormat,
        endpoint: str,
        *,
        options: RunOptions = DEFAULT_RUN,
    ) -> RunResult:
        """The whole answer of a request that has no connection (a batch line).

        Errors are results (their status and OpenAI error body), never raised; a
        cancellation of the caller cancels the request on the bus and is re-raised.
        """
        request_id = fmt.request_id
        with bind_request(request_id):
            try:
                exchange = await self.admit(
                    body, fmt, endpoint, arrived=time.monotonic(), state={}, options=options
                )
            except ApiError as exc:
                return RunResult.of_error(request_id, exc)
            except Exception as exc:
                log.exception("request_failed", error=repr(exc))
                return RunResult.of_error(request_id, _internal(request_id))
            try:
                await self.start(exchange)
                await self.collect(exchange)
            except StreamError as exc:
                await self.settle(exchange, exc.status, exc.message)
                return RunResult.of_error(request_id, exc.api_error())
            except ApiError as exc:
                await self.settle(exchange, exc.status, exc.message, exc.code)
                return RunResult.of_error(request_id, exc)
            except asyncio.CancelledError:
                await self.settle(exchange, CLIENT_CLOSED, "cancelled")
                raise
            except Exception as exc:
                log.exception("request_failed", error=repr(exc))
                await self.settle(exchange, 500, f"gateway error: {exc!r}")
                return RunResult.of_error(request_id, _internal(request_id))
            await self.settle(exchange, 200, "")
            return RunResult(200, request_id, self.whole(exchange))

    async def settle(
        self, exchange: Exchange, status: int, reason: str, code: str | None = None
    ) -> None:
        """Count the request once and release its session (cancelling it if unfinished)."""
        if exchange.settled:
            return
        exchange.settled = True
        if status == CLIENT_CLOSED and (dropped := exchange.state.get(DROPPED_STATE_KEY)):
            reason = f"client dropped: {dropped}"
        tier = exchange.sessions[0].prepared.tier
        self._metrics.in_flight.dec()
        self._metrics.finished(status, code, tier=tier.name)
        if status == 200:
            # Judged against its own tier's SLOs, as the conductor admitted it.
            self._metrics.completed(
                exchange.timing,
                prompt_tokens=exchange.prompt_tokens,
                cached_tokens=exchange.cached_tokens,
                ttft_slo_s=tier.ttft_slo_s,
                tbt_slo_s=tier.tbt_slo_s,
                tier=tier.name,
            )
        log.info(
            "request_finished",
            request_id=exchange.fmt.request_id,
            status=status,
            reason=reason or None,
            prompt_tokens=exchange.prompt_tokens,
            completion_tokens=exchange.choices.completion_tokens,
            cached_tokens=exchange.cached_tokens,
        )
        for session in exchange.sessions:
            await self._sessions.release(session, reason)

    async def sse(self, exchange: Exchange) -> AsyncIterator[bytes]:
        """The SSE body. Ends the exchange on every way out: completion, a broken
        stream, or the client leaving (litestar cancels the iteration)."""
        fmt, choices = exchange.fmt, exchange.choices
        prepared = exchange.sessions[0].prepared
        continuous = prepared.continuous_usage
        status, reason = CLIENT_CLOSED, "client disconnected"
        try:
            opening = [fmt.opening(len(choices.states)) or b""]
            opening += [fmt.open_prompt(p) for p in exchange.opened_at_start()]
            if any(opening):
                yield b"".join(opening)
            # The frame of the stream's last chunk: it goes out with the closing frames
            # in one write (nothing is left to wait for once that chunk came), not one
            # write (and one ASGI message) each.
            last = b""
            async with contextlib.aclosing(_chunks(exchange.sessions)) as chunks:
                async for prompt, chunk, is_last in chunks:
                    if DROPPED_STATE_KEY in exchange.state:
                        # The connection was dropped: uvicorn now accepts every write
                        # without waiting, so chunks already queued would run the
                        # stream to its end as if delivered. It ends here, cancelled.
                        return
                    if chunk.token_ids or chunk.text:
                        exchange.timing.token(time.monotonic())
                    update, opened = exchange.fold(prompt, chunk)
                    frame = fmt.open_prompt(prompt) if opened else b""
                    if not update.empty:
                        frame += fmt.delta(update, _usage(exchange) if continuous else None)
                    if is_last:
                        last = frame
                    elif frame:
                        yield frame
            # Generation is complete: a client leaving during the last frames is not
            # a cancelled request.
            status, reason = 200, ""
            frames = [last]
            for state in choices.states:
                finish = state.finish_reason(exchange.finish_default(state.index))
                frames.append(
                    fmt.closing(state.index, finish, _usage(exchange) if continuous else None)
                )
            if prepared.include_usage:
                frames.append(fmt.usage_frame(_usage(exchange)))
            frames.append(SSE_DONE)
            yield b"".join(frames)
        except StreamError as exc:
            # The 200 has gone out: the error travels in the stream, which still ends
            # with [DONE] so that clients waiting for it stop reading.
            log.warning("stream_failed", request_id=fmt.request_id, error=exc.message)
            status, reason = exc.status, exc.message
            yield sse_error(exc.body())
            yield SSE_DONE
        finally:
            await self.settle(exchange, status, reason)


def tag(exc: BaseException, request_id: str) -> BaseException:
    """`exc`, with the request id in its headers when it is an error answer, so a
    client can quote it."""
    if isinstance(exc, ApiError):
        exc.headers.setdefault("X-Request-Id", request_id)
    return exc


def _internal(request_id: str) -> ApiError:
    return ApiError(
        500,
        f"Internal server error (request id {request_id}).",
        type="server_error",
        code="internal_error",
    )


async def _chunks(
    sessions: list[RequestSession],
) -> AsyncGenerator[tuple[int, TokenChunk, bool]]:
    """Every session's chunks as they come: the prompt each answers, the chunk, and
    whether it is the request's last (every session ended, none left to read). The
    first error of any session is raised; the others' reads are cancelled then."""
    if len(sessions) == 1:
        session = sessions[0]
        async for chunk in session.chunks():
            yield 0, chunk, session.ended
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | Exception | None]] = asyncio.Queue()
    held = 0  # chunks queued and not taken yet

    async def read(prompt: int, session: RequestSession) -> None:
        nonlocal held
        try:
            async for chunk in session.chunks():
                held += 1
                queue.put_nowait((prompt, chunk))
        except Exception as exc:  # StreamError, or a bug: the request's end either way
            queue.put_nowait((prompt, exc))
        else:
            queue.put_nowait((prompt, None))

    reads = [
        asyncio.create_task(read(p, s), name=f"chunks:{s.request_id}")
        for p, s in enumerate(sessions)
    ]
    try:
        running = len(reads)
        while running:
            prompt, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                held -= 1
                yield prompt, item, held == 0 and all(s.ended for s in sessions)
    finally:
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


def _usage(exchange: Exchange) -> Usage:
    """The request's counts: each prompt once, the completion tokens of all choices."""
    prompt_tokens = exchange.prompt_tokens
    completion = exchange.choices.completion_tokens
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=exchange.cached_tokens),
    )
