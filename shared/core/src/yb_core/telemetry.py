"""Logs, traces and metrics, set up the same way in every service.

- Logs are structlog JSON lines on stderr; `bind_request(request_id)` binds the id to
  every line logged in that task (contextvars), so one grep follows a request.
- Traces are OpenTelemetry spans; their context is injected into NATS headers
  (`inject_headers`, the event log's included) and extracted on the other side
  (`extract_context`), so one request is one trace: gateway -> conductor, gateway ->
  prefill -> decode. Spans go to an OTLP receiver when `telemetry.otlp_endpoint` is
  set (`span_exporter`), to stderr when asked, or nowhere: then they record nothing
  and cost next to nothing, and only their context travels (trace ids in logs).
  Buffered spans are flushed at exit, within `telemetry.otlp_timeout_s`.
- Metrics are Prometheus collectors on a per-process registry served at `/metrics`
  by a `MetricsServer` (the gateway also mounts them on its own HTTP app). The
  listener binds to the configured interface only and asks for the metrics token
  when one is configured; it refuses to start on a non-loopback interface without
  one, because label values and instance names are not for the whole network.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.exposition import generate_latest

from yb_core.auth import bearer_token, matches_any
from yb_core.config import ConfigError, TelemetryConfig
from yb_core.netaddr import is_loopback

_configured = threading.Lock()


def configure_logging(service: str, instance_id: str, cfg: TelemetryConfig) -> None:
    """Route stdlib and structlog logs to stderr as JSON (or console) lines."""
    level = getattr(logging, cfg.log_level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if cfg.log_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Third-party libraries log through stdlib: keep them quiet and in the same stream.
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, instance=instance_id)


def get_logger(name: str) -> Any:
    """A structlog logger; bound context (service, request id) is added per line."""
    return structlog.get_logger(name)


@contextmanager
def bind_request(request_id: str) -> Iterator[None]:
    """Bind `request_id` to every log line emitted inside the block (this task only)."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


#: The span exporters' modules, by `telemetry.otlp_protocol` (both ship with the
#: `opentelemetry-exporter-otlp` package).
OTLP_EXPORTER_MODULES = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}
#: The OTLP/HTTP path of traces, appended to the configured base endpoint.
OTLP_TRACES_PATH = "/v1/traces"

_provider: TracerProvider | None = None  # installed by `configure_tracing`
_flushed = False
_flush_timeout_s = 5.0


def otlp_traces_url(endpoint: str, protocol: str) -> str:
    """Where the exporter for `protocol` sends spans, given `telemetry.otlp_endpoint`.

    OTLP/HTTP: the endpoint is the receiver's base URL and `/v1/traces` is appended
    (the convention of `OTEL_EXPORTER_OTLP_ENDPOINT`; the Python exporter itself
    takes the full URL), unless it is there already. gRPC: the URL as given (the
    exporter keeps its host and port, and `http://` means plaintext).
    """
    if protocol != "http/protobuf" or endpoint.rstrip("/").endswith(OTLP_TRACES_PATH):
        return endpoint
    return endpoint.rstrip("/") + OTLP_TRACES_PATH


def span_exporter(cfg: TelemetryConfig) -> SpanExporter | None:
    """The OTLP span exporter `cfg` asks for, or None without `otlp_endpoint`.

    Raises `ConfigError` when the exporter package is not installed: a process told
    to export its traces and unable to must not start and silently export nothing.
    """
    if not cfg.otlp_endpoint:
        return None
    module_name = OTLP_EXPORTER_MODULES[cfg.otlp_protocol]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"telemetry.otlp_endpoint is set ({cfg.otlp_endpoint}) but the OTLP "
            f"{cfg.otlp_protocol} span exporter cannot be imported ({exc}): install the "
            "opentelemetry-exporter-otlp package, or unset telemetry.otlp_endpoint"
        ) from exc
    url = otlp_traces_url(cfg.otlp_endpoint, cfg.otlp_protocol)
    exporter: SpanExporter = module.OTLPSpanExporter(endpoint=url, timeout=cfg.otlp_timeout_s)
    return exporter


def build_tracer_provider(service: str, instance_id: str, cfg: TelemetryConfig) -> TracerProvider:
    """A tracer provider for one process, exporting where `cfg` says.

    With an exporter (OTLP or the console) spans are sampled as their parent was, and
    a root by its trace id with probability `trace_sample_ratio` (the same id gives
    the same answer in every service); without one, none is recorded (`ALWAYS_OFF`): a span
    is then a bare context, which costs no attributes, no events and no export, and
    still carries the trace id on to the next service and into the logs.
    """
    exporters: list[SpanExporter] = []
    otlp = span_exporter(cfg)
    if otlp is not None:
        exporters.append(otlp)
    if cfg.console_traces:
        exporters.append(ConsoleSpanExporter(out=sys.stderr))
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": f"yuebing-{service}", "service.instance.id": instance_id}
        ),
        sampler=ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio)) if exporters else ALWAYS_OFF,
        # Flushed by `shutdown_tracing`, with a deadline of ours (the SDK's own exit
        # hook waits up to 30 s per processor for an unreachable receiver).
        shutdown_on_exit=False,
    )
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure_tracing(service: str, instance_id: str, cfg: TelemetryConfig) -> None:
    """Install the process's tracer provider once; its spans are flushed at exit.

    Raises `ConfigError` when `telemetry.otlp_endpoint` is set and the exporter
    package is missing.
    """
    global _provider, _flush_timeout_s
    with _configured:
        if _provider is not None:
            return
        provider = build_tracer_provider(service, instance_id, cfg)
        trace.set_tracer_provider(provider)
        _provider = provider
        _flush_timeout_s = cfg.otlp_timeout_s
        atexit.register(shutdown_tracing)


