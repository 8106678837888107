"""The conductor's Prometheus metrics, fed from the fold's own counters.

The fold (`Conductor`) counts decisions and compares completions with estimates as
pure data (`DecisionQuality`, `Conductor.outcomes`); this module only exports them, so
a replay computes exactly the figures the live conductor exported.

The known label values (decision outcomes, placement branches, refusal codes) are
exported at 0 from the start, so a dashboard has a series for each before the first
request. `yb_conductor_transfer_failures_total` counts the `TransferFailed` events the
live conductor folds: every failed KV transfer of the cluster (prefill to decode, and
prefix fetches from kvstores), by kind.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from yb_conductor.admission import DECODE_KV_FULL, NO_DECODE, NO_PREFILL, TBT_SLO, TTFT_SLO
from yb_conductor.conductor import Conductor, Output
from yb_conductor.prefill_placement import LOCAL, RECOMPUTE, TRANSFER
from yb_conductor.quality import reject_code
from yb_core import events as ev

#: `TransferFailed` kinds: KV streamed from a prefill engine to a decode engine, and a
#: planned prefix fetched by a prefill engine from a kvstore.
TO_DECODE = "to_decode"
PREFIX_FETCH = "prefix_fetch"

_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)


class ConductorMetrics:
    """Counters and histograms of one conductor process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "yb_conductor_decisions_total", "Decisions made, by outcome", ["outcome"],
            registry=registry,
        )  # fmt: skip
        self.branches = Counter(
            "yb_conductor_branch_total",
            "Scheduled requests by placement branch (local, transfer, recompute)",
            ["branch"],
            registry=registry,
        )
        self.rejections = Counter(
            "yb_conductor_rejections_total", "Rejections by reason code", ["code"],
            registry=registry,
        )  # fmt: skip
        self.reused_blocks = Counter(
            "yb_conductor_reused_blocks_total", "Prefix blocks planned for reuse",
            registry=registry,
        )  # fmt: skip
        self.best_blocks = Counter(
            "yb_conductor_best_blocks_total",
            "Longest prefix held anywhere, summed over scheduled requests (reuse ceiling)",
            registry=registry,
        )
        self.latency = Histogram(
            "yb_conductor_decision_seconds",
            "Time to fold an admission and decide",
            registry=registry,
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self.applied = Counter(
            "yb_conductor_events_applied_total", "Events folded", registry=registry
        )
        self.instances = Gauge(
            "yb_conductor_live_instances",
            "Live instances by role that take new work (a draining one does not)",
            ["role"],
            registry=registry,
        )
        self.divergences = Counter(
            "yb_conductor_divergences_total",
            "Recorded decisions this conductor would have made differently",
            registry=registry,
        )
        self.ttft_ratio = Histogram(
            "yb_conductor_ttft_actual_over_estimate",
            "Measured TTFT over the decision's estimate, per completion",
            registry=registry,
            buckets=_RATIO_BUCKETS,
        )
        self.tbt_ratio = Histogram(
            "yb_conductor_tbt_actual_over_estimate",
            "Measured mean TBT over the decision's estimate, per completion",
            registry=registry,
            buckets=_RATIO_BUCKETS,
        )
        self.ttft_error = Histogram(
            "yb_conductor_ttft_abs_error_seconds",
            "|measured TTFT - estimate| per completion",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.decode_time = Gauge(
            "yb_conductor_expected_decode_seconds",
            "t_d: expected decode duration, learned from completions",
            registry=registry,
        )
        self.speed = Gauge(
            "yb_conductor_learned_speed",
            "What completions taught: per engine, solo (prefill time over the cost "
            "model's, alone) and first_token_s (lag from prefill end to first token); "
            "per group of engines sharing compute, per_busy (added per other busy one)",
            ["instance", "term"],
            registry=registry,
        )
        self.active = Gauge(
            "yb_conductor_active", "1 while this conductor holds the lease", registry=registry
        )
        self.log_gap_events = Counter(
            "yb_conductor_log_gap_events_total",
            "Events this conductor never folded: trimmed from the log by its limits "
            "before it read them, with no snapshot covering them",
            registry=registry,
        )
        self.snapshot_seq = Gauge(
            "yb_conductor_snapshot_seq",
            "Stream sequence of the latest snapshot saved or restored",
            registry=registry,
        )
        self.transfer_failures = Counter(
            "yb_conductor_transfer_failures_total",
            "Failed KV transfers (TransferFailed events), by kind (to_decode, prefix_fetch)",
            ["kind"],
            registry=registry,
        )
        # Exported at 0 from the start (see the module's docstring).
        for outcome in ("scheduled", "rejected"):
            self.decisions.labels(outcome)
        for branch in (LOCAL, TRANSFER, RECOMPUTE):
            self.branches.labels(branch)
        for code in (NO_PREFILL, NO_DECODE, DECODE_KV_FULL, TTFT_SLO, TBT_SLO):
            self.rejections.labels(code)
        for kind in (TO_DECODE, PREFIX_FETCH):
            self.transfer_failures.labels(kind)

    def decided(self, outputs: list[Output], seconds: float) -> None:
        """Count the decisions of one admission."""
        self.latency.observe(seconds)
        for out in outputs:
            match out:
                case ev.RequestScheduled():
                    self.decisions.labels("scheduled").inc()
                    branch = out.explain.branch if out.explain else "unexplained"
                    self.branches.labels(branch or "unexplained").inc()
                    self.reused_blocks.inc(out.reused_blocks)
                    best = out.explain.best_blocks if out.explain else out.reused_blocks
                    self.best_blocks.inc(max(best, out.reused_blocks))
                case ev.RequestRejected():
                    self.decisions.labels("rejected").inc()
                    self.rejections.labels(reject_code(out.reason)).inc()
                case _:
                    pass

    def folded(self, event: ev.AnyEvent, conductor: Conductor) -> None:
        """Count what one event of the log tells (a failed transfer); the live
        conductor calls it for each event it folds."""
        match event:
            case ev.TransferFailed():
                # Prefill engines report both kinds: the target is a decode engine
                # for KV streamed to it, the prefill engine itself for a prefix fetch.
                target = conductor.state.instances.get(event.target_instance)
                decode = target is not None and target.role == "decode"
                self.transfer_failures.labels(TO_DECODE if decode else PREFIX_FETCH).inc()
            case _:
                pass

    def collect_outcomes(self, conductor: Conductor) -> None:
        """Export the completions the fold compared since the last call."""
        if not conductor.outcomes:
            return
        for o in conductor.outcomes:
            if o.est_ttft_s > 0 and o.ttft_s > 0:
                self.ttft_ratio.observe(o.ttft_s / o.est_ttft_s)
                self.ttft_error.observe(abs(o.ttft_s - o.est_ttft_s))
            if o.est_tbt_s > 0 and o.tbt_s > 0:
                self.tbt_ratio.observe(o.tbt_s / o.est_tbt_s)
        conductor.outcomes.clear()
        state = conductor.state
        self.decode_time.set(state.learned.decode_time_s)
        for instance_id, speed in state.speeds.items():
            if speed.solo_samples:
                self.speed.labels(instance_id, "solo").set(speed.solo)
            if speed.first_token_samples:
                self.speed.labels(instance_id, "first_token_s").set(speed.first_token_s)
        for group, shared in state.shared_speeds.items():
            self.speed.labels(group or "all", "per_busy").set(shared.per_busy)

    def instances_changed(self, conductor: Conductor) -> None:
        """Refresh the live-instance gauges."""
        for role in ("prefill", "decode", "kvstore"):
            self.instances.labels(role).set(len(conductor.state.live(role)))
