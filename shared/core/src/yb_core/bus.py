"""The control plane: one NATS connection per process, JetStream for the event log.

`Bus` wraps nats-py with what every service needs and nothing more:
- connecting with exponential backoff (first connect and every reconnect) and a
  deadline, so a service started before NATS waits for it and one whose NATS went
  away comes back by itself;
- setting up the `YB_EVENTS` stream with explicit, documented settings, and beside it
  the stream that keeps every instance's newest announcement whatever the log trimmed
  (`ensure_stream`, `read_instances`);
- publishing typed events with a `Nats-Msg-Id` (JetStream de-duplicates retries) and
  the current trace context in the headers;
- ordered consumers (a private, gap-free, in-order view of the log from a sequence)
  and durable pull consumers (a named position that survives restarts);
- core request/reply and subscriptions for the ephemeral job and token subjects;
- credentials: a user with a password (or password file) or a creds file, and reply
  inboxes under `_INBOX.<user>.` so the server can keep each role's replies to itself
  (`yb_core.nats_auth` writes the matching permissions). A publish or subscription
  the server refuses is logged and kept in `permission_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from yb_core.config import INSTANCE_LOG_BYTES, NatsConfig, instance_stream_for
from yb_core.events import AnyEvent, decode_event, encode_event, message_id_for, subject_for
from yb_core.nats_auth import inbox_prefix
from yb_core.telemetry import get_logger, inject_headers

log = get_logger(__name__)

EVENT_SUBJECTS = "yb.ev.>"
#: The instance events (`InstanceUp`, `InstanceDown`, `LoadReport`), one subject per
#: instance and kind.
INSTANCE_SUBJECTS = "yb.ev.instance.>"
#: The header on a sourced message: "<origin stream> <origin sequence> ...".
SOURCE_HEADER = "Nats-Stream-Source"
MSG_ID_HEADER = "Nats-Msg-Id"
#: One try at reopening an ordered consumer (creating one takes milliseconds).
REOPEN_ATTEMPT_S = 2.0
T = TypeVar("T")

#: Opening a reader: one try, and all tries (a JetStream leader election takes seconds).
OPEN_ATTEMPT_S = 5.0
OPEN_TIMEOUT_S = 20.0
#: How long closing a client may take before it is abandoned.
_CLOSE_TIMEOUT_S = 5.0
#: JetStream's "duplicate message id is in process" (a replicated stream is still
#: storing a message with the same `Nats-Msg-Id`).
JS_DUPLICATE_IN_PROCESS = 10158
#: JetStream's "stream not found" (as opposed to "no message found", 10037).
JS_STREAM_NOT_FOUND = 10059


async def within(coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
    """`coro`'s result, or TimeoutError once `timeout_s` (None: no limit) has passed.

    Unlike `asyncio.wait_for`, the wait for the cancelled coroutine is bounded too. On
    Python 3.11 a cancellation that arrives as an inner `asyncio.wait_for` completes is
    swallowed (the inner one returns its result instead); nats-py's connect loop then
    goes on retrying for ever, and `wait_for`, waiting for it to end, never returns.
    """
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _cancel_until_done(task)
        raise
    if task in done:
        return task.result()
    await _cancel_until_done(task)
    raise TimeoutError(f"not done within {timeout_s:g}s")


async def _cancel_until_done(task: asyncio.Future[Any]) -> None:
    """Cancel `task` again until it ends (a swallowed cancel is followed by another),
    for at most `_CLOSE_TIMEOUT_S`; then it is abandoned, logged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _CLOSE_TIMEOUT_S
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            log.warning("task_abandoned", task=repr(task), why="it ignored every cancel")
            return
        task.cancel()
        await asyncio.wait({task}, timeout=min(0.1, left))
    if not task.cancelled():
        task.exception()  # retrieved: it is superseded by the caller's own outcome


class BusError(RuntimeError):
    """The bus could not do what was asked within its deadline."""


class BusUnavailable(BusError):
    """NATS cannot be reached (down, or not yet up) — callers answer 503."""


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """An event read back from the log with its position."""

    seq: int
    subject: str
    event: AnyEvent
    headers: Mapping[str, str]
    #: What it takes in the stream, near enough (payload, subject and headers).
    size: int = 0
    #: Events of the reader's subjects after this one in the log when it was
    #: delivered (0: the reader had caught up with the log); None when not read
    #: through a consumer.
    pending: int | None = None

    @property
    def log_seq(self) -> int:
        """Its sequence in the log: `seq`, or for an event read from the instance
        stream, the log's sequence its copy names (`Nats-Stream-Source`). Comparable
        with every other position in the log (a decision's `admitted_seq`, say)."""
        header = self.headers.get(SOURCE_HEADER)
        return self.seq if header is None else source_seq(header)


