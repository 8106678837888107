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

Goodput is judged here, per completed request (status 200), as `yb bench` judges it
from the client's side: within both SLOs when its TTFT is at most its service tier's
TTFT SLO and the 90th percentile of its inter-token gaps at most its tier's TBT SLO
(`gateway.service_tiers`; the default tier's are `gateway.ttft_slo_s` and
`gateway.tbt_slo_s`; a request with fewer than two token chunks has no gap to judge).
`yb_gateway_goodput_requests_total` counts those, `yb_gateway_slo_missed_requests_total`
the others by the SLO they missed (both, for a request that missed both). The prompt
tokens of completed requests, and those of them whose KV was reused (the
`cached_tokens` of their usage), are counted for the cache hit ratio.
`yb_gateway_refused_requests_total` counts requests turned away before any token,
with 429 (the conductor rejected it) or 503 (nothing could serve it), by error code.

The latencies, goodput, SLO misses and refusals carry the request's service tier
(`tier`): the tiers are configured, so the series stay bounded, and a tier's SLO is
only meaningful against its own requests. `yb_gateway_requests_total` does not: a
request refused before its tier was known (a bad body) has none.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from yb_core.config import DEFAULT_TIER
from yb_core.stats import percentile

# Client disconnected before the answer was complete (nginx's convention).
CLIENT_CLOSED = 499

# Why the gateway dropped a slow client (`yb_gateway_slow_client_drops_total`).
REQUEST_TIMEOUT = "request_timeout"
STREAM_STALL = "stream_stall"

# The SLOs a completed request can miss (`yb_gateway_slo_missed_requests_total`).
TTFT_SLO = "ttft"
TBT_SLO = "tbt"
# A request's TBT, for its SLO verdict: this percentile of its own gaps (as `yb bench`).
TBT_PERCENTILE = 90.0
# Statuses that refuse a request before any token: the conductor's rejection, and
# nothing to serve it.
REFUSAL_STATUSES = (429, 503)
# The error codes of those refusals (`yb_gateway.errors`, the session and the
# endpoints), exported at 0 from the start; a code not listed is counted all the same.
REFUSAL_CODES = (
    "request_rejected",
    "decision_timeout",
    "bus_unavailable",
    "no_engine",
    "job_refused",
    "tokenizer_not_ready",
    "shutting_down",
)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The series the gateway exports; `tiers` are the service tiers it serves (their
    series are exported at 0 from the start)."""

    def __init__(self, registry: CollectorRegistry, tiers: Sequence[str] = (DEFAULT_TIER,)) -> None:
        self.ttft = Histogram(
            "yb_gateway_ttft_seconds",
            "Time from request arrival to the first generated token sent to the client, "
            "by service tier",
            ["tier"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "yb_gateway_inter_token_seconds",
            "Time between consecutive token chunks of a request, by service tier",
            ["tier"],
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
        self.goodput = Counter(
            "yb_gateway_goodput_requests",
            "Completed requests within both SLOs of their service tier (TTFT, p90 of "
            "inter-token gaps), by tier",
            ["tier"],
            registry=registry,
        )
        self.slo_missed = Counter(
            "yb_gateway_slo_missed_requests",
            "Completed requests that missed an SLO of their tier, by the SLO (ttft, tbt) and tier",
            ["slo", "tier"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "yb_gateway_prompt_tokens",
            "Prompt tokens of completed requests",
            registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "yb_gateway_cached_prompt_tokens",
            "Prompt tokens of completed requests whose KV was reused (usage's cached_tokens)",
            registry=registry,
        )
        self.refused = Counter(
            "yb_gateway_refused_requests",
            "Requests refused before any token (429 or 503), by error code and tier",
            ["code", "tier"],
            registry=registry,
        )
        for tier in tiers:  # exported at 0 from the start
            self.ttft.labels(tier)
            self.inter_token.labels(tier)
            self.goodput.labels(tier)
            for slo in (TTFT_SLO, TBT_SLO):
                self.slo_missed.labels(slo, tier)
            for code in REFUSAL_CODES:
                self.refused.labels(code, tier)

    def finished(self, status: int, code: str | None = None, *, tier: str | None = None) -> None:
        """Count one request that ended with `status` (and, for a refusal, its error
        `code`, by its `tier`: a refusal comes once the tier is known)."""
        self.requests.labels(str(status)).inc()
        if status in REFUSAL_STATUSES and code:
            self.refused.labels(code, tier or DEFAULT_TIER).inc()

    def completed(
        self,
        timing: RequestTiming,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        ttft_slo_s: float,
        tbt_slo_s: float,
        tier: str = DEFAULT_TIER,
    ) -> None:
        """Count one request that completed (status 200): its SLO verdict against its
        tier's SLOs, and its prompt tokens."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(min(cached_tokens, prompt_tokens))
        missed = timing.missed_slos(ttft_slo_s, tbt_slo_s)
        for slo in missed:
            self.slo_missed.labels(slo, tier).inc()
        if not missed:
            self.goodput.labels(tier).inc()


class RequestTiming:
    """When one request arrived and when its token chunks went to the client
    (monotonic seconds), for its SLO verdict."""

    __slots__ = ("arrived", "first_token_at", "gaps", "last_token_at")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps: list[float] = []

    def token(self, now: float) -> None:
        """A chunk with tokens went out at `now`."""
        if self.last_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now

    def missed_slos(self, ttft_slo_s: float, tbt_slo_s: float) -> list[str]:
        """The SLOs this request missed: TTFT (also when no token came at all) and
        TBT (the `TBT_PERCENTILE`th percentile of its gaps)."""
        missed = []
        if self.first_token_at is None or self.first_token_at - self.arrived > ttft_slo_s:
            missed.append(TTFT_SLO)
        if self.gaps and percentile(self.gaps, TBT_PERCENTILE) > tbt_slo_s:
            missed.append(TBT_SLO)
        return missed
