"""The rest of the cluster, played over the bus, and helpers for the gateway's tests.

`Conductor` reads `RequestAdmitted` from the log and publishes decisions; `Engine`
answers prefill jobs on core NATS, streams `TokenChunk`s to the token subject,
answers `ResendTokens` as a decode instance does (publishing again what it streamed)
and announces a prefill and a decode instance. It can lose chunks on purpose (`lose`:
kept, as decode keeps them, but not published), which is what core NATS does to a
gateway that moves to another node. They are peers on the same nats-server the
gateway uses, not mocks: the gateway cannot tell them from the real services.

(Imported by name: `conftest.py` puts this folder on `sys.path`, because pytest's
importlib mode does not let test modules import each other.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from yb_core import events as ev
from yb_core import protocol
from yb_core.bus import Bus, EventReader
from yb_core.config import GatewayConfig, ModelConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_gateway.service import GatewayService
from yb_tools.natsserver import free_port

MODEL = "tiny-test-model"
PREFILL_ID = "prefill-t0"
DECODE_ID = "decode-t0"
WORDS = ["Hello", ",", " wor", "ld", "!"]
# Every test gateway has an API key and a metrics token, as a real one must;
# `client_for` sends the key unless told otherwise.
API_KEY = "test-api-key"
METRICS_TOKEN = "test-metrics-token"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
METRICS_AUTH = {"Authorization": f"Bearer {METRICS_TOKEN}"}

# The `gateway_factory` fixture: starts a gateway with extra `GatewayConfig` settings.
GatewayFactory = Callable[..., Awaitable[GatewayService]]


def make_config(
    nats: NatsConfig,
    *,
    telemetry: TelemetryConfig | None = None,
    max_model_len: int = 256,
    **gateway: Any,
) -> YbConfig:
    """Gateway settings for a test. Its deadlines are long, so that no happy path
    depends on how fast this machine runs; a test of a deadline sets that one short."""
    settings: dict[str, Any] = {
        "api_keys": [API_KEY],
        "port": free_port(),
        "decision_timeout_s": 30.0,
        "job_timeout_s": 30.0,
        "first_token_timeout_s": 30.0,
        "token_idle_timeout_s": 30.0,
        "max_max_tokens": 512,
        "max_body_bytes": 64 * 1024,
        **gateway,
    }
    return YbConfig(
        nats=nats,
        model=ModelConfig(
            source="tiny-random", name=MODEL, block_size=4, max_model_len=max_model_len
        ),
        gateway=GatewayConfig(**settings),
        telemetry=telemetry or TelemetryConfig(metrics_token=METRICS_TOKEN),
    )


async def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` until true; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def start_gateway(cfg: YbConfig, *, wait_bus: bool = True) -> GatewayService:
    """Start a gateway and wait until its tokenizer (and bus, if asked) are ready."""
    gw = GatewayService(cfg)
    await gw.start()
    await wait_for(lambda: gw.encoder is not None, 60, "the tokenizer")
    if wait_bus:
        await wait_for(lambda: gw.readiness()["bus"] == "connected", 10, "the bus")
    return gw


def client_for(
    gw: GatewayService, *, key: str | None = API_KEY, **kwargs: Any
) -> httpx.AsyncClient:
    """An HTTP client for the gateway's real socket (no proxies: all is local),
    sending `key` as its Bearer token (None: no credentials)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    headers.update(kwargs.pop("headers", None) or {})
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{gw.port}",
        trust_env=False,
        timeout=15.0,
        headers=headers,
        **kwargs,
    )


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The `error` object of an OpenAI error answer, after checking its shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- the rest of the cluster, played over the bus -------------------------------------


