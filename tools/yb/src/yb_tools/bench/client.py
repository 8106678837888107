"""One request through the gateway's OpenAI API, streamed as SSE and timed as it arrives.

`BenchClient.send` posts a token-id prompt to `POST /v1/completions` with `stream:
true` and `stream_options.include_usage`, and times every SSE frame that carries text:
the first one is the time to first token, the gaps between the next ones are the
inter-token latencies. The usage frame at the end gives the authoritative token
counts, including `prompt_tokens_details.cached_tokens`. Every outcome becomes a
`RequestResult` with an error kind, never an exception: `http_<status>` for an error
answer (429 is the conductor's rejection), `stream_<code>` for an error event after
the 200, `timeout` past the request's deadline, `connect`/`transport` for the network,
`protocol` for a stream that ends without `[DONE]` or cannot be read.

The gateway leaves out tokens that decode to no text yet (half of a UTF-8 character),
so a frame may stand for more than one token; token counts come from the usage frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import msgspec

from yb_core.netaddr import is_loopback
from yb_tools.bench.workloads import RequestSpec

# --- the wire format, as far as a client needs it -------------------------------------


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptTokensDetails | None = None


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


class _ModelCard(msgspec.Struct):
    id: str
    max_model_len: int = 0
    # Not sent by the gateway today; read when a server does (vLLM does not either).
    vocab_size: int = 0


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_error_decoder = msgspec.json.Decoder(_ErrorBody)


# --- results ---------------------------------------------------------------------------


class RequestResult(msgspec.Struct, kw_only=True):
    """What happened to one request, with times in seconds from the start of the run.

    `error` is empty for a success. `sent_s` is when it left; None when the run stopped
    before it could. `queued_s` is how long it waited for a free slot of the concurrency
    cap after its arrival time (client-side, not counted in its TTFT). `token_times`
    are the arrival times of the frames that carried text, relative to `sent_s`.
    """

    index: int
    group: int = 0
    sent_s: float | None = None  # None: never sent
    queued_s: float = 0.0
    error: str = ""
    message: str = ""
    status: int = 0
    request_id: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times: list[float] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False
    # When the status line arrived (from `sent_s`), and a refusal's `Retry-After`.
    answered_s: float | None = None
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the request completed."""
        return not self.error

    def gaps(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive text frames."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the server says about its model."""

    model: str
    max_model_len: int
    vocab_size: int  # 0: the server did not say


class ServerError(Exception):
    """The server cannot be benchmarked (unreachable, no model, unexpected answers)."""


# --- the client ------------------------------------------------------------------------


class BenchClient:
    """An HTTP connection pool to one gateway, sized for the concurrency cap."""

    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int,
        api_key: str = "",
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            # The request deadline bounds every exchange as a whole; httpx's own
            # timeouts only catch a connection that never opens.
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            # A gateway on this machine is reached directly, whatever proxies the
            # environment names.
            trust_env=not is_loopback(urlsplit(base_url).hostname or ""),
        )

    async def close(self) -> None:
        """Close every connection."""
        await self._http.aclose()

    async def server_info(self, model: str | None = None, timeout_s: float = 10.0) -> ServerInfo:
        """The served model (or `model`, checked) and its limits, from `GET /v1/models`."""
        try:
            r = await self._http.get("/v1/models", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.base_url}: {exc!r}") from exc
        if r.status_code == 401:
            raise ServerError("the gateway wants an API key: pass --api-key (or configure one)")
        if r.status_code != 200:
            raise ServerError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
        try:
            cards = msgspec.json.decode(r.content, type=_ModelList).data
        except msgspec.DecodeError as exc:
            raise ServerError(f"GET /v1/models: unreadable answer: {exc}") from exc
        if not cards:
            raise ServerError("GET /v1/models lists no model")
        card = cards[0]
        if model is not None:
            named = [c for c in cards if c.id == model]
            if not named:
                raise ServerError(f"the server does not serve {model!r} (only {cards[0].id!r})")
            card = named[0]
        return ServerInfo(card.id, card.max_model_len, card.vocab_size)

    async def probe_vocab_size(self, model: str, timeout_s: float = 30.0) -> int:
        """The vocabulary size, learnt from the gateway's refusal of an impossible token.

        The gateway checks prompt token ids before anything reaches the cluster and
        names the valid range in its 400 answer; 0 when the answer does not say.
        """
        body = {"model": model, "prompt": [2**31 - 1], "max_tokens": 1}
        try:
            r = await self._http.post("/v1/completions", json=body, timeout=timeout_s)
        except httpx.HTTPError:
            return 0
        if r.status_code != 400:
            return 0
        found = re.search(r"\(0\.\.(\d+)\)", r.text)
        return int(found.group(1)) + 1 if found else 0

    async def send(
        self,
        spec: RequestSpec,
        *,
        model: str,
        deadline_s: float,
        t0: float,
        temperature: float = 0.0,
        queued_s: float = 0.0,
    ) -> RequestResult:
        """Send one request and time it; never raises (except when cancelled).

        `t0` is the run's start on `time.perf_counter`'s clock.
        """
        sent = time.perf_counter()
        result = RequestResult(
            index=spec.index, group=spec.group, sent_s=sent - t0, queued_s=queued_s
        )
        body = {
            "model": model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM's extension, so the output is as long as the workload says (Yuebing's
            # gateway serves it; a server that does not know it answers 400).
            "ignore_eos": True,
        }
        try:
            async with asyncio.timeout(deadline_s):
                await self._exchange(body, result, sent)
        except TimeoutError:
            _fail(result, "timeout", f"no complete answer within {deadline_s:g}s")
        except httpx.ConnectError as exc:
            _fail(result, "connect", repr(exc))
        except httpx.HTTPError as exc:
            _fail(result, "transport", repr(exc))
        if result.ok:
            result.e2e_s = time.perf_counter() - sent
        return result

    async def _exchange(self, body: dict[str, object], result: RequestResult, sent: float) -> None:
        async with self._http.stream("POST", "/v1/completions", json=body) as r:
            result.status = r.status_code
            result.answered_s = time.perf_counter() - sent
            result.request_id = r.headers.get("x-request-id", "")
            with contextlib.suppress(ValueError):
                result.retry_after_s = float(r.headers.get("retry-after", ""))
            if r.status_code != 200:
                raw = await r.aread()
                _fail(result, f"http_{r.status_code}", _error_message(raw))
                return
            done = False
            async for event, data in _sse_events(r.aiter_lines()):
                now = time.perf_counter() - sent
                if event == "error":
                    kind, message = _stream_error(data)
                    _fail(result, kind, message)
                    return
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = _chunk_decoder.decode(data)
                except msgspec.DecodeError as exc:
                    _fail(result, "protocol", f"unreadable frame: {exc}")
                    return
                if any(c.text for c in chunk.choices):
                    if result.ttft_s is None:
                        result.ttft_s = now
                    result.token_times.append(now)
                if chunk.usage is not None:
                    u = chunk.usage
                    result.usage_reported = True
                    result.prompt_tokens = u.prompt_tokens
                    result.completion_tokens = u.completion_tokens
                    details = u.prompt_tokens_details
                    result.cached_tokens = details.cached_tokens if details else 0
            if not done:
                _fail(result, "protocol", "the stream ended without [DONE]")
            elif result.ttft_s is None and result.completion_tokens == 0:
                _fail(result, "protocol", "the stream carried no token")


def _fail(result: RequestResult, kind: str, message: str) -> None:
    # The first failure is the cause; what follows (a timeout while closing) is not.
    if not result.error:
        result.error = kind
        result.message = message[:500]


def _error_message(raw: bytes) -> str:
    try:
        return _error_decoder.decode(raw).error.message
    except msgspec.DecodeError:
        return raw[:300].decode(errors="replace")


def _stream_error(data: str) -> tuple[str, str]:
    try:
        detail = _error_decoder.decode(data).error
    except msgspec.DecodeError:
        return "stream_error", data[:300]
    return f"stream_{detail.code or detail.type or 'error'}", detail.message


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) of each server-sent event (the `message` name by default)."""
    event, data = "message", list[str]()
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
        # `id:`, `retry:` and comments (`:`) mean nothing to a benchmark.
    if data:
        yield event, "\n".join(data)
