"""`yb sim --capacity`: the highest arrival rate each policy serves within its SLOs.

A policy *holds* a load when at least `CAPACITY_ATTAINMENT` (90%) of the trace's
requests complete within both SLOs (`slo_attainment`). The load is the trace's own
arrivals compressed by `--speedup`; the search brackets it in `[min_speedup,
max_speedup]`: both ends are run first, then `iterations` bisections at the geometric
midpoint (each halves the bracket's log width), so a policy costs `iterations + 2`
runs and the bracket ends `(max/min) ** (1 / 2**iterations)` wide. The result is the
highest speedup seen to hold (0 if `min_speedup` does not) and the lowest seen not to
(`next_speedup`, 0 if `max_speedup` holds: the capacity is then capped). A speedup's
rate is the trace's requests over their arrival span at it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from yb_conductor.cost_model import CostModel
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import RunSpec, resolve_cost, simulate
from yb_tools.traces import TraceRecord

CAPACITY_ATTAINMENT = 0.9
DEFAULT_MIN_SPEEDUP = 0.125
DEFAULT_MAX_SPEEDUP = 32.0
DEFAULT_ITERATIONS = 8


class CapacityPoint(msgspec.Struct, kw_only=True, frozen=True):
    """One run of the search: its speedup, rate and share of requests within SLOs."""

    speedup: float
    rate_rps: float
    slo_attainment: float


class CapacityResult(msgspec.Struct, kw_only=True):
    """One policy's capacity: the highest rate that held (`capacity_rps` at
    `speedup`), the lowest that did not (`next_rps` at `next_speedup`), and every run."""

    policy: str
    capacity_rps: float
    speedup: float
    slo_attainment: float
    next_rps: float
    next_speedup: float
    capped: bool
    runs: list[CapacityPoint]


class CapacityReport(msgspec.Struct, kw_only=True):
    """Every policy's capacity and what the search ran with."""

    policies: dict[str, CapacityResult]
    trace: str
    requests: int
    params: SimParams
    cost_model: str
    target_attainment: float
    min_speedup: float
    max_speedup: float
    iterations: int


def arrival_span_s(records: list[TraceRecord]) -> float:
    """Seconds from the first arrival to the last at speedup 1."""
    stamps = [r.timestamp for r in records]
    return (max(stamps) - min(stamps)) / 1000.0 if stamps else 0.0


def search_capacity(
    attainment_at: Callable[[float], float],
    *,
    policy: str,
    requests: int,
    span_s: float,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    max_speedup: float = DEFAULT_MAX_SPEEDUP,
    iterations: int = DEFAULT_ITERATIONS,
    on_run: Callable[[CapacityPoint], None] | None = None,
) -> CapacityResult:
    """Search the speedup where `attainment_at(speedup)` falls below the target;
    `on_run(point)` after each run."""
    if not 0.0 < min_speedup < max_speedup:
        raise ValueError("capacity search wants 0 < min speedup < max speedup")
    if iterations < 0:
        raise ValueError("capacity search wants iterations >= 0")
    runs: list[CapacityPoint] = []

    def holds(speedup: float) -> bool:
        share = attainment_at(speedup)
        rate = requests / (span_s / speedup) if span_s > 0 else 0.0
        runs.append(CapacityPoint(speedup=speedup, rate_rps=rate, slo_attainment=share))
        if on_run is not None:
            on_run(runs[-1])
        return share >= CAPACITY_ATTAINMENT

    def result(good: CapacityPoint | None, bad: CapacityPoint | None) -> CapacityResult:
        return CapacityResult(
            policy=policy,
            capacity_rps=good.rate_rps if good else 0.0,
            speedup=good.speedup if good else 0.0,
            slo_attainment=good.slo_attainment if good else 0.0,
            next_rps=bad.rate_rps if bad else 0.0,
            next_speedup=bad.speedup if bad else 0.0,
            capped=bad is None,
            runs=runs,
        )

    if not holds(min_speedup):
        return result(None, runs[-1])
    good = runs[-1]
    if holds(max_speedup):
        return result(runs[-1], None)
    bad = runs[-1]
    for _ in range(iterations):
        if holds(math.sqrt(good.speedup * bad.speedup)):
            good = runs[-1]
        else:
            bad = runs[-1]
    return result(good, bad)


def run_capacity(
    trace: str,
    records: list[TraceRecord],
    specs: list[RunSpec],
    params: SimParams,
    *,
    cost: CostModel | None = None,
    settings: Mapping[str, Any] | None = None,
    min_speedup: float = DEFAULT_MIN_SPEEDUP,
    max_speedup: float = DEFAULT_MAX_SPEEDUP,
    iterations: int = DEFAULT_ITERATIONS,
    on_run: Callable[[str, CapacityPoint], None] | None = None,
) -> CapacityReport:
    """Each spec's capacity on `records` (named `trace`); `on_run(label, point)` after
    every run of the search."""
    cost = cost or resolve_cost(params)
    kept = records[: params.limit] if params.limit > 0 else records
    span = arrival_span_s(kept)
    out: dict[str, CapacityResult] = {}
    for spec in specs:

        def attainment_at(speedup: float, spec: RunSpec = spec) -> float:
            at = msgspec.structs.replace(params, speedup=speedup)
            report = simulate(trace, [spec], at, records=kept, cost=cost, settings=settings)
            return report.policies[spec.label].slo_attainment

        def report_run(point: CapacityPoint, label: str = spec.label) -> None:
            if on_run is not None:
                on_run(label, point)

        out[spec.label] = search_capacity(
            attainment_at,
            policy=spec.label,
            requests=len(kept),
            span_s=span,
            min_speedup=min_speedup,
            max_speedup=max_speedup,
            iterations=iterations,
            on_run=report_run,
        )
    return CapacityReport(
        policies=out,
        trace=trace,
        requests=len(kept),
        params=params,
        cost_model=cost.name,
        target_attainment=CAPACITY_ATTAINMENT,
        min_speedup=min_speedup,
        max_speedup=max_speedup,
        iterations=iterations,
    )


def capacity_table(report: CapacityReport) -> str:
    """The capacities as a markdown table, each against the first policy's."""
    rows = [
        "| policy | capacity (req/s) | speedup | attainment | next (req/s) | vs first |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    first = next(iter(report.policies.values()), None)
    for r in report.policies.values():
        ratio = (
            f"{r.capacity_rps / first.capacity_rps:.2f}x"
            if first is not None and first.capacity_rps > 0
            else "-"
        )
        cap = f"{r.capacity_rps:.3f}" + (" (capped)" if r.capped else "")
        rows.append(
            f"| {r.policy} | {cap} | {r.speedup:.3f} | {r.slo_attainment:.3f} | "
            f"{r.next_rps:.3f} | {ratio} |"
        )
    return "\n".join(rows)