def source_seq(header: str) -> int:
    """The origin sequence a `Nats-Stream-Source` header names. Raises BusError."""
    parts = header.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise BusError(f"unexpected {SOURCE_HEADER} header {header!r}")
    return int(parts[1])


@dataclass(frozen=True, slots=True)
class LogExtent:
    """The retained part of the log: sequences `first_seq..last_seq`, `bytes` in all.

    Events below `first_seq` were trimmed by the stream's limits (`max_bytes`, -1 for
    none, and `max_age_s`, 0 for none). A log emptied by its limits has `last_seq ==
    first_seq - 1`; a new one reports 0 for both.
    """

    first_seq: int
    last_seq: int
    bytes: int
    max_bytes: int
    max_age_s: float

    @property
    def trimmed(self) -> bool:
        """Whether events from the log's beginning are gone."""
        return self.first_seq > 1

    def reaches(self, seq: int) -> bool:
        """Whether reading from `seq` misses nothing that was ever logged."""
        return seq >= self.first_seq


def backoff_delays(base: float, cap: float) -> Callable[[int], float]:
    """Full-jitter exponential backoff: attempt n waits up to min(cap, base * 2**n)."""

    def delay(attempt: int) -> float:
        return random.uniform(0.0, min(cap, base * (2 ** min(attempt, 16))))

    return delay


