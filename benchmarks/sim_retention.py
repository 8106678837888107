"""What the pool keeps, in `yb sim`: each kvstore's LRU, the conductor's retention, and
Belady's offline optimum, on the same trace with a pool small enough to evict.

    python benchmarks/sim_retention.py --json PATH

Three workloads: Mooncake's synthetic trace (`benchmarks/traces/synthetic_trace.jsonl`),
conversations (`multi-turn`) and groups sharing long system prompts (`shared-prefix`),
each generated with its defaults and seed 0. The paper's engine model
(`llama2-70b-a800`), 8 prefill + 8 decode instances, the conductor (`mooncake`,
admission `predicted`), and each host's pool cut to the workload's `POOLS` tokens (the
paper's is 3M, at which none of these workloads evicts; the larger of each pair
evicts a little, the smaller a lot). Each is played three ways
(`yb_tools.sim.retention`): `lru` (retention off: each kvstore evicts its least
recently used blocks), `retention` (the conductor's `RetentionPlanned` advice), and
`belady` (every kvstore evicts the block whose next use in the trace is farthest: the
limit); and `retention` once more with hot-prefix replication (`hot_replicas` 2).

A queue at its limit is chaotic: a run whose engines differ by 0.1% can place many
requests elsewhere and move a hit ratio by a few points. So each workload and pool
is also played `--seeds` (4) more times, the lru, retention and Belady ways, with
jitter seeds (every job's time drawn within `JITTER`, 0.1%, of the cost model's)
and, for the generated workloads, the workload's seed too.

Figures (flat), per workload and pool `<workload>_<pool k tokens>k_`: for each way
`<way>_hit_ratio` (share of prefilled prompt tokens taken from the pool),
`<way>_ttft_mean_s`, `<way>_ttft_p90_s`, `<way>_slo_attainment`, `<way>_rejected`; and
`gap_closed`, the share of Belady's gain over LRU the retention reaches ((retention -
lru) / (belady - lru); empty where Belady gains less than 0.001); over the seeds,
`seeds_gap_closed` (the same of the seeds' mean hit ratios) and
`seeds_gap_closed_min` / `_max` (of each seed's). Ways: `lru`, `retention`,
`belady`, `replicated` (retention and replication). Simulated in virtual time with
fixed seeds: the same code gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

from figures import emit  # noqa: E402

from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.results import PolicyResult  # noqa: E402
from yb_tools.sim.retention import run_retention  # noqa: E402
from yb_tools.sim.runner import resolve_cost  # noqa: E402
from yb_tools.sim.simulator import block_size_for  # noqa: E402
from yb_tools.sim.workload import TraceItem, load_workload, workload_from  # noqa: E402
from yb_tools.sim.workloads import generate  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"
PROFILE = "llama2-70b-a800"
# Tokens of pool per host, per workload: small enough to evict (each workload's
# blocks differ in number and reuse, so the sizes that evict do too).
POOLS: dict[str, tuple[int, ...]] = {
    "synthetic": (200_000, 50_000),
    "multi-turn": (50_000, 25_000),
    "shared-prefix": (100_000, 50_000),
}
#: Each job's time is drawn within this fraction of the cost model's in the seeded runs.
JITTER = 0.001
#: The ways played again with each seed.
SEEDED_WAYS = ("lru", "retention", "belady")
# (label, retention mode, settings laid over the conductor's)
WAYS: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("lru", "lru", {}),
    ("retention", "retention", {}),
    ("belady", "belady", {}),
    ("replicated", "retention", {"hot_replicas": 2}),
)


@dataclass(frozen=True, slots=True)
class Row:
    """One workload at one pool size, every way."""

    workload: str
    pool_tokens: int
    requests: int
    results: dict[str, PolicyResult]
    # Per seed, each of `SEEDED_WAYS`' hit ratio.
    seeded: list[dict[str, float]] = field(default_factory=list)

    @property
    def key(self) -> str:
        """The figures' prefix."""
        return f"{self.workload.replace('-', '_')}_{self.pool_tokens // 1000}k"

    def gap_closed(self) -> float | None:
        """(retention - lru) / (belady - lru) of the hit ratio, None without a gap."""
        lru = self.results["lru"].cache_hit_ratio
        gap = self.results["belady"].cache_hit_ratio - lru
        if gap < 0.001:
            return None
        return (self.results["retention"].cache_hit_ratio - lru) / gap

    def seeds_gap_closed(self) -> tuple[float, float, float] | None:
        """Over the seeds: the gap closed of the mean hit ratios, and the least and
        most of each seed's; None without seeds or a gap."""
        if not self.seeded:
            return None
        mean = {w: sum(s[w] for s in self.seeded) / len(self.seeded) for w in SEEDED_WAYS}
        gap = mean["belady"] - mean["lru"]
        each = [
            (s["retention"] - s["lru"]) / (s["belady"] - s["lru"])
            for s in self.seeded
            if s["belady"] - s["lru"] >= 0.001
        ]
        if gap < 0.001 or not each:
            return None
        return (mean["retention"] - mean["lru"]) / gap, min(each), max(each)