@dataclass
class Conductor:
    """Decides every admission: schedule (default), reject, or stay silent.
    `hold_batch`: how many batch lines to refuse first as the conductor holds one back
    while interactive load uses the capacity (429 `batch_held`)."""

    bus: Bus
    mode: str = "schedule"
    retry_after_s: float = 3.0
    hold_batch: int = 0
    admitted: list[ev.RequestAdmitted] = field(default_factory=list)
    replanned: list[ev.RequestReplanned] = field(default_factory=list)
    _reader: EventReader | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reader = await self.bus.read_ordered("yb.ev.req.request_admitted", new_only=True)
        self._task = asyncio.create_task(self._run(self._reader))

    async def _run(self, reader: EventReader) -> None:
        async for logged in reader:
            event = logged.event
            attempt = 0
            if isinstance(event, ev.RequestReplanned):
                # A re-plan travels with the admissions: decided as one, on its attempt.
                self.replanned.append(event)
                attempt = event.attempt
            elif isinstance(event, ev.RequestAdmitted):
                self.admitted.append(event)
            else:
                continue
            decision: ev.Decision
            if self.mode == "silent":
                continue
            if isinstance(event, ev.RequestAdmitted) and event.batch and self.hold_batch > 0:
                self.hold_batch -= 1
                decision = ev.RequestRejected(
                    request_id=event.request_id,
                    gateway_id=event.gateway_id,
                    reason="batch_held: held back, load on prefill-0 (queue 1.800s over "
                    "batch_max_queue_s 0.05s)",
                    retry_after_s=1.0,
                    admitted_seq=logged.seq,
                )
            elif self.mode == "reject":
                decision = ev.RequestRejected(
                    request_id=event.request_id,
                    gateway_id=event.gateway_id,
                    reason="predicted TBT over SLO",
                    retry_after_s=self.retry_after_s,
                    admitted_seq=logged.seq,
                )
            else:
                decision = ev.RequestScheduled(
                    request_id=event.request_id,
                    gateway_id=event.gateway_id,
                    prefill_instance=PREFILL_ID,
                    decode_instance=DECODE_ID,
                    reused_blocks=1,
                    policy="test",
                    admitted_seq=logged.seq,
                    attempt=attempt,
                )
            await self.bus.publish(decision)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._reader is not None:
            await self._reader.close()


Script = Callable[[protocol.PrefillJob], list[protocol.TokenChunk]]


def prompt_logprob_entries(job: protocol.PrefillJob) -> list[protocol.TokenLogprob]:
    """What the fake engine gives as the prompt's logprobs (tokens 1..n-1): token i
    gets -i/10, and its `prompt_logprobs` alternatives are token 1 (at -0.05) then
    token i itself."""
    top = job.sampling.prompt_logprobs or 0
    return [
        protocol.TokenLogprob(token_id=t, logprob=-i / 10, top=[(1, -0.05), (t, -i / 10)][:top])
        for i, t in enumerate(job.token_ids[1:], start=1)
    ]


