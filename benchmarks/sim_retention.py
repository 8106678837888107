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

Figures (flat), per workload and pool `<workload>_<pool k tokens>k_`: for each way
`<way>_hit_ratio` (share of prefilled prompt tokens taken from the pool),
`<way>_ttft_mean_s`, `<way>_ttft_p90_s`, `<way>_slo_attainment`, `<way>_rejected`; and
`gap_closed`, the share of Belady's gain over LRU the retention reaches ((retention -
lru) / (belady - lru); empty where Belady gains less than 0.001). Ways: `lru`, `retention`,
`belady`, `replicated` (retention and replication). Simulated in virtual time with
fixed seeds: the same code gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

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


def items_of(workload: str, block_size: int) -> list[TraceItem]:
    """The workload's requests at the run's block size."""
    if workload == "synthetic":
        return load_workload(TRACE, block_size=block_size)
    return workload_from(generate(workload), block_size=block_size)


def run() -> list[Row]:
    """Every workload, pool and way of the module docstring."""
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
            rows.append(Row(workload, pool, len(items), results))
            print(f"{rows[-1].key}: done", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    """One row per workload and pool: hit ratios, then mean / p90 TTFT, each way."""
    labels = [label for label, _, _ in WAYS]
    lines = [
        "| workload | pool/host | "
        + " | ".join(f"hit {label}" for label in labels)
        + " | gap closed | "
        + " | ".join(f"TTFT {label} mean / p90 s" for label in labels)
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in labels * 2) + " | ---: |",
    ]
    for row in rows:
        r = row.results
        closed = row.gap_closed()
        lines.append(
            f"| {row.workload} | {row.pool_tokens // 1000}k | "
            + " | ".join(f"{r[label].cache_hit_ratio:.3f}" for label in labels)
            + f" | {'-' if closed is None else f'{closed:.0%}'} | "
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
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the flat figures here")
    args = parser.parse_args()
    rows = run()
    print(table(rows))
    print()
    emit(figures_of(rows), args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
