"""The matrix: every policy on every workload, engine model, speed and cluster shape,
and whether the conductor wins each setting (issue 18's criteria).

A setting is (workload, profile, speed-up, prefill + decode instances): every
combination of the workloads, profiles, speeds and shapes, and settings of their own
(`FOCUSED`: a workload in the one setting it was made for). In each, the
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
from yb_tools.sim.workloads import generate
from yb_tools.traces import TraceRecord, read_trace

PEERS = ("random", "round-robin", "least-loaded", "local-prefix", "sglang-cache-aware", "dynamo-kv")
SYNTHETIC = "synthetic"
PROFILES = ("llama2-70b-a800", "dynamo-mocker")
SPEEDUPS = (1.0, 2.0)
SHAPES = ((8, 8), (8, 1))
# The workloads run in every combination of profile, speed and shape (a generator
# joins the matrix by being named here: its figures are recorded over six seeds).
CROSSED = (SYNTHETIC, "shared-prefix", "multi-turn", "tool-agent")
# Settings of their own: (workload, profile, speed-up, prefill, decode). llm-d's
# shared-prefix ladder where the decode pool's KV binds at its top steps.
FOCUSED: tuple[tuple[str, str, float, int, int], ...] = (
    ("shared-prefix-ladder", "llama2-70b-a800", 1.0, 8, 8),
)
WORKLOADS = tuple(dict.fromkeys([*CROSSED, *(f[0] for f in FOCUSED)]))
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
    focused: tuple[tuple[str, str, float, int, int], ...] = FOCUSED,
) -> Matrix:
    """Run every setting: each workload of `workloads` in `CROSSED` in every
    combination of `profiles`, `speedups` and `shapes`, and the `focused` settings
    whose workload is in `workloads`. `base` gives everything a setting does not
    (SLOs, pools), `settings` the conductor settings every run takes (`--set`).
    `on_setting` is handed each setting as it completes."""
    base = base or SimParams()
    specs = [RunSpec(name, name, "none") for name in peers]
    specs.append(RunSpec(PAPER_POLICY, PAPER_POLICY, ConductorConfig().admission))
    started = time.perf_counter()
    cells: list[Setting] = []
    for workload in workloads:
        records = workload_records(workload, trace, seed)
        runs: list[tuple[str, float, int, int]] = []
        if workload in CROSSED:
            runs.extend(
                (profile, speedup, prefill, decode)
                for profile in profiles
                for speedup in speedups
                for prefill, decode in shapes
            )
        runs.extend((f[1], f[2], f[3], f[4]) for f in focused if f[0] == workload)
        for profile, speedup, prefill, decode in runs:
            params = msgspec.structs.replace(
                base, profile=profile, speedup=speedup, prefill=prefill, decode=decode,
                limit=limit, seed=seed,
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


def _header(columns: tuple[str, ...]) -> list[str]:
    """A markdown table's first two lines: the setting's four columns left-aligned,
    the figures right-aligned."""
    return [
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join(["---"] * 4 + ["---:"] * (len(columns) - 4)) + " |",
    ]


def matrix_table(m: Matrix) -> str:
    """The matrix as a markdown table, one row per setting, and the tally."""
    lines = _header(MATRIX_COLUMNS)
    lines.extend(setting_row(s) for s in m.settings)
    lines.append("")
    lines.append(f"mooncake wins {m.wins} of {len(m.settings)} settings.")
    return "\n".join(lines)


# --- several seeds --------------------------------------------------------------------


class SeedSpread(msgspec.Struct, kw_only=True):
    """One setting over several seeds: on how many the conductor wins it, which
    criteria it misses on how many, and how far its goodput stands from the best
    peer's on each seed, beside how far the peers stand from one another."""

    workload: str
    profile: str
    speedup: float
    prefill: int
    decode: int
    wins: int
    missed: dict[str, int]
    goodput_margins: list[float]
    peer_goodput_spreads: list[float]


class SeedsMatrix(msgspec.Struct, kw_only=True):
    """The matrix on each of several seeds (`yb sim --matrix --seeds`), and each
    setting across them. The generated workloads draw other requests on each seed;
    the synthetic trace is the same file, so only the simulation's own draws differ."""

    seeds: list[int]
    wins_by_seed: list[int]
    spread: list[SeedSpread]
    matrices: list[Matrix]
    wall_s: float


