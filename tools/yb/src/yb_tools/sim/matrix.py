"""The matrix: every policy on every workload, engine model, speed and cluster shape,
and whether the conductor wins each setting (issue 18's criteria).

A setting is (workload, profile, speed-up, prefill + decode instances). In each, the
peer policies run with admission `none` (they never refuse on load) and `mooncake`
with the conductor's default admission. The conductor *wins* a setting when

- its mean and p90 TTFT are at or below the best peer's (the lowest of each),
- its goodput is at or above the best peer's, and
- it rejected nothing and had no request ended for lack of decode KV pages
  (`kv_exhausted`), if some peer met every SLO (served every request within both).

Rejections are judged for need against the same policy with admission `none`
(`quality`). Everything is simulated in virtual time with fixed seeds: the same code
gives the same matrix on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from yb_core.config import ConductorConfig
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.runner import PAPER_POLICY, RunSpec, simulate
from yb_tools.sim.workloads import GENERATORS, generate
from yb_tools.traces import TraceRecord, read_trace

PEERS = ("random", "round-robin", "least-loaded", "local-prefix", "sglang-cache-aware", "dynamo-kv")
SYNTHETIC = "synthetic"
WORKLOADS = (SYNTHETIC, *GENERATORS)
PROFILES = ("llama2-70b-a800", "dynamo-mocker")
SPEEDUPS = (1.0, 2.0)
SHAPES = ((8, 8), (8, 1))
# Requests per workload by default: the whole matrix runs in minutes on two cores.
DEFAULT_LIMIT = 1000


class PolicyFigures(msgspec.Struct, kw_only=True):
    """What the matrix compares of one policy's run in one setting."""

    admission: str
    ttft_mean_s: float
    ttft_p90_s: float
    goodput_rps: float
    slo_attainment: float
    rejected: int
    needless_rejections: int
    cache_hit_ratio: float
    kv_exhausted: int = 0

    @classmethod
    def of(cls, r: PolicyResult) -> PolicyFigures:
        """The matrix's figures of a run."""
        return cls(
            admission=r.admission,
            ttft_mean_s=r.ttft_mean_s,
            ttft_p90_s=r.ttft_p90_s,
            goodput_rps=r.goodput_rps,
            slo_attainment=r.slo_attainment,
            rejected=r.rejected,
            needless_rejections=r.needless_rejections,
            cache_hit_ratio=r.cache_hit_ratio,
            kv_exhausted=r.kv_exhausted,
        )


class Verdict(msgspec.Struct, kw_only=True):
    """The conductor against the best peer in one setting, criterion by criterion."""

    ttft_mean: bool
    ttft_p90: bool
    goodput: bool
    rejections: bool
    best_ttft_mean_peer: str
    best_ttft_p90_peer: str
    best_goodput_peer: str
    peers_meeting_every_slo: list[str]

    @property
    def wins(self) -> bool:
        """Every criterion met."""
        return self.ttft_mean and self.ttft_p90 and self.goodput and self.rejections

    def missed(self) -> list[str]:
        """The criteria not met, by name (mean, p90, goodput, rejections)."""
        return [
            name
            for name, ok in (
                ("mean", self.ttft_mean), ("p90", self.ttft_p90), ("goodput", self.goodput),
                ("rejections", self.rejections),
            )
            if not ok
        ]  # fmt: skip


class Setting(msgspec.Struct, kw_only=True):
    """One cell of the matrix: what ran, every policy's figures, the verdict."""

    workload: str
    profile: str
    speedup: float
    prefill: int
    decode: int
    requests: int
    policies: dict[str, PolicyFigures]
    verdict: Verdict
    wins: bool


class Matrix(msgspec.Struct, kw_only=True):
    """The whole matrix, as `yb sim --matrix` writes it."""

    limit: int
    seed: int
    ttft_slo_s: float
    tbt_slo_s: float
    settings: list[Setting]
    wins: int
    conductor_settings: dict[str, Any] = msgspec.field(default_factory=dict)
    wall_s: float


def judge(policies: dict[str, PolicyFigures], conductor: str = PAPER_POLICY) -> Verdict:
    """The conductor's run against the peers' (every other entry)."""
    ours = policies[conductor]
    peers = {name: f for name, f in policies.items() if name != conductor}
    mean_peer = min(peers, key=lambda n: peers[n].ttft_mean_s)
    p90_peer = min(peers, key=lambda n: peers[n].ttft_p90_s)
    goodput_peer = max(peers, key=lambda n: peers[n].goodput_rps)
    perfect = [name for name, f in peers.items() if f.slo_attainment >= 1.0]
    return Verdict(
        ttft_mean=ours.ttft_mean_s <= peers[mean_peer].ttft_mean_s,
        ttft_p90=ours.ttft_p90_s <= peers[p90_peer].ttft_p90_s,
        goodput=ours.goodput_rps >= peers[goodput_peer].goodput_rps,
        rejections=not perfect or ours.rejected + ours.kv_exhausted == 0,
        best_ttft_mean_peer=mean_peer,
        best_ttft_p90_peer=p90_peer,
        best_goodput_peer=goodput_peer,
        peers_meeting_every_slo=perfect,
    )


