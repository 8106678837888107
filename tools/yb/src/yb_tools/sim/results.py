"""What one policy's run measured, summarized from every request's journey.

Latency figures are over completed requests: TTFT from arrival to the first token,
TBT the mean time between a request's later tokens (percentiles over requests, as
the SLO is judged per request). A request meets the SLO when it completed with TTFT
and mean TBT within their limits; `slo_attainment` is the share of *all* requests
that did, `goodput_rps` their number over the trace's arrival span. Rejections count
at arrival (the conductor) and at decode admission (after a prefill was paid for:
that prefill time is `wasted_prefill_s`). `kv_exhausted` counts the requests a
decode instance ended mid-stream because its KV pages ran out (the engine's rule:
it reserves only the prompt's pages, and ends the newest running request of lowest
priority when the batch's growth finds no page free): they had their first token but
not their output, so they are neither completed nor within the SLO, and their
latencies are not in the TTFT and TBT figures. `cache_hit_ratio` is the share of prefilled
prompt tokens taken from a pool instead of computed, local (own host) or remote
(pulled from another host, whose bytes are `transfer_bytes`). `by_priority`
gives the same judgement per priority class (`PriorityResult`).
`needless_rejections` counts the rejected requests that met both SLOs in the same
run with admission `none` (`quality`); `needless_rejection_share` is their share of
`rejected`. With prefill groups, `group_requests` were placed on a group, and the
median prompt and mean TTFT of the completed ones on groups and on whole-model
instances show which requests the conductor gave the pipeline; likewise
`piggyback_requests` were prefilled inside a decode instance's batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from yb_conductor.quality import reject_code
from yb_tools.sim.job import Job


class LoadSeries(msgspec.Struct, kw_only=True):
    """Both pools' load, sampled every `interval_s` (the seesaw of the paper's §7).

    `prefill_backlog_s`: seconds of work queued per prefill instance (mean);
    `decode_tbt_ratio`: the decode instances' current step time over the TBT SLO
    (mean); `prefill_in_flight` and `decode_running` count requests.
    """

    interval_s: float
    t: list[float] = msgspec.field(default_factory=list)
    prefill_backlog_s: list[float] = msgspec.field(default_factory=list)
    prefill_in_flight: list[int] = msgspec.field(default_factory=list)
    decode_tbt_ratio: list[float] = msgspec.field(default_factory=list)
    decode_running: list[int] = msgspec.field(default_factory=list)


class PriorityResult(msgspec.Struct, kw_only=True):
    """One priority class's figures: its requests' fates, TTFT and TBT percentiles
    over its completed requests, and the share of its requests meeting the SLO
    (`ttft_within_slo`: of its completed requests, those whose TTFT met it)."""

    priority: int
    requests: int
    completed: int
    rejected: int
    timed_out: int
    kv_exhausted: int = 0
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_max_s: float
    tbt_p90_s: float
    ttft_within_slo: float
    slo_attainment: float


class PolicyResult(msgspec.Struct, kw_only=True):
    """One policy's figures (see the module docstring for their meaning)."""

    policy: str
    admission: str
    requests: int
    completed: int
    rejected: int
    rejected_at_arrival: int
    rejected_at_decode: int
    timed_out: int
    kv_exhausted: int = 0
    reject_reasons: dict[str, int]
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    slo_attainment: float
    goodput_rps: float
    wasted_prefill_s: float
    prefill_busy_s: float
    cache_hit_ratio: float
    local_reused_tokens: int
    remote_reused_tokens: int
    reused_tokens: int
    prefilled_prompt_tokens: int
    transfer_bytes: int
    kv_to_decode_bytes: int
    decisions: int
    events: int
    conductor_s: float
    simulated_s: float
    wall_s: float
    simulated_seconds_per_wall_second: float
    load_over_time: LoadSeries
    by_priority: dict[int, PriorityResult] = msgspec.field(default_factory=dict)
    # Filled in by the runner from the run with admission `none` (`quality`).
    needless_rejections: int = 0
    needless_rejection_share: float = 0.0
    group_requests: int = 0
    group_prompt_p50: float = 0.0
    group_ttft_mean_s: float = 0.0
    whole_requests: int = 0
    whole_prompt_p50: float = 0.0
    whole_ttft_mean_s: float = 0.0
    piggyback_requests: int = 0
    piggyback_prompt_p50: float = 0.0
    piggyback_ttft_mean_s: float = 0.0
    # Engine instances held, integrated over the run (hours), and the planner's
    # actions carried out (elastic pools: `SimParams.max_instances`).
    instance_hours: float = 0.0
    pool_actions: int = 0


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, linearly interpolated (0 if empty)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def summarize(
    jobs: list[Job],
    *,
    label: str,
    admission: str,
    block_size: int,
    kv_bytes_per_token: int,
    ttft_slo_s: float,
    tbt_slo_s: float,
    simulated_s: float,
    wall_s: float,
    decisions: int,
    events: int,
    conductor_s: float,
    load: LoadSeries,
) -> PolicyResult:
    """Fold every job's fate into the figures."""
    ttfts: list[float] = []
    tbts: list[float] = []
    reasons: dict[str, int] = {}
    counts = {"completed": 0, "rejected": 0, "decode_rejected": 0, "timed_out": 0}
    good = 0
    wasted = busy = 0.0
    local = remote = prefilled = kv_to_decode = 0
    for job in jobs:
        fate = job.fate
        counts[fate] = counts.get(fate, 0) + 1
        item = job.item
        if job.prefill_start >= 0:
            busy += job.prefill_s
            local += job.reused_local
            remote += job.reused_remote
            prefilled += item.prompt_tokens
        if fate in ("rejected", "decode_rejected"):
            code = reject_code(job.reason)
            reasons[code] = reasons.get(code, 0) + 1
            if fate == "decode_rejected":
                wasted += job.prefill_s
            continue
        if fate != "completed":
            continue
        kv_to_decode += item.prompt_tokens
        ttft = job.ttft_s
        ttfts.append(ttft)
        tbt = job.tbt_s
        if item.output_tokens > 1:
            tbts.append(tbt)
        if ttft <= ttft_slo_s and tbt <= tbt_slo_s:
            good += 1
    ttfts.sort()
    tbts.sort()
    n = len(jobs)
    arrivals = [j.item.arrival for j in jobs]
    span = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    if span <= 0.0:
        span = simulated_s or 1.0
    local_tokens = local * block_size
    remote_tokens = remote * block_size
    return PolicyResult(
        policy=label,
        admission=admission,
        requests=n,
        completed=counts["completed"],
        rejected=counts["rejected"] + counts["decode_rejected"],
        rejected_at_arrival=counts["rejected"],
        rejected_at_decode=counts["decode_rejected"],
        timed_out=counts["timed_out"],
        kv_exhausted=counts.get("kv_exhausted", 0),
        reject_reasons=dict(sorted(reasons.items())),
        ttft_mean_s=_mean(ttfts),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        tbt_mean_s=_mean(tbts),
        tbt_p50_s=percentile(tbts, 0.5),
        tbt_p90_s=percentile(tbts, 0.9),
        tbt_p99_s=percentile(tbts, 0.99),
        slo_attainment=good / n if n else 0.0,
        goodput_rps=good / span,
        wasted_prefill_s=wasted,
        prefill_busy_s=busy,
        cache_hit_ratio=(local_tokens + remote_tokens) / prefilled if prefilled else 0.0,
        local_reused_tokens=local_tokens,
        remote_reused_tokens=remote_tokens,
        reused_tokens=local_tokens + remote_tokens,
        prefilled_prompt_tokens=prefilled,
        transfer_bytes=remote_tokens * kv_bytes_per_token,
        kv_to_decode_bytes=kv_to_decode * kv_bytes_per_token,
        decisions=decisions,
        events=events,
        conductor_s=conductor_s,
        simulated_s=simulated_s,
        wall_s=wall_s,
        simulated_seconds_per_wall_second=simulated_s / wall_s if wall_s > 0 else 0.0,
        load_over_time=load,
        by_priority=by_priority(jobs, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s),
        **group_use(jobs),
    )