def parse_seeds(text: str) -> list[int]:
    """`0,3,5` or `0-5` (or both, `0-2,7`): the seeds, in order, each once."""
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"a seed is a number 0 or more, or a range like 0-5, not {part!r}")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"the seed range {part!r} runs backwards")
        seeds.extend(s for s in range(lo, hi + 1) if s not in seeds)
    if not seeds:
        raise ValueError("no seed given")
    return seeds


def _matrix_on(seed: int, kwargs: dict[str, Any]) -> Matrix:
    return run_matrix(seed=seed, **kwargs)


def run_seeds(
    seeds: list[int],
    *,
    jobs: int = 1,
    on_matrix: Callable[[Matrix], None] | None = None,
    **kwargs: Any,
) -> SeedsMatrix:
    """`run_matrix` on each seed (`kwargs` as it takes them, but `seed` and
    `on_setting`), `jobs` of them at once in processes of their own: the figures
    are the same however many run together. `on_matrix` is handed each matrix as it
    completes."""
    started = time.perf_counter()
    matrices: dict[int, Matrix] = {}
    if jobs <= 1 or len(seeds) == 1:
        for seed in seeds:
            matrices[seed] = _matrix_on(seed, kwargs)
            if on_matrix is not None:
                on_matrix(matrices[seed])
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Spawned, not forked: the caller may hold threads and locks a fork would copy.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(seeds)), mp_context=context) as pool:
            futures = {pool.submit(_matrix_on, seed, kwargs): seed for seed in seeds}
            for future in as_completed(futures):
                matrices[futures[future]] = future.result()
                if on_matrix is not None:
                    on_matrix(matrices[futures[future]])
    ordered = [matrices[seed] for seed in seeds]
    return SeedsMatrix(
        seeds=list(seeds),
        wins_by_seed=[m.wins for m in ordered],
        spread=seed_spread(ordered),
        matrices=ordered,
        wall_s=time.perf_counter() - started,
    )


def seed_spread(matrices: list[Matrix]) -> list[SeedSpread]:
    """Each setting of the matrices (the same settings in the same order, one matrix
    per seed) across them."""
    spread: list[SeedSpread] = []
    for cells in zip(*(m.settings for m in matrices), strict=True):
        first = cells[0]
        missed: dict[str, int] = {}
        margins: list[float] = []
        peer_spreads: list[float] = []
        for s in cells:
            for name in s.verdict.missed():
                missed[name] = missed.get(name, 0) + 1
            peers = [f.goodput_rps for name, f in s.policies.items() if name != PAPER_POLICY]
            best = s.policies[s.verdict.best_goodput_peer].goodput_rps
            margins.append(round(s.policies[PAPER_POLICY].goodput_rps - best, 6))
            peer_spreads.append(round(max(peers) - min(peers), 6))
        spread.append(
            SeedSpread(
                workload=first.workload,
                profile=first.profile,
                speedup=first.speedup,
                prefill=first.prefill,
                decode=first.decode,
                wins=sum(s.wins for s in cells),
                missed=missed,
                goodput_margins=margins,
                peer_goodput_spreads=peer_spreads,
            )
        )
    return spread


SPREAD_COLUMNS = (
    "workload",
    "profile",
    "speed",
    "P+D",
    "seeds won",
    "criteria missed (seeds)",
    "goodput − best peer's, rps: mean (lowest … highest)",
    "peers' own spread, rps (mean)",
)


def spread_row(s: SeedSpread) -> str:
    """One setting across the seeds as a markdown table row."""
    n = len(s.goodput_margins)
    margins = s.goodput_margins
    mean = sum(margins) / n
    missed = ", ".join(f"{name} ({k})" for name, k in s.missed.items()) or "—"
    cells = [
        s.workload,
        s.profile,
        f"{s.speedup:g}x",
        f"{s.prefill}+{s.decode}",
        f"{s.wins} of {n}",
        missed,
        f"{mean:+.3f} ({min(margins):+.3f} … {max(margins):+.3f})",
        f"{sum(s.peer_goodput_spreads) / n:.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


def spread_table(m: SeedsMatrix) -> str:
    """The settings across the seeds as a markdown table, and the tally per seed."""
    lines = _header(SPREAD_COLUMNS)
    lines.extend(spread_row(s) for s in m.spread)
    every = sum(s.wins == len(m.seeds) for s in m.spread)
    by_seed = zip(m.seeds, m.wins_by_seed, strict=True)
    tally = ", ".join(f"{w} on seed {seed}" for seed, w in by_seed)
    lines.append("")
    lines.append(
        f"mooncake wins {every} of {len(m.spread)} settings on every one of {len(m.seeds)} "
        f"seeds; settings won: {tally}."
    )
    return "\n".join(lines)