def items_of(workload: str, block_size: int, seed: int = 0) -> list[TraceItem]:
    """The workload's requests at the run's block size (a generated one, of `seed`)."""
    if workload == "synthetic":
        return load_workload(TRACE, block_size=block_size)
    return workload_from(generate(workload, seed=seed), block_size=block_size)


def run(seeds: int) -> list[Row]:
    """Every workload, pool and way of the module docstring, and `seeds` seeds."""
    rows = []
    for workload, pools in POOLS.items():
        for pool in pools:
            params = SimParams(profile=PROFILE, pool_tokens=pool)
            cost = resolve_cost(params)
            items = items_of(workload, block_size_for(params, cost))
            results = {
                label: run_retention(items, params, cost, mode, settings=settings)
                for label, mode, settings in WAYS
            }
            row = Row(workload, pool, len(items), results)
            for seed in range(1, seeds + 1):
                at = msgspec.structs.replace(params, jitter=JITTER, seed=seed)
                seeded = items_of(workload, block_size_for(at, cost), seed)
                row.seeded.append(
                    {w: run_retention(seeded, at, cost, w).cache_hit_ratio for w in SEEDED_WAYS}
                )
            rows.append(row)
            print(f"{row.key}: done", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    """One row per workload and pool: hit ratios, then mean / p90 TTFT, each way."""
    labels = [label for label, _, _ in WAYS]
    lines = [
        "| workload | pool/host | "
        + " | ".join(f"hit {label}" for label in labels)
        + " | gap closed | over seeds (least-most) | "
        + " | ".join(f"TTFT {label} mean / p90 s" for label in labels)
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in labels * 2) + " | ---: | ---: |",
    ]
    for row in rows:
        r = row.results
        closed = row.gap_closed()
        over = row.seeds_gap_closed()
        seeded = "-" if over is None else f"{over[0]:.0%} ({over[1]:.0%}-{over[2]:.0%})"
        lines.append(
            f"| {row.workload} | {row.pool_tokens // 1000}k | "
            + " | ".join(f"{r[label].cache_hit_ratio:.3f}" for label in labels)
            + f" | {'-' if closed is None else f'{closed:.0%}'} | {seeded} | "
            + " | ".join(
                f"{r[label].ttft_mean_s:.2f} / {r[label].ttft_p90_s:.2f}" for label in labels
            )
            + " |"
        )
    return "\n".join(lines)


def figures_of(rows: list[Row]) -> dict[str, float | int | str]:
    """The flat figures of the module docstring."""
    figures: dict[str, float | int | str] = {"profile": PROFILE}
    for row in rows:
        k = row.key
        figures[f"{k}_requests"] = row.requests
        for label, result in row.results.items():
            figures[f"{k}_{label}_hit_ratio"] = round(result.cache_hit_ratio, 4)
            figures[f"{k}_{label}_ttft_mean_s"] = round(result.ttft_mean_s, 3)
            figures[f"{k}_{label}_ttft_p90_s"] = round(result.ttft_p90_s, 3)
            figures[f"{k}_{label}_slo_attainment"] = round(result.slo_attainment, 4)
            figures[f"{k}_{label}_rejected"] = result.rejected
        closed = row.gap_closed()
        figures[f"{k}_gap_closed"] = "" if closed is None else round(closed, 3)
        over = row.seeds_gap_closed()
        if row.seeded:
            for i, name in enumerate(("", "_min", "_max")):
                figures[f"{k}_seeds_gap_closed{name}"] = "" if over is None else round(over[i], 3)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the flat figures here")
    parser.add_argument(
        "--seeds", type=int, default=4, help="jitter (and workload) seeds played again (4)"
    )
    args = parser.parse_args()
    rows = run(args.seeds)
    print(table(rows))
    print()
    emit(figures_of(rows), args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