def group_use(jobs: list[Job]) -> dict[str, Any]:
    """Where the prompts were prefilled, when not all on whole-model prefill
    instances: on prefill groups, inside decode batches (empty when neither)."""
    placed = [j for j in jobs if j.prefill >= 0]
    grouped = [j for j in placed if j.stages]
    piggybacked = [j for j in jobs if j.piggyback]
    if not grouped and not piggybacked:
        return {}
    whole = [j for j in placed if not j.stages]

    def prompt_p50(js: list[Job]) -> float:
        return percentile(sorted(float(j.item.prompt_tokens) for j in js), 0.5)

    def ttft_mean(js: list[Job]) -> float:
        return _mean([j.ttft_s for j in js if j.fate == "completed"])

    return {
        "group_requests": len(grouped),
        "group_prompt_p50": prompt_p50(grouped),
        "group_ttft_mean_s": ttft_mean(grouped),
        "whole_requests": len(whole),
        "whole_prompt_p50": prompt_p50(whole),
        "whole_ttft_mean_s": ttft_mean(whole),
        "piggyback_requests": len(piggybacked),
        "piggyback_prompt_p50": prompt_p50(piggybacked),
        "piggyback_ttft_mean_s": ttft_mean(piggybacked),
    }


def by_priority(
    jobs: list[Job], *, ttft_slo_s: float, tbt_slo_s: float
) -> dict[int, PriorityResult]:
    """Each priority class's figures, by priority (largest first)."""
    classes: dict[int, list[Job]] = {}
    for job in jobs:
        classes.setdefault(job.priority, []).append(job)
    out: dict[int, PriorityResult] = {}
    for priority in sorted(classes, reverse=True):
        members = classes[priority]
        done = [j for j in members if j.fate == "completed"]
        ttfts = sorted(j.ttft_s for j in done)
        tbts = sorted(j.tbt_s for j in done if j.item.output_tokens > 1)
        fast = sum(1 for j in done if j.ttft_s <= ttft_slo_s)
        good = sum(1 for j in done if j.ttft_s <= ttft_slo_s and j.tbt_s <= tbt_slo_s)
        out[priority] = PriorityResult(
            priority=priority,
            requests=len(members),
            completed=len(done),
            rejected=sum(1 for j in members if j.fate in ("rejected", "decode_rejected")),
            timed_out=sum(1 for j in members if j.fate == "timed_out"),
            kv_exhausted=sum(1 for j in members if j.fate == "kv_exhausted"),
            ttft_p50_s=percentile(ttfts, 0.5),
            ttft_p90_s=percentile(ttfts, 0.9),
            ttft_p99_s=percentile(ttfts, 0.99),
            ttft_max_s=ttfts[-1] if ttfts else 0.0,
            tbt_p90_s=percentile(tbts, 0.9),
            ttft_within_slo=fast / len(done) if done else 0.0,
            slo_attainment=good / len(members),
        )
    return out


def write_json(path: str | Path, result: object) -> Path:
    """A run's whole result (a struct of `yb sim`'s) as indented JSON at `path`, its
    folder made; the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(msgspec.to_builtins(result), indent=1) + "\n")
    return out
