"""The gateway's Prometheus collectors, on the service's own registry.

Latencies are what the client sees, measured at the gateway: TTFT from the moment the
request arrived to the first generated token relayed, inter-token time between
consecutive token chunks. `status` on the request counter is the HTTP status the
request ended with; for a stream that breaks after its 200 went out it is the status
of the error event (502, 504...), and 499 when the client went away first.
`yb_gateway_token_resends_total` counts the times a stream asked its decode instance
to publish lost chunks again, by what made it ask (`gap`, `reconnect`, `quiet`).
`yb_gateway_slow_client_drops_total` counts the connections dropped for being slow
(`request_timeout`: head or body not in within `body_timeout_s`; `stream_stall`: the
client did not read for `stream_stall_timeout_s` with every buffer full), and
`yb_gateway_stalled_connections` the connections whose writes wait for the client now.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Client disconnected before the answer was complete (nginx's convention).
CLIENT_CLOSED = 499

# Why the gateway dropped a slow client (`yb_gateway_slow_client_drops_total`).
REQUEST_TIMEOUT = "request_timeout"
STREAM_STALL = "stream_stall"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The series the gateway exports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "yb_gateway_ttft_seconds",
            "Time from request arrival to the first generated token sent to the client",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "yb_gateway_inter_token_seconds",
            "Time between consecutive token chunks of a request",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        # prometheus_client exposes a counter named `x` as `x_total`.
        self.requests = Counter(
            "yb_gateway_requests",
            "Completion requests by final HTTP status",
            ["status"],
            registry=registry,
        )
        self.resends = Counter(
            "yb_gateway_token_resends",
            "Requests to a decode instance to publish lost token chunks again, by trigger",
            ["trigger"],
            registry=registry,
        )
        self.slow_client_drops = Counter(
            "yb_gateway_slow_client_drops",
            "Connections dropped for a slow client, by reason",
            ["reason"],
            registry=registry,
        )
        for reason in (REQUEST_TIMEOUT, STREAM_STALL):
            self.slow_client_drops.labels(reason)  # exported at 0 from the start
        self.stalled = Gauge(
            "yb_gateway_stalled_connections",
            "Connections whose response waits for the client to read (buffers full)",
            registry=registry,
        )
        self.in_flight = Gauge(
            "yb_gateway_in_flight_requests",
            "Completion requests being handled now",
            registry=registry,
        )

    def finished(self, status: int) -> None:
        """Count one request that ended with `status`."""
        self.requests.labels(str(status)).inc()