class Bus:
    """A service's connection to NATS and JetStream.

    Create with `await Bus.connect(cfg, name)`; `close()` is idempotent.
    """

    def __init__(self, nc: NatsClient, cfg: NatsConfig) -> None:
        self._nc = nc
        self._cfg = cfg
        self._js: JetStreamContext = nc.jetstream(timeout=cfg.request_timeout_s)
        self._closed = False
        # Bumped at every reconnect: ordered consumers live in the server's memory and
        # are gone after a server restart, so readers reopen when this changes.
        self.generation = 0
        # The server's most recent refusals ("permissions violation for publish to
        # ..."): a refused publish or subscription otherwise shows only as a timeout.
        self.permission_errors: deque[str] = deque(maxlen=32)

    # --- connection -----------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        cfg: NatsConfig,
        name: str,
        *,
        timeout_s: float | None = None,
        on_state: Callable[[str], Awaitable[None]] | None = None,
    ) -> Bus:
        """Connect, retrying with backoff until `timeout_s` (None: forever).

        Raises `BusUnavailable` at the deadline. After the first connection nats-py
        reconnects by itself, with the same backoff, for as long as the process lives.
        """
        delay = backoff_delays(cfg.reconnect_wait_s, cfg.max_reconnect_wait_s)
        holder: list[Bus] = []
        early_errors: list[str] = []

        def pick_server(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
            server = min(servers, key=lambda s: s.reconnects)
            return server, delay(server.reconnects)

        async def disconnected() -> None:
            if holder and holder[0]._closed:
                return  # our own close, not an outage
            log.warning("nats_disconnected")
            if on_state:
                await on_state("disconnected")

        async def reconnected() -> None:
            log.info("nats_reconnected")
            if holder:
                holder[0].generation += 1
            if on_state:
                await on_state("connected")

        async def error(exc: Exception) -> None:
            text = str(exc)
            if "permissions violation" in text.lower():
                # A misconfigured permission must be loud: the operation it refused
                # fails only by timing out.
                log.warning("nats_permission_denied", user=cfg.user, error=text)
                if holder:
                    holder[0].permission_errors.append(text)
                else:
                    early_errors.append(text)
                return
            if "authorization violation" in text.lower() and not holder:
                early_errors.append(text)  # wrong or missing credentials: say so below
            log.debug("nats_error", error=repr(exc))

        options: dict[str, Any] = {
            # Every node of a cluster: nats-py moves to another when one goes away
            # (and learns the rest from the servers' gossip).
            "servers": cfg.servers(),
            "name": name,
            "connect_timeout": cfg.connect_timeout_s,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": cfg.reconnect_wait_s,
            # nats-py's default (a PING every 2 min, two unanswered) would leave a
            # half-dead connection in place for minutes (see `NatsConfig`).
            "ping_interval": cfg.ping_interval_s,
            "max_outstanding_pings": cfg.max_outstanding_pings,
            "reconnect_to_server_handler": pick_server,
            "disconnected_cb": disconnected,
            "reconnected_cb": reconnected,
            "error_cb": error,
            # Bound the client's buffer while disconnected: publishes fail fast instead
            # of piling up for minutes.
            "pending_size": 8 * 1024 * 1024,
        }
        if cfg.user:
            options["user"] = cfg.user
            options["password"] = cfg.resolved_password()
            # Replies and JetStream deliveries come to this user's own inboxes, the
            # only ones its permissions let it subscribe to.
            options["inbox_prefix"] = inbox_prefix(cfg.user)
        if cfg.creds_file:
            options["user_credentials"] = cfg.creds_file

        # nats-py retries the first connection itself (reconnect_time_wait apart, for
        # ever with max_reconnect_attempts=-1); the deadline bounds that loop.
        nc = NatsClient()
        try:
            await within(nc.connect(**options), timeout_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            # Bounded too: the close of a client cancelled half-way through
            # connecting hung once in a full test run (refused credentials).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=_CLOSE_TIMEOUT_S)
            refused = [e for e in early_errors if "authorization violation" in e.lower()]
            if refused or "authorization violation" in str(exc).lower():
                who = f"user {cfg.user!r}" if cfg.user else "a client without credentials"
                raise BusUnavailable(
                    f"NATS at {cfg.url} refused {who} (authorization violation): set "
                    "nats.user and nats.password/password_file (yb up keeps them under "
                    "<data dir>/secrets/nats/)"
                ) from exc
            raise BusUnavailable(f"cannot reach NATS at {cfg.url}: {exc!r}") from exc
        bus = cls(nc, cfg)
        bus.permission_errors.extend(e for e in early_errors if "permissions" in e.lower())
        holder.append(bus)
        return bus

    @property
    def connected(self) -> bool:
        """True while the connection to NATS is up."""
        return bool(self._nc.is_connected)

    @property
    def closed(self) -> bool:
        """True once `close()` was called or the connection is closed for good."""
        return self._closed or bool(self._nc.is_closed)

    @property
    def client(self) -> NatsClient:
        """The raw nats-py client, for what this wrapper does not cover."""
        return self._nc

    @property
    def jetstream(self) -> JetStreamContext:
        """The raw JetStream context."""
        return self._js

    async def close(self) -> None:
        """Drain subscriptions and close; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._nc.is_connected:
                await asyncio.wait_for(self._nc.drain(), timeout=2.0)
        except (TimeoutError, nats.errors.Error, OSError):
            pass
        finally:
            if not self._nc.is_closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._nc.close(), timeout=_CLOSE_TIMEOUT_S)

    # --- the event stream -----------------------------------------------------------

    @property
    def instance_stream(self) -> str:
        """The name of the stream of instance announcements (see `ensure_stream`)."""
        return instance_stream_for(self._cfg.stream)

    async def ensure_stream(self) -> api.StreamInfo:
        """Create the event stream and the instance stream beside it (or bring them to
        the configured settings); returns the event stream's info.

        The event log trims its oldest events, announcements included, so a process
        that starts later could no longer learn an instance that announced itself
        long ago. The instance stream sources the instance subjects from the log and
        keeps the newest message of each (one `InstanceUp`, `InstanceDown` and
        `LoadReport` per instance): the analogue of a compacted topic. It is created
        here, wherever the log is, with the same storage and replicas, and it has no
        subjects of its own, so only the server's sourcing writes to it.
        """
        info = await self._ensure_event_stream()
        await self._ensure_instance_stream()
        return info

    async def _ensure_instance_stream(self) -> api.StreamInfo:
        """The instance stream (see `ensure_stream`): no age limit (a live instance
        announced once stays), `INSTANCE_LOG_BYTES` against instances that were never
        declared down under ids never reused."""
        config = api.StreamConfig(
            name=self.instance_stream,
            description=f"newest instance event per subject of {self._cfg.stream}",
            sources=[api.StreamSource(name=self._cfg.stream, filter_subject=INSTANCE_SUBJECTS)],
            storage=api.StorageType.FILE if self._cfg.storage == "file" else api.StorageType.MEMORY,
            num_replicas=self._cfg.replicas,
            max_msgs_per_subject=1,
            max_bytes=INSTANCE_LOG_BYTES,
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
        )
        try:
            return await self._js.add_stream(config)
        except nats.js.errors.BadRequestError:
            pass  # exists with other settings (replicas, limits): bring it to these
        try:
            return await self._js.update_stream(config)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(
                f"stream {self.instance_stream} exists with settings that cannot change "
                f"in place: {exc.description}"
            ) from exc

    async def read_instances(self, subject: str | list[str] = INSTANCE_SUBJECTS) -> EventReader:
        """The newest event of every instance subject, then each new one as it comes.

        Read from the instance stream, so an announcement the log trimmed is still
        there. Its messages reach it by sourcing, a moment after the log took them:
        a caller that needs the state as of now uses `sync_instances` first, one that
        waits for an instance waits with a deadline. Raises `BusError` when the
        instance stream does not exist (every service creates it at start).
        """
        try:
            return await self.read_ordered(
                subject, last_per_subject=True, stream=self.instance_stream
            )
        except nats.js.errors.NotFoundError as exc:
            raise BusError(f"no stream {self.instance_stream} (see Bus.ensure_stream)") from exc

    async def sync_instances(self, timeout_s: float | None = None) -> int:
        """Wait until the instance stream holds every instance event the log holds now;
        return the instance stream's last sequence then (0: empty).

        "Holds" is checked exactly: the log's newest instance event has a sequence
        there, and each sourced message names its origin sequence in its
        `Nats-Stream-Source` header. Raises `BusError` when either stream is missing
        and `BusUnavailable` when the copy does not catch up within `timeout_s`
        (default: the request timeout), e.g. because the log trimmed an event before
        it was copied and no later instance event came.
        """
        budget = self._cfg.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        newest = await self._last_instance_msg(self._cfg.stream, budget)
        target = 0 if newest is None else int(newest.seq or 0)
        delay = backoff_delays(0.02, 0.5)
        attempt = 0
        while True:
            remaining = max(0.1, deadline - time.monotonic())
            copied, last = await self._instance_head(remaining)
            if copied >= target:
                return last
            if time.monotonic() >= deadline:
                raise BusUnavailable(
                    f"{self.instance_stream} has copied {self._cfg.stream} up to {copied}, "
                    f"not to {target}, within {budget:.1f}s"
                )
            await asyncio.sleep(min(delay(attempt), max(0.0, deadline - time.monotonic())))
            attempt += 1

    async def _instance_head(self, budget_s: float) -> tuple[int, int]:
        """(origin sequence, own sequence) of the instance stream's newest message."""
        msg = await self._last_instance_msg(self.instance_stream, budget_s)
        if msg is None:
            return 0, 0
        return source_seq((msg.headers or {}).get(SOURCE_HEADER, "")), int(msg.seq or 0)

    async def _last_instance_msg(self, stream: str, budget_s: float) -> api.RawStreamMsg | None:
        """The newest message on the instance subjects of `stream`, None if none."""
        try:
            return await self._retried(
                lambda: self._js.get_last_msg(stream, INSTANCE_SUBJECTS),
                budget_s=budget_s,
                attempt_s=2.0,
                what=f"the newest instance event in {stream}",
            )
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == JS_STREAM_NOT_FOUND:
                raise BusError(f"no stream {stream} (see Bus.ensure_stream)") from exc
            return None  # no message on those subjects

    async def last_event(
        self, subject: str, *, timeout_s: float, stream: str = ""
    ) -> LoggedEvent | None:
        """The newest event of the log on `subject` (a single subject, no wildcard),
        None when the log holds none, asked of the stream itself (`stream`: another
        stream than the log, such as `instance_stream`).

        A lookup, not a consumer: it needs no delivery to be flowing, so it answers
        even while a reader's consumer is being re-created after a NATS node came back
        (when verdicts reach followers seconds late). Raises `BusUnavailable` when no
        answer comes within `timeout_s`.
        """
        try:
            msg = await self._retried(
                lambda: self._js.get_last_msg(stream or self._cfg.stream, subject),
                budget_s=timeout_s,
                attempt_s=timeout_s,
                what=f"the newest event on {subject}",
            )
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == JS_STREAM_NOT_FOUND:
                name = stream or self._cfg.stream
                raise BusError(f"no stream {name} (see Bus.ensure_stream)") from exc
            return None
        try:
            event = decode_event(msg.data or b"")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable_event", subject=subject, error=str(exc))
            return None
        data = msg.data or b""
        return LoggedEvent(
            seq=int(msg.seq or 0),
            subject=msg.subject or subject,
            event=event,
            headers=dict(msg.headers or {}),
            size=len(data) + len(subject),
        )

    async def _ensure_event_stream(self) -> api.StreamInfo:
        """Create the event stream, or update it to the configured settings.

        The log is bounded by age and by bytes, discarding its oldest events, so a
        write never fails because it is full (see `NatsConfig`). A stream that exists
        with other limits is brought to these, and the change is logged (every
        service of one cluster runs with the same settings, so it happens once, when
        an operator changed them); settings that cannot change in place (storage)
        raise `BusError` naming both values.
        """
        config = api.StreamConfig(
            name=self._cfg.stream,
            subjects=[EVENT_SUBJECTS],
            storage=api.StorageType.FILE if self._cfg.storage == "file" else api.StorageType.MEMORY,
            num_replicas=self._cfg.replicas,
            duplicate_window=self._cfg.duplicate_window_s,
            max_age=self._cfg.max_age_s,
            max_bytes=self._cfg.event_log_bytes(),
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
        )
        try:
            return await self._js.add_stream(config)
        except nats.js.errors.BadRequestError:
            pass
        # Exists with other settings: bring it to ours (only mutable fields change).
        old = (await self._js.stream_info(self._cfg.stream)).config
        changed = {
            name: (getattr(old, name), getattr(config, name))
            for name in ("max_bytes", "max_age", "duplicate_window", "num_replicas", "discard")
            if getattr(old, name) != getattr(config, name)
        }
        try:
            info = await self._js.update_stream(config)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(
                f"stream {self._cfg.stream} exists with settings that cannot change in place "
                f"(storage {old.storage} vs {config.storage}): {exc.description}"
            ) from exc
        log.warning(
            "event_stream_limits_changed",
            stream=self._cfg.stream,
            **{name: f"{a} -> {b}" for name, (a, b) in changed.items()},
        )
        return info

    async def log_extent(self, *, timeout_s: float | None = None) -> LogExtent:
        """Where the log starts and ends now, and its limits (see `LogExtent`)."""
        budget = self._cfg.request_timeout_s if timeout_s is None else timeout_s
        info = await self._retried(
            lambda: self._js.stream_info(self._cfg.stream),
            budget_s=budget,
            attempt_s=2.0,
            what=f"stream info for {self._cfg.stream}",
        )
        return LogExtent(
            first_seq=int(info.state.first_seq),
            last_seq=int(info.state.last_seq),
            bytes=int(info.state.bytes),
            max_bytes=int(info.config.max_bytes or -1),
            max_age_s=float(info.config.max_age or 0.0),
        )

    async def publish(
        self,
        event: AnyEvent,
        *,
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        msg_id: str = "",
    ) -> int:
        """Append an event to the log and return its stream sequence.

        Retries until `timeout_s` (default: the configured request timeout) with the
        same `Nats-Msg-Id`, so a publish that reached the server but whose ack was
        lost is not stored twice. Raises `BusUnavailable` when the deadline passes.
        `msg_id` replaces `message_id_for(event)` where the event's fields alone do
        not tell two occurrences apart (a second inventory answering a second resync
        request): the caller keeps it for every retry of the same occurrence.
        """
        if not event.time:
            event.time = time.time()
        hdrs = inject_headers(dict(headers or {}))
        hdrs[MSG_ID_HEADER] = msg_id or message_id_for(event)
        payload = encode_event(event)
        subject = subject_for(event)
        budget = self._cfg.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        delay = backoff_delays(0.05, 1.0)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusUnavailable(f"publish of {subject} timed out after {budget:.1f}s")
            try:
                ack = await self._js.publish(
                    subject, payload, timeout=min(remaining, 2.0), headers=dict(hdrs)
                )
                return int(ack.seq)
            except (
                TimeoutError,
                nats.errors.TimeoutError,
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError,
                nats.errors.StaleConnectionError,
                nats.js.errors.NoStreamResponseError,
                nats.js.errors.ServiceUnavailableError,
            ) as exc:
                wait = min(delay(attempt), max(0.0, deadline - time.monotonic()))
                attempt += 1
                log.debug("publish_retry", subject=subject, error=repr(exc), wait_s=wait)
                await asyncio.sleep(wait)
            except nats.js.errors.APIError as exc:
                if exc.err_code != JS_DUPLICATE_IN_PROCESS:
                    raise
                # The same event (our own retry, or the same verdict from another
                # service: a cancellation's id is its request's) is being stored right
                # now; a replicated stream says so until its replicas agree. Asked
                # again, the server answers with that message's sequence.
                wait = min(0.05 * (attempt + 1), max(0.0, deadline - time.monotonic()))
                attempt += 1
                log.debug("publish_in_process", subject=subject, wait_s=wait)
                await asyncio.sleep(wait)

    async def try_publish(self, event: AnyEvent) -> bool:
        """Publish, or log and return False when the bus is down past the deadline.

        For events whose loss costs accuracy, not correctness (progress, completion
        figures): the caller's request must not fail because NATS blinked.
        """
        try:
            await self.publish(event)
        except BusError as exc:
            log.warning("event_publish_failed", type=type(event).__name__, error=str(exc))
            return False
        return True

    async def last_sequence(self, *, timeout_s: float | None = None) -> int:
        """The sequence of the newest event in the log (0 when empty).

        Tried again until `timeout_s` (default: the request timeout), each try bounded,
        as a publish is: a cluster that is electing the stream's leader does not
        answer for it meanwhile, and an answer from a later try is what the caller
        waits for. Raises `BusUnavailable` when the deadline passes.
        """
        return (await self.log_extent(timeout_s=timeout_s)).last_seq

    async def _retried(
        self, call: Callable[[], Awaitable[T]], *, budget_s: float, attempt_s: float, what: str
    ) -> T:
        """`call()` again, each try bounded by `attempt_s`, until one answers or
        `budget_s` has passed (then `BusUnavailable`): the JetStream API does not
        answer for a stream while its cluster elects the stream's leader, and a later
        try does once it has one."""
        deadline = time.monotonic() + budget_s
        delay = backoff_delays(0.05, 1.0)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusUnavailable(f"no answer for {what} within {budget_s:.1f}s")
            try:
                return await asyncio.wait_for(call(), timeout=min(remaining, attempt_s))
            except (
                TimeoutError,
                nats.errors.TimeoutError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.StaleConnectionError,
                nats.js.errors.ServiceUnavailableError,
            ) as exc:
                wait = min(delay(attempt), max(0.0, deadline - time.monotonic()))
                attempt += 1
                log.debug("bus_retry", what=what, error=repr(exc), wait_s=wait)
                await asyncio.sleep(wait)

    async def read_ordered(
        self,
        subject: str | list[str] = EVENT_SUBJECTS,
        *,
        start_seq: int = 1,
        new_only: bool = False,
        last_per_subject: bool = False,
        stream: str = "",
    ) -> EventReader:
        """An ordered consumer: every matching event from `start_seq` on, in order.

        Ordered consumers are ephemeral and reset themselves on a gap, so the reader
        never skips or repeats an event; after a NATS restart the reader reopens from
        the event after the last one it returned. `new_only` starts after the log's
        current end; `last_per_subject` delivers only the newest event of each subject
        (the current state of per-instance subjects without their whole history).
        `stream` reads another stream than the log (`read_instances`); its sequences
        are its own, so `new_only` is refused with it.
        """
        subjects = [subject] if isinstance(subject, str) else list(subject)
        if new_only and stream:
            raise ValueError("new_only reads the event log only, not another stream")
        if new_only:
            start_seq = await self.last_sequence() + 1
        reader = EventReader(self, subjects, start_seq, last_per_subject, stream=stream)
        # Opening creates a consumer through the JetStream API (see `_retried`).
        await self._retried(
            reader.open, budget_s=OPEN_TIMEOUT_S, attempt_s=OPEN_ATTEMPT_S, what="a reader"
        )
        return reader

    async def _ordered_subscription(
        self,
        subjects: list[str],
        start_seq: int,
        last_per_subject: bool,
        stream: str,
        cb: Callable[[Msg], Awaitable[None]],
    ) -> JetStreamContext.PushSubscription:
        if last_per_subject:
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
        elif start_seq <= 1:
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        else:
            config = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq
            )
        if len(subjects) == 1:
            subject = subjects[0]
        else:
            subject = ""
            config.filter_subjects = subjects
        return await self._js.subscribe(
            subject,
            stream=stream or self._cfg.stream,
            ordered_consumer=True,
            config=config,
            idle_heartbeat=2.0,
            pending_msgs_limit=1_000_000,
            cb=cb,
        )

    async def read_durable(self, durable: str, subject: str = EVENT_SUBJECTS) -> DurableReader:
        """A named pull consumer: its position survives restarts; acked explicitly."""
        sub = await self._js.pull_subscribe(
            subject,
            durable=durable,
            stream=self._cfg.stream,
            config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=10_000),
        )
        return DurableReader(sub)

    # --- ephemeral point-to-point ---------------------------------------------------

    async def request(
        self,
        subject: str,
        payload: bytes,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Msg:
        """Core NATS request/reply with a deadline, carrying the trace context.

        Raises `BusUnavailable` when NATS is down or nobody answers in time (no
        responders or a timeout): the caller decides whether to re-plan or fail.
        """
        if not self._nc.is_connected:
            raise BusUnavailable("not connected to NATS")
        # The current span's context rides in the headers, so the responder's spans
        # join the caller's trace (gateway -> prefill -> decode).
        hdrs = inject_headers(dict(headers or {}))
        try:
            return await self._nc.request(subject, payload, timeout=timeout_s, headers=hdrs or None)
        except nats.errors.NoRespondersError as exc:
            raise BusUnavailable(f"no responders on {subject}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise BusUnavailable(f"no reply on {subject} within {timeout_s:.1f}s") from exc
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as e:
            raise BusUnavailable(f"NATS connection lost during request: {e!r}") from e

    async def publish_core(
        self, subject: str, payload: bytes, *, headers: Mapping[str, str] | None = None
    ) -> None:
        """Fire a core NATS message (token chunks); raises `BusUnavailable` when down."""
        try:
            await self._nc.publish(subject, payload, headers=dict(headers or {}) or None)
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
        ) as exc:
            raise BusUnavailable(f"cannot publish on {subject}: {exc!r}") from exc

    async def subscribe(
        self,
        subject: str,
        *,
        queue: str = "",
        cb: Callable[[Msg], Awaitable[None]] | None = None,
        max_pending: int = 65536,
    ) -> Subscription:
        """A core NATS subscription (callback or iterate `sub.messages`)."""
        return await self._nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=max_pending)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has seen everything sent so far."""
        await self._nc.flush(timeout=timeout_s)


class EventReader:
    """Iterates the log through an ordered consumer; `close()` unsubscribes.

    It remembers the last sequence it returned, so when the bus reconnects (after a
    NATS restart the server no longer knows the consumer) it reopens right after it.
    Reopening runs as the reader's own task, retried until it works (a cluster that
    lost the node holding the consumer, or electing a new leader, refuses JetStream
    requests for several seconds): `next()` waits for it no longer than its own
    timeout, so a caller that reads between other duties (a heartbeat) is never held
    past its deadline, and a caller with a short timeout does not restart it.
    """

    def __init__(
        self,
        bus: Bus,
        subjects: list[str],
        start_seq: int,
        last_per_subject: bool,
        *,
        stream: str = "",
    ) -> None:
        self._bus = bus
        self._stream = stream  # '' for the event log
        self._subjects = subjects
        self._next_seq = start_seq
        self._last_per_subject = last_per_subject
        self._sub: JetStreamContext.PushSubscription | None = None
        # What the subscription delivered and `next()` has not returned yet, and the
        # future `next()` waits on while that is empty (see `open`).
        self._inbox: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._generation = -1
        self._stale = False  # the consumer is gone and must be opened again
        self._closed = False
        self._reopening: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """(Re)create the consumer from the next unseen sequence.

        On failure the reader has no consumer and is marked stale: `next()` opens it
        again.
        """
        generation = self._bus.generation
        self._stale = True
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
        # A callback subscription: nats-py hands each message to it from one task of
        # its own, where `next_msg` made two tasks and a timer per message (the
        # conductor reads every event of the log). Each opening has its own inbox:
        # what an earlier consumer delivered and was not returned comes again from
        # the new one, which starts at the next unseen sequence.
        inbox: deque[Msg] = deque()
        self._inbox = inbox

        async def deliver(msg: Msg) -> None:
            inbox.append(msg)
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        self._sub = await self._bus._ordered_subscription(
            self._subjects, self._next_seq, self._last_per_subject, self._stream, deliver
        )
        self._generation = generation
        self._stale = False
        # A reopened last-per-subject reader must not replay older states.
        self._last_per_subject = False

    async def _reopen(self) -> None:
        """Open again, retrying until it works (cancelled by `close()`)."""
        while not (self._closed or self._bus.closed):
            if self._bus.connected:
                try:
                    # Each try bounded: JetStream's API may not answer while the
                    # cluster has no leader, and a later try may find one.
                    await asyncio.wait_for(self.open(), timeout=REOPEN_ATTEMPT_S)
                    return
                except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                    log.debug("reader_reopen_failed", error=repr(exc))
            await asyncio.sleep(0.2)

    async def next(self, timeout_s: float) -> LoggedEvent | None:
        """The next event, or None if none arrives within `timeout_s`.

        Messages that do not decode are logged and skipped: one bad publisher must
        not stop every consumer of the log.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return None
            reopen = self._stale or self._generation != self._bus.generation
            if reopen and self._bus.connected:
                if self._reopening is None:
                    self._reopening = asyncio.create_task(self._reopen(), name="reader-reopen")
                reopening = self._reopening
                await asyncio.wait({reopening}, timeout=remaining)
                if not reopening.done():
                    return None  # still reopening: the next call waits on
                self._reopening = None
                reopening.result()  # re-raises what no retry covers
                continue
            if self._sub is None:
                if self._stale and not self._bus.closed:
                    # Disconnected: wait for the bus to come back, then reopen.
                    await asyncio.sleep(min(0.2, remaining))
                    continue
                return None
            if not self._inbox:
                if self._bus.closed:
                    self._sub = None
                    return None
                # Woken by the subscription's callback; at most a second, so that a
                # reconnect (a new generation) is noticed at the loop's top.
                self._waiter = waiter = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.wait({waiter}, timeout=min(remaining, 1.0))
                finally:
                    self._waiter = None
                continue
            logged = _decode_logged(self._inbox.popleft())
            if logged is not None and logged.seq:
                self._next_seq = logged.seq + 1
            if logged is not None:
                return logged

    def __aiter__(self) -> EventReader:
        return self

    async def __anext__(self) -> LoggedEvent:
        """Wait for the next event, however long it takes (until cancelled or closed)."""
        while True:
            if self._bus.closed or self._closed:
                raise StopAsyncIteration
            logged = await self.next(timeout_s=60.0)
            if logged is not None:
                return logged

    async def close(self) -> None:
        """Delete the ephemeral consumer; safe to call twice."""
        self._closed = True
        if self._reopening is not None:
            task, self._reopening = self._reopening, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()


