"""Trace export: the settings, the exporter each protocol gets, and spans that really
arrive at an OTLP receiver (HTTP and gRPC, real protobuf on the wire)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from yb_core.config import ConfigError, TelemetryConfig, load_config
from yb_core.telemetry import (
    OTLP_EXPORTER_MODULES,
    build_tracer_provider,
    child_span,
    inject_headers,
    otlp_traces_url,
    span_exporter,
    trace_id_hex,
)
from yb_testkit.otlp import OtlpReceiver, ReceivedSpan


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver(grpc=True) as started:
        yield started


# --- settings -------------------------------------------------------------------------


def test_protocol_defaults_to_http_protobuf_and_takes_grpc() -> None:
    assert TelemetryConfig().otlp_protocol == "http/protobuf"
    cfg = load_config(
        env={
            "YB_TELEMETRY__OTLP_ENDPOINT": "http://collector:4317",
            "YB_TELEMETRY__OTLP_PROTOCOL": "grpc",
        }
    )
    assert (cfg.telemetry.otlp_protocol, cfg.telemetry.otlp_endpoint) == (
        "grpc",
        "http://collector:4317",
    )


@pytest.mark.parametrize("protocol", ["http/json", "HTTP", "grpcs", ""])
def test_an_unknown_protocol_is_a_config_error(protocol: str) -> None:
    with pytest.raises(ConfigError, match="otlp_protocol"):
        load_config(env={"YB_TELEMETRY__OTLP_PROTOCOL": protocol})
    with pytest.raises(ConfigError, match="otlp_protocol"):
        TelemetryConfig(otlp_protocol=protocol)  # type: ignore[arg-type]


@pytest.mark.parametrize("endpoint", ["collector:4318", "localhost", "ftp://c:4318", "http://"])
def test_an_endpoint_that_is_no_http_url_is_a_config_error(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_config(env={"YB_TELEMETRY__OTLP_ENDPOINT": endpoint})


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="otlp_timeout_s"):
        load_config(env={"YB_TELEMETRY__OTLP_TIMEOUT_S": "0"})


@pytest.mark.parametrize(
    ("endpoint", "protocol", "url"),
    [
        ("http://c:4318", "http/protobuf", "http://c:4318/v1/traces"),
        ("http://c:4318/", "http/protobuf", "http://c:4318/v1/traces"),
        ("https://c/otlp", "http/protobuf", "https://c/otlp/v1/traces"),
        ("http://c:4318/v1/traces", "http/protobuf", "http://c:4318/v1/traces"),
        ("http://c:4317", "grpc", "http://c:4317"),
    ],
)
def test_http_appends_the_traces_path_as_the_otlp_env_convention_does(
    endpoint: str, protocol: str, url: str
) -> None:
    assert otlp_traces_url(endpoint, protocol) == url


def test_each_protocol_gets_its_exporter() -> None:
    assert span_exporter(TelemetryConfig()) is None
    http = span_exporter(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"))
    grpc = span_exporter(
        TelemetryConfig(otlp_endpoint="http://127.0.0.1:4317", otlp_protocol="grpc")
    )
    assert http is not None and grpc is not None
    assert type(http).__module__ == OTLP_EXPORTER_MODULES["http/protobuf"]
    assert type(grpc).__module__ == OTLP_EXPORTER_MODULES["grpc"]
    http.shutdown()
    grpc.shutdown()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_missing_exporter_package_stops_the_start(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes the import fail as an absent package does.
    monkeypatch.setitem(sys.modules, OTLP_EXPORTER_MODULES[protocol], None)
    cfg = TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318", otlp_protocol=protocol)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp"):
        build_tracer_provider("gateway", "gateway-0", cfg)


# --- tracing off ----------------------------------------------------------------------


def test_without_an_exporter_spans_record_nothing_but_the_context_travels() -> None:
    provider = build_tracer_provider("gateway", "gateway-0", TelemetryConfig())
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        assert not span.is_recording()
        headers = inject_headers()
        assert trace_id_hex(headers) == format(span.get_span_context().trace_id, "032x")
        with child_span(tracer, "phase") as phase:
            # No span is made under a non-recording one.
            assert phase is trace.INVALID_SPAN
    provider.shutdown()


def test_a_sample_ratio_records_that_share_of_new_traces_and_keeps_a_callers_choice() -> None:
    cfg = TelemetryConfig(console_traces=True, trace_sample_ratio=0.25)
    provider = build_tracer_provider("gateway", "gateway-0", cfg)
    tracer = provider.get_tracer("test")
    recorded = 0
    for _ in range(2000):
        with tracer.start_as_current_span("request") as span:
            recorded += span.is_recording()
            if not span.is_recording():
                # The rest of a dropped trace is dropped too, here and downstream.
                with tracer.start_as_current_span("phase") as child:
                    assert not child.is_recording()
    # Trace ids are random: 500 expected; the bounds are 9 standard deviations wide.
    assert 330 < recorded < 670
    for ratio in (0.0, 1.0):
        kept = build_tracer_provider(
            "gateway", "gateway-0", TelemetryConfig(console_traces=True, trace_sample_ratio=ratio)
        ).get_tracer("test")
        with kept.start_as_current_span("request") as span:
            assert span.is_recording() is (ratio == 1.0)
    provider.shutdown()


def test_a_sample_ratio_outside_0_to_1_is_refused() -> None:
    with pytest.raises(ConfigError, match="trace_sample_ratio"):
        TelemetryConfig(trace_sample_ratio=1.5)
    with pytest.raises(ConfigError, match="trace_sample_ratio"):
        load_config(env={"YB_TELEMETRY__TRACE_SAMPLE_RATIO": "-0.1"})


# --- spans on the wire ----------------------------------------------------------------


def _export_a_request_trace(cfg: TelemetryConfig) -> tuple[str, str, str]:
    """A root span with a child, exported and flushed; (trace id, root id, child id)."""
    provider = build_tracer_provider("gateway", "gateway-7", cfg)
    tracer = provider.get_tracer("yb_test")
    with tracer.start_as_current_span("gateway chat.completions") as root:
        root.set_attribute("yb.request_id", "r1")
        with child_span(tracer, "gateway admission") as child:
            assert child.is_recording()
            child.add_event("decided", {"yb.prefill_instance": "prefill-0"})
    assert provider.force_flush(30_000)
    provider.shutdown()
    ctx, child_ctx = root.get_span_context(), child.get_span_context()
    return (
        format(ctx.trace_id, "032x"),
        format(ctx.span_id, "016x"),
        format(child_ctx.span_id, "016x"),
    )


def _check_trace(spans: list[ReceivedSpan], trace_id: str, root_id: str, child_id: str) -> None:
    by_name = {s.name: s for s in spans}
    root, child = by_name["gateway chat.completions"], by_name["gateway admission"]
    assert (root.trace_id, root.span_id, root.parent_span_id) == (trace_id, root_id, "")
    assert (child.trace_id, child.span_id, child.parent_span_id) == (trace_id, child_id, root_id)
    assert {s.service for s in spans} == {"yuebing-gateway"}
    assert {s.instance for s in spans} == {"gateway-7"}
    assert root.attributes == {"yb.request_id": "r1"}
    assert child.events == [("decided", {"yb.prefill_instance": "prefill-0"})]
    assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns


@pytest.mark.parametrize("suffix", ["", "/", "/v1/traces"])
def test_spans_arrive_over_otlp_http(receiver: OtlpReceiver, suffix: str) -> None:
    cfg = TelemetryConfig(otlp_endpoint=receiver.http_endpoint + suffix)
    ids = _export_a_request_trace(cfg)
    spans = receiver.wait_for(lambda s: len(s) >= 2, timeout_s=30, what="two spans over HTTP")
    _check_trace(spans, *ids)
    assert receiver.rejected == []


def test_spans_arrive_over_otlp_grpc(receiver: OtlpReceiver) -> None:
    cfg = TelemetryConfig(otlp_endpoint=receiver.grpc_endpoint, otlp_protocol="grpc")
    ids = _export_a_request_trace(cfg)
    spans = receiver.wait_for(lambda s: len(s) >= 2, timeout_s=30, what="two spans over gRPC")
    _check_trace(spans, *ids)
    assert receiver.requests >= 1


def test_spans_are_exported_while_the_process_runs(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A short batch delay (the SDK's own setting): no flush is asked for here.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    provider = build_tracer_provider(
        "decode", "decode-0", TelemetryConfig(otlp_endpoint=receiver.http_endpoint)
    )
    try:
        with provider.get_tracer("yb_test").start_as_current_span("decode"):
            pass
        spans = receiver.wait_for(bool, timeout_s=30, what="a span without a flush")
        assert [(s.service, s.name) for s in spans] == [("yuebing-decode", "decode")]
    finally:
        provider.shutdown()


def test_a_short_lived_process_flushes_its_spans_at_exit(receiver: OtlpReceiver) -> None:
    # Batches would wait ten minutes: only the flush at exit can send this span.
    script = textwrap.dedent(
        f"""
        from opentelemetry import trace
        from yb_core.config import TelemetryConfig
        from yb_core.telemetry import configure_tracing
        configure_tracing(
            "prefill", "prefill-3", TelemetryConfig(otlp_endpoint="{receiver.http_endpoint}")
        )
        with trace.get_tracer("yb_test").start_as_current_span("prefill"):
            pass
        """
    )
    env = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # The process has exited: whatever it sent has arrived.
    assert [(s.service, s.instance, s.name) for s in receiver.spans()] == [
        ("yuebing-prefill", "prefill-3", "prefill")
    ]
