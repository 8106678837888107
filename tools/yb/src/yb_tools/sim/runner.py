"""Several policies on the same trace and cluster: what `yb sim` runs.

Policy names are the conductor's registered policies; `mooncake` runs once per
admission policy given, as `mooncake:none`, `mooncake:early`, `mooncake:predicted`
when there are several (the other policies never refuse on load, so admission does
not apply to them). `coupled` is no conductor policy but the paper's vLLM baseline
(`sim.coupled`): as many coupled instances as the cluster's prefill and decode
instances together. Every run starts from the same empty cluster and the same
workload, so the figures differ only by the policy. A run that rejected requests is
judged against the same policy with admission `none` (run once more if it is not
among the runs asked for): how many of its rejections were needless (`quality`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from yb_conductor.admission import ADMISSIONS
from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.policy import PLACEMENT_POLICIES
from yb_conductor.replay import LogRecord, write_log
from yb_tools.sim.coupled import COUPLED_POLICY, CoupledSimulation
from yb_tools.sim.job import Job
from yb_tools.sim.params import SimParams
from yb_tools.sim.quality import needless_rejections
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.simulator import Progress, Simulation, block_size_for, with_bandwidth
from yb_tools.sim.workload import TraceItem, load_workload, workload_from
from yb_tools.traces import TraceRecord

PAPER_POLICY = "mooncake"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run: the label it is reported under, the policy and its admission."""

    label: str
    policy: str
    admission: str


class SimReport(msgspec.Struct, kw_only=True):
    """Every run's figures, and what they were run with (`prefill_tp`, `decode_tp`:
    the instances' tensor-parallel degrees; `devices`: what they span together)."""

    policies: dict[str, PolicyResult]
    simulated_seconds_per_wall_second: float
    trace: str
    requests: int
    params: SimParams
    cost_model: str
    block_size: int
    wall_s: float
    prefill_tp: int = 1
    decode_tp: int = 1
    devices: int = 0


def expand(policies: list[str], admissions: list[str]) -> list[RunSpec]:
    """The runs `--policy` and `--admission` ask for; ValueError on unknown names."""
    if not policies:
        raise ValueError("no policy given")
    admissions = admissions or ["predicted"]
    for adm in admissions:
        if adm not in ADMISSIONS:
            raise ValueError(f"unknown admission {adm!r}; known: {', '.join(ADMISSIONS)}")
    specs: list[RunSpec] = []
    for name in policies:
        if name == COUPLED_POLICY:
            specs.append(RunSpec(name, name, "none"))
            continue
        if name not in PLACEMENT_POLICIES:
            known = ", ".join(sorted([*PLACEMENT_POLICIES, COUPLED_POLICY]))
            raise ValueError(f"unknown policy {name!r}; known: {known}")
        if name == PAPER_POLICY and len(admissions) > 1:
            specs.extend(RunSpec(f"{name}:{adm}", name, adm) for adm in admissions)
        else:
            specs.append(RunSpec(name, name, admissions[0]))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a policy is named twice: {', '.join(labels)}")
    return specs


def resolve_cost(params: SimParams) -> CostModel:
    """The cost model the run uses: the profile, with the bandwidth override."""
    return with_bandwidth(load_cost_model(params.profile), params.bandwidth_gbps)