class DurableReader:
    """A durable pull consumer: `fetch` a batch, handle it, `ack` each message."""

    def __init__(self, sub: JetStreamContext.PullSubscription) -> None:
        self._sub = sub

    async def fetch(self, batch: int, timeout_s: float) -> list[tuple[LoggedEvent, Msg]]:
        """Up to `batch` events, waiting at most `timeout_s`; empty when none."""
        try:
            msgs = await self._sub.fetch(batch, timeout=timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        out: list[tuple[LoggedEvent, Msg]] = []
        for msg in msgs:
            logged = _decode_logged(msg)
            if logged is None:
                # A poison message would be redelivered forever: terminate it.
                await msg.term()
                continue
            out.append((logged, msg))
        return out

    async def close(self) -> None:
        """Stop pulling (the durable consumer and its position stay on the server)."""
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._sub.unsubscribe()


def _decode_logged(msg: Msg) -> LoggedEvent | None:
    try:
        event = decode_event(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("undecodable_event", subject=msg.subject, error=str(exc))
        return None
    metadata = msg.metadata if msg.reply else None
    seq = int(metadata.sequence.stream) if metadata is not None else 0
    pending = int(metadata.num_pending) if metadata is not None else None
    headers = dict(msg.headers or {})
    size = len(msg.data) + len(msg.subject) + sum(len(k) + len(v) + 4 for k, v in headers.items())
    return LoggedEvent(
        seq=seq, subject=msg.subject, event=event, headers=headers, size=size, pending=pending
    )