def shutdown_tracing(timeout_s: float | None = None) -> bool:
    """Export the spans still buffered and stop the exporters; idempotent.

    Waits at most `timeout_s` (default: `telemetry.otlp_timeout_s`), so an
    unreachable receiver cannot hold a stopping process; returns False if the flush
    did not finish in time. Runs at interpreter exit by itself (registered by
    `configure_tracing`), so a short run loses none of its spans.
    """
    global _flushed
    with _configured:
        provider = None if _flushed else _provider
        _flushed = True
    if provider is None:
        return True
    # In a thread: the SDK's shutdown has no overall deadline of its own.
    flusher = threading.Thread(target=provider.shutdown, name="yb-trace-flush", daemon=True)
    flusher.start()
    flusher.join(_flush_timeout_s if timeout_s is None else timeout_s)
    return not flusher.is_alive()


def tracer(name: str) -> trace.Tracer:
    """The tracer for a module."""
    return trace.get_tracer(name)


@contextmanager
def child_span(module_tracer: trace.Tracer, name: str) -> Iterator[trace.Span]:
    """A span under the current one, current inside the block.

    When the current span records nothing (tracing off, or the trace not sampled),
    no span is made and the block gets a non-recording one: callers build their
    attributes only `if span.is_recording()`. An exception leaving the block is
    recorded on the span and marks it failed.
    """
    if not trace.get_current_span().is_recording():
        yield trace.INVALID_SPAN
        return
    with module_tracer.start_as_current_span(name) as span:
        yield span


def wall_time_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as the epoch nanoseconds spans are stamped with
    (to open a span at a moment already past, such as a request's arrival)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span context (W3C `traceparent`)."""
    carrier: dict[str, str] = {} if headers is None else headers
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The span context sent by the peer, to parent this side's spans."""
    return propagate.extract(dict(headers or {}))


def trace_carrier(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Just the trace-context entries of a message's headers (to keep past the message)."""
    return {k: v for k, v in (headers or {}).items() if k in ("traceparent", "tracestate")}


def trace_id_hex(headers: Mapping[str, str] | None) -> str:
    """The trace id carried in headers, or '' (for logs and tests)."""
    span = trace.get_current_span(extract_context(headers))
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class MetricsServer:
    """`GET /metrics` of one registry on its own socket, served by a daemon thread.

    With a `token`, a request without `Authorization: Bearer <token>` gets 401 and no
    data. Without one, the listener must be on loopback: a service told to expose
    unauthenticated metrics to the network refuses to start (`ConfigError`) rather
    than do it quietly.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str = "") -> None:
        if not token and not is_loopback(host):
            raise ConfigError(
                f"telemetry.metrics_host={host!r} is not a loopback address and no "
                "telemetry.metrics_token is set: refusing to serve /metrics to the "
                "network without authentication. Set YB_TELEMETRY__METRICS_TOKEN (or "
                "metrics_token_file), or bind metrics_host to 127.0.0.1."
            )
        handler = _metrics_handler(registry, [token.encode()] if token else None)
        server_class = _V6MetricsHTTPServer if ":" in host else _MetricsHTTPServer
        self._httpd = server_class((host, port), handler)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="yb-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket; idempotent. Blocks until the serving
        thread notices (up to its half-second poll)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

    async def serve_until_cancelled(self) -> None:
        """Serve until cancelled, then close: run as a task a service owns, so that
        stopping the service frees the listener and its thread (one per stopped
        service otherwise leaked for the life of the process, e.g. a test session)."""
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            # In a thread: `close` waits for the serving thread's next poll.
            await asyncio.to_thread(self.close)


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True


class _V6MetricsHTTPServer(_MetricsHTTPServer):
    address_family = socket.AF_INET6


def _metrics_handler(
    registry: CollectorRegistry, accepted: list[bytes] | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            # Authentication first: an unauthenticated caller learns nothing, not
            # even which paths exist.
            if accepted is not None:
                presented = bearer_token(self.headers.get("Authorization", ""))
                if not matches_any(presented, accepted):
                    self._answer(
                        401,
                        b"metrics need Authorization: Bearer <telemetry.metrics_token>\n",
                        "text/plain; charset=utf-8",
                        {"WWW-Authenticate": 'Bearer realm="metrics"'},
                    )
                    return
            if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                self._answer(404, b"not found; metrics are at /metrics\n", "text/plain")
                return
            self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _answer(
            self, status: int, body: bytes, media: str, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes are not worth a log line each."""

    return Handler


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
