"""Logs, traces and metrics, set up the same way in every service.

- Logs are structlog JSON lines on stderr; `bind_request(request_id)` binds the id to
  every line logged in that task (contextvars), so one grep follows a request.
- Traces are OpenTelemetry spans; their context is injected into NATS headers
  (`inject_headers`) and extracted on the other side (`extract_context`), so one
  trace runs gateway -> prefill -> decode. Spans go to an OTLP collector when one is
  configured, else to stderr when asked, else nowhere (the context still travels).
- Metrics are Prometheus collectors on a per-process registry served at `/metrics`
  by `start_metrics_server` (the gateway also mounts them on its own HTTP app).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.exposition import generate_latest

from yb_shared.config import TelemetryConfig

_configured = threading.Lock()
_done = False


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


def configure_tracing(service: str, instance_id: str, cfg: TelemetryConfig) -> None:
    """Install the process's tracer provider once."""
    global _done
    with _configured:
        if _done:
            return
        provider = TracerProvider(
            resource=Resource.create(
                {"service.name": f"yuebing-{service}", "service.instance.id": instance_id}
            )
        )
        if cfg.otlp_endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                    OTLPSpanExporter,
                )
            except ImportError:
                get_logger(__name__).warning(
                    "otlp_exporter_missing",
                    hint="pip install opentelemetry-exporter-otlp-proto-http",
                )
            else:
                provider.add_span_processor(
                    BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint))
                )
        if cfg.console_traces:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        trace.set_tracer_provider(provider)
        _done = True


def tracer(name: str) -> trace.Tracer:
    """The tracer for a module."""
    return trace.get_tracer(name)


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


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` at http://host:port/metrics in a daemon thread; returns the port.

    Port 0 picks a free port, which is announced in the instance's `InstanceUp`.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