def words_script(
    words: list[str] = WORDS,
    *,
    cached: int = 4,
    prompt_logprobs: bool = True,
    per_chunk: int = 3,
) -> Script:
    """One chunk per word for each of the job's `n` choices, each choice's last chunk
    finished, numbered across choices and counted as decode counts (completion tokens
    over all choices so far), each word with its logprob (-0.5, no alternatives) when
    the job asks for logprobs. A job that asks for its prompt's logprobs gets them
    first (`prompt_logprob_entries`, `per_chunk` a chunk), unless `prompt_logprobs` is
    off (an engine that ignores the ask)."""

    def script(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        chunks: list[protocol.TokenChunk] = []
        if prompt_logprobs and job.sampling.prompt_logprobs is not None:
            entries = prompt_logprob_entries(job)
            for start in range(0, len(entries), per_chunk):
                chunks.append(
                    protocol.TokenChunk(
                        request_id=job.request_id,
                        seq=len(chunks),
                        prompt_tokens=len(job.token_ids),
                        cached_tokens=cached,
                        prompt_logprobs=entries[start : start + per_chunk],
                    )
                )
        for index in range(job.sampling.n):
            for i, word in enumerate(words):
                chunks.append(
                    protocol.TokenChunk(
                        request_id=job.request_id,
                        seq=len(chunks),
                        token_ids=[100 + i],
                        text=word,
                        logprobs=[]
                        if job.sampling.logprobs is None
                        else [protocol.TokenLogprob(token_id=100 + i, logprob=-0.5)],
                        prompt_tokens=len(job.token_ids),
                        completion_tokens=index * len(words) + i + 1,
                        cached_tokens=cached,
                        index=index,
                    )
                )
            chunks.append(
                protocol.TokenChunk(
                    request_id=job.request_id,
                    seq=len(chunks),
                    finished=True,
                    finish_reason="stop",
                    prompt_tokens=len(job.token_ids),
                    completion_tokens=(index + 1) * len(words),
                    cached_tokens=cached,
                    index=index,
                )
            )
        return chunks

    return script


@dataclass
class Engine:
    """A prefill instance that takes jobs, plus the decode instance that streams tokens.

    Resends (`resend`): `answer` publishes again what was streamed from the asked
    chunk on, as decode does; `forget` answers that it holds nothing; `silent` does
    not listen (nobody answers). `lose` names chunks streamed but never published;
    `pause_before` holds the stream before that chunk until `resume` is set, and
    `hold_from` holds every job from that one on (counted from 0) before its first
    chunk, until `resume` is set.
    """

    bus: Bus
    # accept | refuse (for good) | refuse_once (draining: the gateway may re-plan the
    # first job; later ones are taken) | silent
    reply: str = "accept"
    script: Script = field(default_factory=words_script)
    delay_s: float = 0.0
    resend: str = "answer"  # answer | forget | silent
    lose: set[int] = field(default_factory=set)
    pause_before: int = -1
    hold_from: int = -1
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    jobs: list[protocol.PrefillJob] = field(default_factory=list)
    asked: list[protocol.ResendTokens] = field(default_factory=list)
    # Request id -> (token subject, chunks streamed so far, finished).
    streamed: dict[str, tuple[str, list[protocol.TokenChunk], list[bool]]] = field(
        default_factory=dict
    )
    _sub: Subscription | None = None
    _resend_sub: Subscription | None = None
    _streams: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self, *, announce: bool = True) -> None:
        self._sub = await self.bus.subscribe(
            protocol.prefill_job_subject(PREFILL_ID), cb=self._on_job
        )
        if self.resend != "silent":
            self._resend_sub = await self.bus.subscribe(
                protocol.resend_subject(DECODE_ID), cb=self._on_resend
            )
        await self.bus.flush()
        if announce:
            await self.announce()

    async def announce(self) -> None:
        for instance_id, role in ((PREFILL_ID, "prefill"), (DECODE_ID, "decode")):
            await self.bus.publish(
                ev.InstanceUp(instance_id=instance_id, role=role, host="h0", model=MODEL)  # type: ignore[arg-type]
            )

    async def _on_job(self, msg: Msg) -> None:
        job = protocol.job_decoder.decode(msg.data)
        self.jobs.append(job)
        if self.reply == "silent":
            return
        if self.reply == "refuse" or (self.reply == "refuse_once" and len(self.jobs) == 1):
            draining = self.reply == "refuse_once"
            await msg.respond(
                protocol.encode(
                    protocol.JobRefused(
                        request_id=job.request_id,
                        instance_id=PREFILL_ID,
                        reason="prefill instance shutting down" if draining else "no KV pages",
                        retryable=draining,
                    )
                )
            )
            return
        await msg.respond(
            protocol.encode(protocol.JobAccepted(request_id=job.request_id, instance_id=PREFILL_ID))
        )
        held = 0 <= self.hold_from < len(self.jobs)
        task = asyncio.create_task(self._stream(job, held=held))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    async def _stream(self, job: protocol.PrefillJob, *, held: bool = False) -> None:
        sent: list[protocol.TokenChunk] = []
        done = [False]
        self.streamed[job.request_id] = (job.token_subject, sent, done)
        if held:
            await self.resume.wait()
        for chunk in self.script(job):
            if chunk.seq == self.pause_before:
                await self.resume.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            sent.append(chunk)
            if chunk.seq not in self.lose:
                await self.bus.publish_core(job.token_subject, protocol.encode(chunk))
        done[0] = True

    async def _on_resend(self, msg: Msg) -> None:
        ask = protocol.resend_decoder.decode(msg.data)
        self.asked.append(ask)
        kept = self.streamed.get(ask.request_id)
        if self.resend == "forget" or kept is None:
            reply = protocol.TokensResent(request_id=ask.request_id, state="unknown")
        else:
            subject, sent, done = kept
            again = [c for c in sent if c.seq >= ask.from_seq]
            for chunk in again:
                await self.bus.publish_core(subject, protocol.encode(chunk))
            reply = protocol.TokensResent(
                request_id=ask.request_id,
                state="finished" if done[0] else "streaming",
                first_seq=0,
                next_seq=len(sent),
                resent=len(again),
            )
        await msg.respond(protocol.encode(reply))

    async def go_deaf(self) -> None:
        """Stop answering resends from now on, as a decode instance cut off would."""
        sub, self._resend_sub = self._resend_sub, None
        if sub is not None:
            await sub.unsubscribe()
        await self.bus.flush()

    async def stop(self) -> None:
        for task in list(self._streams):
            task.cancel()
        for sub in (self._sub, self._resend_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


@dataclass
class Cluster:
    """The conductor and engine peers of one test."""

    conductor: Conductor
    engine: Engine


async def next_event(reader: EventReader, kind: type[Any], timeout_s: float = 5.0) -> Any:
    """The next event of `kind` from `reader`, or fail."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        logged = await reader.next(timeout_s=left)
        if logged is not None and isinstance(logged.event, kind):
            return logged.event
    pytest.fail(f"no {kind.__name__} within {timeout_s}s")


async def poll_status(
    client: httpx.AsyncClient, path: str, want: int, timeout_s: float = 5.0
) -> httpx.Response:
    """GET `path` until it answers `want`; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(path)
        if response.status_code == want:
            return response
        if time.monotonic() > deadline:
            pytest.fail(f"{path} still answers {response.status_code}, not {want}: {response.text}")
        await asyncio.sleep(0.05)
