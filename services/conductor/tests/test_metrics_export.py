"""The conductor's Prometheus export: known label values from the start, and the
failed transfers it folds, by kind."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from yb_conductor.conductor import Conductor
from yb_conductor.metrics import ConductorMetrics
from yb_core import events as ev


def test_known_labels_start_at_zero() -> None:
    registry = CollectorRegistry()
    ConductorMetrics(registry)
    for name, labels in [
        ("yb_conductor_decisions_total", {"outcome": "rejected"}),
        ("yb_conductor_branch_total", {"branch": "transfer"}),
        ("yb_conductor_rejections_total", {"code": "ttft_slo"}),
        ("yb_conductor_transfer_failures_total", {"kind": "to_decode"}),
        ("yb_conductor_transfer_failures_total", {"kind": "prefix_fetch"}),
    ]:
        assert registry.get_sample_value(name, labels) == 0, (name, labels)


def test_transfer_failures_are_counted_by_kind() -> None:
    registry = CollectorRegistry()
    metrics = ConductorMetrics(registry)
    conductor = Conductor()
    for instance, role in [("p0", "prefill"), ("d0", "decode"), ("k0", "kvstore")]:
        up = ev.InstanceUp(instance_id=instance, role=role, host="h0", time=1.0)  # type: ignore[arg-type]
        conductor.apply(conductor.last_seq + 1, up)
    to_decode = ev.TransferFailed(
        request_id="r1", source_instance="p0", target_instance="d0", reason="x"
    )
    fetch = ev.TransferFailed(
        request_id="r2", source_instance="k0", target_instance="p0", reason="x"
    )
    for event in (to_decode, fetch, fetch, ev.InstanceDown(instance_id="k0")):
        metrics.folded(event, conductor)
    kinds = {
        kind: registry.get_sample_value("yb_conductor_transfer_failures_total", {"kind": kind})
        for kind in ("to_decode", "prefix_fetch")
    }
    assert kinds == {"to_decode": 1, "prefix_fetch": 2}
