"""How every Yuebing process lives and dies.

A service owns its long-running tasks through a `Supervisor`: each is started in one
place with a name, a crash in any of them is noticed at once (`asyncio.wait` with
FIRST_EXCEPTION), and shutdown runs in named steps — stop taking work, drain, cancel
leftovers, close connections — bounded by a graceful timeout. `run_service` wires
that to SIGINT/SIGTERM, logging, tracing and the metrics endpoint, and gives the
process exit code: 0 after a requested stop, 1 after a crash. A second signal while
the service stops hurries it (`Service.hurry`: an engine ends its drain at once);
the stop as a whole is bounded by `Service.stop_timeout_s` either way.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry

from yb_core.bus import Bus
from yb_core.config import ConfigError, YbConfig, load_config
from yb_core.telemetry import (
    MetricsServer,
    configure_logging,
    configure_tracing,
    get_logger,
)

log = get_logger(__name__)


class Supervisor:
    """Owns named tasks: starts them, notices the first crash, cancels them all."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._closed = False

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start `coro` as a task owned by this supervisor."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name}: cannot spawn {name} after shutdown")
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks[task] = name
        task.add_done_callback(self._forget_if_clean)
        return task

    def _forget_if_clean(self, task: asyncio.Task[Any]) -> None:
        # Tasks that end normally or are cancelled (a request given up) leave; a failed
        # one stays so `wait_failure` sees it. Keeping cancelled ones would grow the
        # table by one entry per cancelled request for the life of the process.
        if task.cancelled() or task.exception() is None:
            self._tasks.pop(task, None)

    def failures(self) -> list[str]:
        """The owned tasks that failed, as 'name: exception' (for diagnostics)."""
        return [
            f"{name}: {task.exception()!r}"
            for task, name in self._tasks.items()
            if task.done() and not task.cancelled() and task.exception() is not None
        ]

    async def wait_failure(self) -> None:
        """Return when any owned task fails, re-raising its exception.

        A task that finishes normally is not a failure. Returns only by raising, or
        never (callers race it against their stop signal).
        """
        while True:
            pending = [t for t in self._tasks if not t.done()]
            failed = [t for t in self._tasks if t.done() and not t.cancelled() and t.exception()]
            if failed:
                task = failed[0]
                exc = task.exception()
                assert exc is not None
                log.error("task_failed", task=self._tasks[task], error=repr(exc))
                raise exc
            if not pending:
                await asyncio.sleep(0.1)
                continue
            await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION, timeout=1.0)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Cancel every owned task and wait for them (at most `timeout_s`); idempotent."""
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _done, still = await asyncio.wait(tasks, timeout=timeout_s)
            for task in still:
                log.warning("task_did_not_stop", task=self._tasks.get(task, "?"))
        self._tasks.clear()


class Service(abc.ABC):
    """Base of every Yuebing service process.

    Subclasses implement `start` (connect, announce, spawn tasks with
    `self.tasks.spawn`) and `stop` (stop taking work, drain, release). `stop` must be
    safe to call twice and after a failed `start`.
    """

    role: str = "service"
    #: How long `run_service` lets `stop` take before it gives up on it (an engine
    #: adds its drain to it).
    stop_timeout_s: float = 15.0

    def __init__(self, cfg: YbConfig) -> None:
        self.cfg = cfg
        self.instance_id = cfg.instance_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.tasks = Supervisor(self.instance_id)
        # This process's Prometheus collectors, served at /metrics.
        self.registry = CollectorRegistry()
        self.metrics_port = 0

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the service up; return once it serves."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop taking work, drain, cancel leftovers, close connections."""

    def hurry(self) -> None:  # noqa: B027 (optional hook)
        """Told again to stop while stopping (a second signal): cut short what `stop`
        waits for that can be cut short (an engine's drain). Called on the loop."""

    async def connect_bus(self) -> Bus:
        """Connect to NATS (waiting as long as it takes) and make sure the log exists."""
        bus = await Bus.connect(self.cfg.nats, self.instance_id)
        await bus.ensure_stream()
        return bus

    def serve_metrics(self) -> None:
        """Expose this process's registry at /metrics on the configured interface,
        until `self.tasks` shuts down (an owned task holds the listener and closes it)."""
        tcfg = self.cfg.telemetry
        server = MetricsServer(
            self.registry, tcfg.metrics_host, tcfg.metrics_port, tcfg.resolved_metrics_token()
        )
        self.metrics_port = server.port
        self.tasks.spawn("metrics-server", server.serve_until_cancelled())
        log.info("metrics_listening", host=tcfg.metrics_host, port=self.metrics_port)

    @property
    def metrics_address(self) -> str:
        """host:port of the metrics endpoint ('' if not served)."""
        if not self.metrics_port:
            return ""
        return f"{self.cfg.telemetry.metrics_host}:{self.metrics_port}"


