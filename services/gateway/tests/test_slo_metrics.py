"""The gateway's SLO verdict and refusal counts (`yb_gateway.metrics`), by hand."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from yb_core.stats import percentile
from yb_gateway.metrics import TBT_SLO, TTFT_SLO, GatewayMetrics, RequestTiming


def timing(arrived: float, *token_times: float) -> RequestTiming:
    t = RequestTiming(arrived)
    for at in token_times:
        t.token(at)
    return t


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    assert found is not None, (name, labels)
    return found


def test_percentile_interpolates_as_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 90) == 10.0
    assert percentile([7.0], 90) == 7.0


def test_verdict_judges_ttft_and_the_p90_of_gaps() -> None:
    assert timing(0.0, 1.0, 1.1, 1.2).missed_slos(ttft_slo_s=1.0, tbt_slo_s=0.5) == []
    assert timing(0.0, 1.5, 1.6).missed_slos(ttft_slo_s=1.0, tbt_slo_s=0.5) == [TTFT_SLO]
    # Two slow gaps in ten put the 90th percentile among them.
    gaps = [0.1] * 8 + [2.0, 2.0]
    times = [1.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    assert timing(0.0, *times).missed_slos(ttft_slo_s=1.0, tbt_slo_s=0.5) == [TBT_SLO]
    assert timing(0.0, 0.5).missed_slos(ttft_slo_s=1.0, tbt_slo_s=0.0) == []  # no gap
    assert timing(0.0).missed_slos(ttft_slo_s=1.0, tbt_slo_s=1.0) == [TTFT_SLO]  # no token


def test_counters_start_at_zero_and_count_goodput_and_refusals() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, ["default", "flex"])
    for tier in ("default", "flex"):  # every tier's series, from the start
        assert value(registry, "yb_gateway_goodput_requests_total", tier=tier) == 0
        assert value(registry, "yb_gateway_slo_missed_requests_total", slo="tbt", tier=tier) == 0
        assert (
            value(registry, "yb_gateway_refused_requests_total", code="request_rejected", tier=tier)
            == 0
        )
        assert value(registry, "yb_gateway_ttft_seconds_count", tier=tier) == 0

    slo = {"ttft_slo_s": 1.0, "tbt_slo_s": 0.5}
    metrics.completed(timing(0.0, 0.2, 0.3), prompt_tokens=100, cached_tokens=64, **slo)
    metrics.completed(timing(0.0, 2.0, 3.0), prompt_tokens=50, cached_tokens=0, **slo)
    # Judged against its own tier's SLOs: within flex's looser TTFT.
    flex = {"ttft_slo_s": 4.0, "tbt_slo_s": 0.5, "tier": "flex"}
    metrics.completed(timing(0.0, 2.0, 2.1), prompt_tokens=10, cached_tokens=0, **flex)
    assert value(registry, "yb_gateway_goodput_requests_total", tier="default") == 1
    assert value(registry, "yb_gateway_goodput_requests_total", tier="flex") == 1
    assert value(registry, "yb_gateway_slo_missed_requests_total", slo="ttft", tier="default") == 1
    assert value(registry, "yb_gateway_slo_missed_requests_total", slo="tbt", tier="default") == 1
    assert value(registry, "yb_gateway_slo_missed_requests_total", slo="ttft", tier="flex") == 0
    assert value(registry, "yb_gateway_prompt_tokens_total") == 160
    assert value(registry, "yb_gateway_cached_prompt_tokens_total") == 64

    metrics.finished(429, "request_rejected", tier="flex")
    metrics.finished(503, "some_new_code", tier="default")
    metrics.finished(400, "invalid_json")  # a bad request is not a refusal
    metrics.finished(200, tier="default")
    rejected = {"code": "request_rejected"}
    assert value(registry, "yb_gateway_refused_requests_total", **rejected, tier="flex") == 1
    assert value(registry, "yb_gateway_refused_requests_total", **rejected, tier="default") == 0
    assert (
        value(registry, "yb_gateway_refused_requests_total", code="some_new_code", tier="default")
        == 1
    )
    assert (
        registry.get_sample_value(
            "yb_gateway_refused_requests_total", {"code": "invalid_json", "tier": "default"}
        )
        is None
    )
    assert value(registry, "yb_gateway_requests_total", status="400") == 1