def workload_records(name: str, trace: str | Path, seed: int) -> list[TraceRecord]:
    """The workload's requests: the synthetic trace file, or a generated workload."""
    return read_trace(trace) if name == SYNTHETIC else generate(name, seed=seed)


def run_matrix(
    *,
    trace: str | Path,
    limit: int = DEFAULT_LIMIT,
    seed: int = 0,
    workloads: tuple[str, ...] = WORKLOADS,
    profiles: tuple[str, ...] = PROFILES,
    speedups: tuple[float, ...] = SPEEDUPS,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    peers: tuple[str, ...] = PEERS,
    base: SimParams | None = None,
    settings: Mapping[str, Any] | None = None,
    on_setting: Callable[[Setting], None] | None = None,
) -> Matrix:
    """Run every setting; `base` gives everything a setting does not (SLOs, pools),
    `settings` the conductor settings every run takes (`--set`). `on_setting` is
    handed each setting as it completes."""
    base = base or SimParams()
    specs = [RunSpec(name, name, "none") for name in peers]
    specs.append(RunSpec(PAPER_POLICY, PAPER_POLICY, ConductorConfig().admission))
    started = time.perf_counter()
    cells: list[Setting] = []
    for workload in workloads:
        records = workload_records(workload, trace, seed)
        for profile in profiles:
            for speedup in speedups:
                for prefill, decode in shapes:
                    params = msgspec.structs.replace(
                        base, profile=profile, speedup=speedup, prefill=prefill,
                        decode=decode, limit=limit, seed=seed,
                    )  # fmt: skip
                    report = simulate(workload, specs, params, records=records, settings=settings)
                    figures = {k: PolicyFigures.of(r) for k, r in report.policies.items()}
                    verdict = judge(figures)
                    setting = Setting(
                        workload=workload, profile=profile, speedup=speedup, prefill=prefill,
                        decode=decode, requests=report.requests, policies=figures,
                        verdict=verdict, wins=verdict.wins,
                    )  # fmt: skip
                    cells.append(setting)
                    if on_setting is not None:
                        on_setting(setting)
    return Matrix(
        limit=limit,
        seed=seed,
        ttft_slo_s=base.ttft_slo_s,
        tbt_slo_s=base.tbt_slo_s,
        settings=cells,
        wins=sum(s.wins for s in cells),
        conductor_settings=dict(settings or {}),
        wall_s=time.perf_counter() - started,
    )


MATRIX_COLUMNS = (
    "workload",
    "profile",
    "speed",
    "P+D",
    "mooncake TTFT mean / p90 s",
    "best peer mean / p90 s",
    "goodput rps (best peer)",
    "rejected (needless)",
    "kv exhausted (best goodput peer)",
    "peers meeting every SLO",
    "wins",
)


def _mark(ok: bool) -> str:
    return "" if ok else " ✗"


def setting_row(s: Setting) -> str:
    """One setting as a markdown table row; ✗ marks a criterion the conductor misses."""
    ours = s.policies[PAPER_POLICY]
    v = s.verdict
    best_mean = s.policies[v.best_ttft_mean_peer]
    best_p90 = s.policies[v.best_ttft_p90_peer]
    best_goodput = s.policies[v.best_goodput_peer]
    failed = v.missed()
    cells = [
        s.workload,
        s.profile,
        f"{s.speedup:g}x",
        f"{s.prefill}+{s.decode}",
        f"{ours.ttft_mean_s:.2f}{_mark(v.ttft_mean)} / {ours.ttft_p90_s:.2f}{_mark(v.ttft_p90)}",
        f"{best_mean.ttft_mean_s:.2f} ({v.best_ttft_mean_peer}) / "
        f"{best_p90.ttft_p90_s:.2f} ({v.best_ttft_p90_peer})",
        f"{ours.goodput_rps:.2f}{_mark(v.goodput)} ({best_goodput.goodput_rps:.2f} "
        f"{v.best_goodput_peer})",
        f"{ours.rejected} ({ours.needless_rejections}){_mark(v.rejections)}",
        f"{ours.kv_exhausted} ({best_goodput.kv_exhausted})",
        str(len(v.peers_meeting_every_slo)),
        "yes" if s.wins else "no: " + ", ".join(failed),
    ]
    return "| " + " | ".join(cells) + " |"


def matrix_table(m: Matrix) -> str:
    """The matrix as a markdown table, one row per setting, and the tally."""
    lines = [
        "| " + " | ".join(MATRIX_COLUMNS) + " |",
        "| " + " | ".join(["---"] * 4 + ["---:"] * (len(MATRIX_COLUMNS) - 4)) + " |",
    ]
    lines.extend(setting_row(s) for s in m.settings)
    lines.append("")
    lines.append(f"mooncake wins {m.wins} of {len(m.settings)} settings.")
    return "\n".join(lines)
