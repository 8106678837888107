"""A real OTLP trace receiver for tests: what a collector or Jaeger does on the wire.

`OtlpReceiver` listens for OTLP/HTTP (`POST /v1/traces`, a protobuf
`ExportTraceServiceRequest`, plain or gzip/deflate encoded) and, when asked, OTLP/gRPC
(`opentelemetry.proto.collector.trace.v1.TraceService/Export`). It decodes every
request with the OTLP protobuf types (the `opentelemetry-proto` package the exporter
itself depends on) and keeps the spans, each with the `service.name` of its resource,
so a test can check what services exported and how their spans link up.

Requests to any other path are answered 404 and counted in `rejected`: an exporter
that sends to the wrong URL shows up there instead of as silence.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as a receiver decoded it; ids are lower-case hex ('' for no parent)."""

    service: str
    instance: str
    scope: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    kind: int
    status_code: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)

    def __str__(self) -> str:
        parent = self.parent_span_id or "root"
        return f"{self.service}: {self.name!r} {self.trace_id}/{self.span_id} <- {parent}"


def any_value(value: AnyValue) -> Any:
    """An OTLP attribute value as a Python value."""
    match value.WhichOneof("value"):
        case "string_value":
            return value.string_value
        case "bool_value":
            return value.bool_value
        case "int_value":
            return value.int_value
        case "double_value":
            return value.double_value
        case "bytes_value":
            return value.bytes_value
        case "array_value":
            return [any_value(v) for v in value.array_value.values]
        case "kvlist_value":
            return attributes_of(value.kvlist_value.values)
        case _:
            return None


def attributes_of(pairs: Any) -> dict[str, Any]:
    """OTLP `KeyValue`s as a dict."""
    out: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        out[pair.key] = any_value(pair.value)
    return out


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one export request, with its resource's service and instance."""
    found: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        instance = str(resource.get("service.instance.id", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    ReceivedSpan(
                        service=service,
                        instance=instance,
                        scope=scope_spans.scope.name,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        kind=span.kind,
                        status_code=span.status.code,
                        attributes=attributes_of(span.attributes),
                        events=[(e.name, attributes_of(e.attributes)) for e in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    )
                )
    return found


class OtlpReceiver:
    """Collects the spans exporters send it, over OTLP/HTTP and optionally OTLP/gRPC.

    Use as a context manager (or `start()`/`close()`). `http_endpoint` and
    `grpc_endpoint` are the base URLs to configure as `telemetry.otlp_endpoint`.
    """

    def __init__(self, host: str = "127.0.0.1", *, grpc: bool = False) -> None:
        self.host = host
        self._want_grpc = grpc
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.rejected: list[str] = []  # "METHOD path" of requests not for traces
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._grpc_server: Any = None
        self.http_port = 0
        self.grpc_port = 0

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        """Listen (free ports on `host`); returns self."""
        self._httpd = _ReceiverHTTPServer((self.host, 0), _handler(self))
        self.http_port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="otlp-http", daemon=True
        )
        self._thread.start()
        if self._want_grpc:
            self._start_grpc()
        return self

    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver._accept(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        self.grpc_port = server.add_insecure_port(f"{self.host}:0")
        server.start()
        self._grpc_server = server

    def close(self) -> None:
        """Stop listening; idempotent. What was received stays readable."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None)
            self._grpc_server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def http_endpoint(self) -> str:
        """Base URL for OTLP/HTTP (the exporter appends `/v1/traces`)."""
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        """URL for OTLP/gRPC (plaintext)."""
        assert self.grpc_port, "started without grpc=True"
        return f"http://{self.host}:{self.grpc_port}"

    # --- what arrived ---------------------------------------------------------------

    def _accept(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = spans_of(request)
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def wait_for(
        self,
        ready: Callable[[list[ReceivedSpan]], bool],
        *,
        timeout_s: float,
        what: str,
    ) -> list[ReceivedSpan]:
        """Poll until `ready(spans)` holds; AssertionError naming `what` and listing
        everything that did arrive when `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                listing = "\n  ".join(str(s) for s in spans) or "(none)"
                raise AssertionError(
                    f"{what}: not there within {timeout_s:g}s; {self.requests} export "
                    f"requests, rejected {self.rejected or 'none'}, spans:\n  {listing}"
                )
            time.sleep(0.1)


class _ReceiverHTTPServer(ThreadingHTTPServer):
    daemon_threads = True


def _decoded_body(raw: bytes, encoding: str) -> bytes:
    match encoding.strip().lower():
        case "" | "identity":
            return raw
        case "gzip":
            return gzip.decompress(raw)
        case "deflate":
            return zlib.decompress(raw)
        case other:
            raise ValueError(f"unsupported Content-Encoding {other!r}")


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.split("?", 1)[0] != TRACES_PATH:
                with receiver._lock:
                    receiver.rejected.append(f"POST {self.path}")
                self._answer(404, b"not found: OTLP traces go to /v1/traces\n", "text/plain")
                return
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip()
            if media != _PROTOBUF:
                self._answer(415, f"expected {_PROTOBUF}\n".encode(), "text/plain")
                return
            try:
                body = _decoded_body(raw, self.headers.get("Content-Encoding") or "")
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            except Exception as exc:  # a bad request is the test's finding, not a crash
                self._answer(400, f"undecodable request: {exc}\n".encode(), "text/plain")
                return
            receiver._accept(request)
            response = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self._answer(200, response, _PROTOBUF)

        def do_GET(self) -> None:
            with receiver._lock:
                receiver.rejected.append(f"GET {self.path}")
            self._answer(405, b"OTLP receivers take POST\n", "text/plain")

        def _answer(self, status: int, body: bytes, media: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Exports are not worth a line each."""

    return Handler


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    """Spans by span id."""
    return {s.span_id: s for s in spans}


def ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> Iterator[ReceivedSpan]:
    """`span`'s parent, its parent's parent, ... as far as they were received."""
    index = by_id(spans)
    seen: set[str] = set()
    parent = index.get(span.parent_span_id)
    while parent is not None and parent.span_id not in seen:
        seen.add(parent.span_id)
        yield parent
        parent = index.get(parent.parent_span_id)
