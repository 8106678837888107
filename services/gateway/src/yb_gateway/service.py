"""The gateway process: HTTP at once, the bus and the tokenizer as they come.

`start()` binds the HTTP socket itself (a port in use fails the start with a clear
error, not a `sys.exit` inside uvicorn) and serves straight away, so `/healthz`
answers while NATS is still down and the tokenizer still loading. The bus is
connected by a task that retries for as long as the process lives; once connected it
opens the decision consumer (before any request can be admitted) and follows the
instance events for `/readyz`. Until then generation requests answer 503.

`stop()` runs in named steps: stop accepting, let the batch lines in flight finish
(`gateway.batch_drain_s`), end in-flight requests (each is cancelled on the bus), let
uvicorn drain, cancel the owned tasks, close the bus.

The batch worker (`yb_gateway.batches`) is an owned task too: it runs the lines of
the batches whose lease this gateway holds, through the same request path as HTTP.

While connected the gateway heartbeats like an engine (`LoadReport`s), and its
`InstanceUp` carries an epoch that is new in every process: the conductor cancels the
requests of a gateway that fell silent or came back as a new process (their clients
are gone), so no engine keeps working for nobody. The other way round, the gateway
follows `InstanceDown`: a request whose decode instance, or whose prefill instance
before its first token, is declared dead ends at once with a 503 instead of waiting
for a token that will never come. When the connection moves to another NATS node,
every stream in flight asks its decode instance for the chunks lost meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats.errors
import nats.js.errors
import uvicorn
from opentelemetry.context import Context

from yb_core import events as ev
from yb_core import protocol
from yb_core.bus import Bus, BusError, BusUnavailable, EventReader, backoff_delays
from yb_core.config import YbConfig
from yb_core.events import decision_subjects
from yb_core.instance import Presence
from yb_core.model_files import context_limit
from yb_core.service import Service, freeze_startup_heap
from yb_core.telemetry import get_logger
from yb_gateway.app import create_app
from yb_gateway.batch_routes import BatchApi
from yb_gateway.batch_store import BatchStore
from yb_gateway.batches import BatchWorker
from yb_gateway.completions import CompletionsEndpoint
from yb_gateway.decisions import DecisionRouter
from yb_gateway.errors import unavailable
from yb_gateway.metrics import GatewayMetrics
from yb_gateway.prompt import PreparedRequest, PromptEncoder
from yb_gateway.readiness import INSTANCE_SUBJECTS, InstanceTracker
from yb_gateway.session import RequestSession
from yb_gateway.slow_clients import ClientLimits, guarded_protocol
from yb_gateway.token_routes import TokenRoutes

log = get_logger(__name__)

# How long uvicorn waits for open responses once told to stop.
GRACEFUL_HTTP_S = 5


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: `run_service` owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class GatewayService(Service):
    """The OpenAI-compatible front door of a Yuebing cluster."""

    role = "gateway"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg)
        # The gateway's series, registered on the registry `/metrics` serves, each
        # tier's exported from the start.
        self.metrics = GatewayMetrics(self.registry, list(cfg.gateway.resolved_service_tiers()))
        self.started_at = int(time.time())
        self.decisions = DecisionRouter()
        self.tokens = TokenRoutes()
        self.instances = InstanceTracker(cfg.model.name, cfg.conductor.heartbeat_timeout_s)
        self.completions = CompletionsEndpoint(self, cfg, self.metrics)
        self.encoder: PromptEncoder | None = None
        self.encoder_state = "loading"
        self.bus: Bus | None = None  # set while connected and following the log
        self.port = cfg.gateway.port  # the bound port once started (config may say 0)
        self._sessions: dict[str, RequestSession] = {}
        # One thread for every tokenizer call (see `prompt`).
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="yb-tokenizer")
        self._server: _Server | None = None
        self._http_task: asyncio.Task[Any] | None = None
        self._connection: Bus | None = None
        self._presence: Presence | None = None
        self._stopping = False
        # This process's incarnation: a restart under the same id is a new epoch, so
        # the conductor knows the requests of the old one are orphans.
        self.epoch = time.time_ns()
        # The Batch API: its buckets on the bus of the moment, the worker that runs
        # batch lines through the same request path, and the routes' logic.
        self._batch_store: BatchStore | None = None
        self._batch_store_bus: Bus | None = None
        self._batch_store_lock = asyncio.Lock()
        self.batch_worker = BatchWorker(
            cfg, f"{self.instance_id}:{self.epoch}", self.completions.runner, self.batch_store
        )
        self.batches = BatchApi(cfg, self.batch_store, self.batch_worker.wake)

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Serve HTTP now; connect the bus and load the tokenizer in the background."""
        gcfg = self.cfg.gateway
        sock = _listen(gcfg.host, gcfg.port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            create_app(self.cfg, self),
            # Bounds the clients that trickle a request or do not read the answer.
            http=guarded_protocol(ClientLimits.from_config(gcfg), self.metrics),
            log_config=None,
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=GRACEFUL_HTTP_S,
        )
        self._server = _Server(config)
        self._http_task = self.tasks.spawn("http", self._server.serve(sockets=[sock]))
        await self._until_serving()
        self.tasks.spawn("tokenizer", self._load_tokenizer())
        self.tasks.spawn("bus", self._run_bus())
        self.tasks.spawn("batches", self.batch_worker.run())
        log.info("gateway_listening", host=gcfg.host, port=self.port, model=self.cfg.model.name)

    async def _until_serving(self, timeout_s: float = 10.0) -> None:
        assert self._server is not None and self._http_task is not None
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._http_task.done():
                self._http_task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {timeout_s}s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, cancel in-flight requests, drain, close; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        log.info("gateway_stopping", in_flight=len(self._sessions))
        # 1. Stop accepting: uvicorn closes its listener at its next tick.
        if self._server is not None:
            self._server.should_exit = True
        # 1b. Start no batch line; let those running finish and be recorded (a line
        #     cut off here would run again on the gateway that takes its batch).
        await self.batch_worker.drain(self.cfg.gateway.batch_drain_s)
        # 2. End every in-flight request: its waits fail with 503 (or an SSE error
        #    event) and it is cancelled on the bus so engines free it.
        sessions = list(self._sessions.values())
        for session in sessions:
            session.abort("The gateway is shutting down.")
        if sessions:
            await asyncio.wait(
                [asyncio.ensure_future(s.close("gateway shutting down")) for s in sessions],
                timeout=self.cfg.nats.request_timeout_s,
            )
        # 3. Let uvicorn finish the responses that are ending now.
        if self._http_task is not None and not self._http_task.done():
            await asyncio.wait([self._http_task], timeout=GRACEFUL_HTTP_S + 1)
        # 4. Say goodbye on the log, then cancel what is left (bus follower, tokenizer
        #    load, stray closes).
        await self._retire()
        await self.tasks.shutdown()
        # 5. Close the connection (the follower closes it too; both are idempotent).
        if self._connection is not None:
            await self._connection.close()
        self.bus = None
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        log.info("gateway_stopped")

    # --- background parts -----------------------------------------------------------

    async def _load_tokenizer(self) -> None:
        model = self.cfg.model
        try:
            self.encoder = await PromptEncoder.load(
                model, self.cfg.model_cache_dir(), self._tokenizer_thread
            )
        except Exception as exc:
            # Not fatal: the process keeps answering probes, and /readyz says why it
            # will not serve.
            self.encoder_state = f"failed: {exc!r}"
            log.error("tokenizer_load_failed", source=model.source, error=repr(exc))
            return
        self.encoder_state = "loaded"
        log.info("tokenizer_loaded", source=model.source, vocab=self.encoder.vocab_size)
        # The served context is the smaller of the configured one and what the model
        # can attend to: a longer prompt is the client's error (400), refused here,
        # not a job that fails in the engine.
        try:
            limit = await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_thread, context_limit, model, self.cfg.model_cache_dir()
            )
        except (OSError, ValueError) as exc:
            log.warning("model_context_limit_unknown", error=repr(exc))
            limit = None
        if limit is not None and limit < model.max_model_len:
            log.info("max_model_len_capped", configured=model.max_model_len, model_limit=limit)
            model.max_model_len = limit
        # The tokenizer, and what reading the model's limit imported, loaded after the
        # service started.
        freeze_startup_heap()

    async def _run_bus(self) -> None:
        """Connect, follow the log, and start over whenever that breaks; never returns.

        Once connected, nats-py rides out short outages by itself (and the ordered
        consumers reset themselves); this loop only handles a connection that cannot
        be made or set up.
        """
        ncfg = self.cfg.nats
        delay = backoff_delays(ncfg.reconnect_wait_s, ncfg.max_reconnect_wait_s)
        attempt = 0
        while True:
            try:
                bus = await Bus.connect(
                    ncfg,
                    f"yb-gateway:{self.instance_id}",
                    timeout_s=max(1.0, ncfg.connect_timeout_s),
                    on_state=self._on_bus_state,
                )
            except BusUnavailable as exc:
                if attempt % 20 == 0:  # say so, but do not flood the log
                    log.warning("nats_unreachable", url=ncfg.url, attempt=attempt, error=str(exc))
                await asyncio.sleep(delay(attempt))
                attempt += 1
                continue
            self._connection = bus
            try:
                await self._follow(bus)
                attempt = 0
            except (BusError, nats.errors.Error, OSError, TimeoutError) as exc:
                log.warning("bus_follow_failed", error=repr(exc))
            except Exception as exc:
                # Whatever else breaks the connection's setup or its followers, the
                # process must keep answering: log it loudly and start over.
                log.exception("bus_follow_crashed", error=repr(exc))
            finally:
                self.decisions.ready = False
                self.bus = None
                await bus.close()
            await asyncio.sleep(delay(attempt))
            attempt += 1

    async def _on_bus_state(self, state: str) -> None:
        # Token chunks are core NATS messages: those published while the connection
        # moved to another node are lost. Every stream asks its decode instance for
        # them again (nats-py calls this once its subscriptions are back).
        if state == "connected":
            for session in list(self._sessions.values()):
                session.bus_reconnected()

    async def _follow(self, bus: Bus) -> None:
        try:
            await bus.ensure_stream()
        except nats.js.errors.Error as exc:
            # Another service may own the stream with settings we may not change;
            # reading it is all the gateway needs.
            log.warning("ensure_stream_failed", error=repr(exc))
        # The decision consumer exists before any request is admitted, so no
        # decision can be published before someone listens for it.
        decisions = await bus.read_ordered(decision_subjects(self.instance_id), new_only=True)
        # Only the newest event per instance subject: the current state, not history,
        # from the instance stream, which keeps it whatever the event log trimmed.
        instances = await bus.read_instances(INSTANCE_SUBJECTS)
        # Likewise every token subject of this gateway: one subscription for all its
        # requests (`token_routes`).
        tokens = await bus.subscribe(
            protocol.token_subjects(self.instance_id), cb=self.tokens.deliver
        )
        self.bus = bus
        self.decisions.ready = True
        log.info("bus_ready", url=self.cfg.nats.url)
        presence = self._presence = self._new_presence(bus)
        try:
            await presence.announce()
        except BusError as exc:
            log.warning("announce_failed", error=str(exc))
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.decisions.follow(decisions))
                group.create_task(self._follow_instances(instances))
                group.create_task(presence.run())
        finally:
            if self._presence is presence:
                self._presence = None
            await decisions.close()
            await instances.close()
            with contextlib.suppress(nats.errors.Error, OSError):
                await tokens.unsubscribe()

    def _new_presence(self, bus: Bus) -> Presence:
        # The gateway takes no placement, but `yb status` lists what the log says is
        # up, and its heartbeat lets the conductor cancel the requests of a gateway
        # that died; the reports' interval leaves a few inside the timeout.
        gcfg = self.cfg.gateway
        return Presence(
            bus,
            ev.InstanceUp(
                instance_id=self.instance_id,
                role="gateway",
                host=self.cfg.host,
                model=self.cfg.model.name,
                metrics_address=f"{gcfg.host}:{self.port}",
                epoch=self.epoch,
            ),
            self._load_report,
            min(1.0, self.cfg.conductor.heartbeat_timeout_s / 4),
        )

    def _load_report(self) -> ev.LoadReport:
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="gateway",
            queued_requests=self.decisions.waiting,
            running_requests=len(self._sessions),
        )

    async def _follow_instances(self, reader: EventReader) -> None:
        """Fold instance events for `/readyz`, and end the requests that depended on
        an instance declared down."""
        async for logged in reader:
            event = logged.event
            self.instances.apply(event)
            if isinstance(event, ev.InstanceDown):
                for session in list(self._sessions.values()):
                    session.instance_down(event.instance_id, event.reason, logged.log_seq)

    async def _retire(self) -> None:
        bus = self.bus
        presence = self._presence
        if bus is None or not bus.connected or presence is None:
            return
        # Through the presence: it must not take our own goodbye for a verdict.
        await presence.retire("stopped")

    # --- what the endpoints use -----------------------------------------------------

    async def wait_for_bus(self) -> None:
        """Wait up to `gateway.bus_grace_s` for the bus to be usable, so a request
        that arrives while the client moves to another NATS node waits for it
        rather than failing; `open_session` answers 503 if it is still down."""
        deadline = time.monotonic() + self.cfg.gateway.bus_grace_s
        while not self._bus_usable() and not self._stopping and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _bus_usable(self) -> bool:
        bus = self.bus
        return bus is not None and bus.connected and self.decisions.ready

    def open_session(
        self,
        request_id: str,
        endpoint: str,
        prepared: PreparedRequest,
        arrived: float,
        trace_parent: Context | None = None,
    ) -> RequestSession:
        """A session for an admitted request; 503 if the bus cannot take it now."""
        if self._stopping:
            raise unavailable("The gateway is shutting down.", code="shutting_down")
        bus = self.bus
        if bus is None or not self._bus_usable():
            raise unavailable("The event bus (NATS) is not connected.", code="bus_unavailable")
        session = RequestSession(
            request_id=request_id,
            endpoint=endpoint,
            prepared=prepared,
            bus=bus,
            gateway_id=self.instance_id,
            cfg=self.cfg,
            router=self.decisions,
            tokens=self.tokens,
            metrics=self.metrics,
            arrived=arrived,
            trace_parent=trace_parent,
        )
        self._sessions[request_id] = session
        return session

    async def release(self, session: RequestSession, reason: str) -> None:
        """Close a session (cancelling it on the bus if unfinished), even if the
        caller is being cancelled: the close runs as an owned task of its own."""
        self._sessions.pop(session.request_id, None)
        try:
            task = self.tasks.spawn(f"close:{session.request_id}", session.close(reason))
        except RuntimeError:  # already shut down: close inline
            await session.close(reason)
            return
        await asyncio.shield(task)

    async def batch_store(self) -> BatchStore | None:
        """The Batch API's buckets on the current bus (opened on first use after each
        connection); None while the bus is down. Raises what JetStream raises."""
        bus = self.bus
        if bus is None or not bus.connected:
            return None
        async with self._batch_store_lock:
            if self._batch_store is None or self._batch_store_bus is not bus:
                gcfg = self.cfg.gateway
                self._batch_store = await BatchStore.open(
                    bus.jetstream,
                    gcfg.batch_bucket,
                    replicas=self.cfg.nats.replicas,
                    lease_ttl_s=gcfg.batch_lease_ttl_s,
                    timeout_s=self.cfg.nats.request_timeout_s,
                )
                self._batch_store_bus = bus
            return self._batch_store

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return len(self._sessions)

    def readiness(self) -> dict[str, Any]:
        """What `/readyz` reports: ready, or what is missing."""
        now = time.time()
        model = self.cfg.model.name
        bus = self.bus
        bus_ok = bus is not None and bus.connected and self.decisions.ready
        prefill = self.instances.alive("prefill", now)
        decode = self.instances.alive("decode", now)
        missing = []
        if not bus_ok:
            missing.append("event bus (NATS) connection")
        if self.encoder is None:
            missing.append(f"tokenizer ({self.encoder_state})")
        if not prefill:
            missing.append(f"a live prefill instance serving {model}")
        if not decode:
            missing.append(f"a live decode instance serving {model}")
        return {
            "ready": not missing,
            "missing": missing,
            "model": model,
            "bus": "connected" if bus_ok else "disconnected",
            "tokenizer": self.encoder_state,
            "prefill_instances": prefill,
            "decode_instances": decode,
        }