def simulate(
    trace: str | Path,
    specs: list[RunSpec],
    params: SimParams,
    *,
    records: list[TraceRecord] | None = None,
    cost: CostModel | None = None,
    settings: Mapping[str, Any] | None = None,
    progress: Callable[[str], tuple[Progress, Callable[[], None]]] | None = None,
    log_dir: str | Path | None = None,
    on_log: Callable[[RunSpec, list[LogRecord]], None] | None = None,
) -> SimReport:
    """Run every spec on the trace (the file `trace`, or `records` when given, which
    `trace` then only names), timed by `cost` (default: the profile's).
    `progress(label)` gives a callback and a closer per run; `log_dir` receives each
    run's event log (`log_path`, replayable with `yb replay --file`);
    `on_log(spec, records)` is handed each run's log as well."""
    cost = cost or resolve_cost(params)
    bs = block_size_for(params, cost)
    if records is None:
        items = load_workload(trace, block_size=bs, speedup=params.speedup, limit=params.limit)
    else:
        kept = records[: params.limit] if params.limit > 0 else records
        items = workload_from(kept, block_size=bs, speedup=params.speedup)
    if not items:
        raise ValueError(f"trace {trace} holds no request")
    results: dict[str, PolicyResult] = {}
    # Each policy's jobs with admission `none`: the counterfactual of its rejections.
    admitted: dict[str, list[Job]] = {}
    rejecting: list[tuple[RunSpec, list[Job]]] = []
    started = time.perf_counter()
    for spec in specs:
        sim: Simulation | CoupledSimulation
        if spec.policy == COUPLED_POLICY:
            if log_dir is not None or on_log is not None:
                raise ValueError("the coupled policy has no conductor, so no event log")
            if params.prefill_groups:
                raise ValueError("the coupled policy has no prefill pool, so no prefill groups")
            if params.piggyback:
                raise ValueError(
                    "the coupled policy prefills inside its batches by itself; --piggyback "
                    "is for the decode pool"
                )
            sim = CoupledSimulation(items, params, cost, label=spec.label)
        else:
            sim = Simulation(
                items,
                params,
                cost,
                policy=spec.policy,
                admission=spec.admission,
                label=spec.label,
                record_log=log_dir is not None or on_log is not None,
                settings=settings,
            )
        callback, close = progress(spec.label) if progress else (None, None)
        try:
            results[spec.label] = sim.run(callback)
        finally:
            if close is not None:
                close()
        if isinstance(sim, CoupledSimulation):
            continue
        if spec.admission == "none":
            admitted.setdefault(spec.policy, sim.jobs)
        if results[spec.label].rejected:
            rejecting.append((spec, sim.jobs))
        if sim.records is not None:
            if log_dir is not None:
                path = log_path(log_dir, spec.label)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_log(path, sim.records)
            if on_log is not None:
                on_log(spec, sim.records)
    for spec, jobs in rejecting:
        if spec.policy not in admitted:
            admitted[spec.policy] = counterfactual_jobs(items, params, cost, spec, settings)
        needless = needless_rejections(
            jobs, admitted[spec.policy], ttft_slo_s=params.ttft_slo_s, tbt_slo_s=params.tbt_slo_s
        )
        result = results[spec.label]
        result.needless_rejections = len(needless)
        result.needless_rejection_share = len(needless) / result.rejected
    wall = time.perf_counter() - started
    simulated = sum(r.simulated_s for r in results.values())
    run_wall = sum(r.wall_s for r in results.values())
    prefill_tp, decode_tp = params.degrees(cost)
    return SimReport(
        policies=results,
        simulated_seconds_per_wall_second=simulated / run_wall if run_wall > 0 else 0.0,
        trace=str(trace),
        requests=len(items),
        params=params,
        cost_model=cost.name,
        block_size=bs,
        wall_s=wall,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        devices=params.devices(cost),
    )


def counterfactual_jobs(
    items: list[TraceItem],
    params: SimParams,
    cost: CostModel,
    spec: RunSpec,
    settings: Mapping[str, Any] | None,
) -> list[Job]:
    """Every request's journey in `spec`'s run with admission `none` instead."""
    sim = Simulation(
        items, params, cost, policy=spec.policy, admission="none", label=spec.label,
        settings=settings,
    )  # fmt: skip
    sim.run()
    return sim.jobs


def file_label(label: str) -> str:
    """A run's label as it appears in file names (`mooncake:early` -> `mooncake-early`)."""
    return label.replace(":", "-")


def log_path(log_dir: str | Path, label: str) -> Path:
    """Where `simulate` writes the event log of the run labelled `label`."""
    return Path(log_dir) / f"{file_label(label)}.jsonl"