def parse_args(prog: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line every service shares: a config file and an instance id."""
    parser = argparse.ArgumentParser(prog=prog, description=f"Yuebing {prog} service")
    parser.add_argument("--config", help="config file (TOML, YAML or JSON); default $YB_CONFIG")
    parser.add_argument("--instance-id", help="name of this instance on the bus")
    return parser.parse_args(argv)


#: The cyclic collector's generation-0 threshold once a service has started (Python's
#: default is 700 allocations).
GC_THRESHOLD_AFTER_START = 10_000


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the cyclic collector's
    reach (`gc.freeze`), and collect the young generation less often.

    An engine's heap after start is hundreds of thousands of objects that live as long
    as the process (torch, transformers, the model, the tokenizer), and every full
    collection walked them all again: 100 ms and more on the event loop, a few times a
    minute under load, for nothing. Objects made later are collected as before; the
    higher threshold (`GC_THRESHOLD_AFTER_START`) makes the young collections, which
    a request's hundreds of short-lived objects trigger, ten times rarer. Called once
    a service has started, and again by one that loads something large after (the
    gateway's tokenizer).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD_AFTER_START, older, oldest)


def run_service(
    role: str,
    factory: Callable[[YbConfig], Service],
    argv: Sequence[str] | None = None,
) -> int:
    """Entry point of `python -m yb_<role>`: run until SIGINT/SIGTERM or a crash."""
    args = parse_args(f"yb_{role}", argv)
    try:
        overrides = {"instance_id": args.instance_id} if args.instance_id else None
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"yb_{role}: {exc}", file=sys.stderr)
        return 2
    service = factory(cfg)
    configure_logging(role, service.instance_id, cfg.telemetry)
    try:
        configure_tracing(role, service.instance_id, cfg.telemetry)
    except ConfigError as exc:  # an OTLP endpoint without the exporter package
        print(f"yb_{role}: {exc}", file=sys.stderr)
        return 2
    # uvloop: asyncio's loop in C. Every hop of a request wakes several loops (the
    # bus client's, the transport's, the service's own tasks), and on a machine whose
    # cores all run services each wake-up's CPU is what bounds requests per second
    # (benchmarks/overhead.py measures both).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_run(service))


async def _run(service: Service) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("starting", role=service.role, pid=os.getpid(), host=socket.gethostname())
    code = 0
    try:
        await _race(service.start(), stop)
        if not stop.is_set():
            freeze_startup_heap()
            log.info("started", role=service.role)
            await _race(service.tasks.wait_failure(), stop)
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # a crash: log it, stop cleanly, exit non-zero
        log.exception("service_crashed", error=repr(exc))
        code = 1
    finally:
        log.info("stopping", role=service.role)
        # From now on a signal hurries the stop rather than asking for it again.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.hurry)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.stop(), timeout=service.stop_timeout_s)
        log.info("stopped", role=service.role)
    return code


async def _race(work: Awaitable[Any], stop: asyncio.Event) -> None:
    """Run `work` until it ends or `stop` is set (then cancel it)."""
    work_task = asyncio.ensure_future(work)
    stop_task = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.done() and not work_task.cancelled():
        work_task.result()
