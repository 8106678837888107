"""`yb sim`: replay a trace through a simulated cluster around the real conductor.

    yb sim --trace FILE --policy NAME[,NAME...] [--admission none|early|predicted[,...]]
           [--prefill N --decode N --prefill-tp N --decode-tp N --profile NAME|FILE
            --speedup X] --json PATH
    yb sim --workload shared-prefix[:groups=32,...] [--write-trace PATH] [--json PATH ...]
    yb sim --matrix [--limit N] [--seeds 0-5] [--json PATH]
    yb sim --trace FILE --policy coupled,mooncake --capacity [--json PATH]

Simulated prefill, decode and kvstore instances, timed by a cost model (a built-in
profile, `llama2-70b-a800` or `dynamo-mocker`, or a file from `yb profile`), feed the
conductor the events production does and obey its decisions. Every policy runs on
the same workload; `mooncake` runs once per `--admission` value (as
`mooncake:<admission>` when there are several). Prints a markdown table, writes the
figures as JSON and PNG plots; a progress bar goes to stderr. `--workload`
generates the requests instead (`sim.workloads`); `--matrix` runs `sim.matrix`;
`--capacity` searches each policy's highest rate within the SLOs (`sim.capacity`);
`--matrix --seeds` runs the matrix on each seed, as many at once as there are cores,
and tells each setting across them.
The conductor is
imported only here, so `yb` works without it installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from yb_core.config import EvictionPolicyName, YbConfig
from yb_tools.cli.flags import defaults_of, given

if TYPE_CHECKING:
    from collections.abc import Callable

    from yb_conductor.replay import LogRecord
    from yb_tools.sim.params import SimParams
    from yb_tools.sim.runner import RunSpec


def add_parser(sub: Any) -> None:
    """Register `yb sim`."""
    p = sub.add_parser("sim", help="simulate a trace around the real conductor")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake-format trace (JSON lines)")
    source.add_argument(
        "--workload",
        metavar="NAME[:K=V,...]",
        help="a generated workload instead of a trace: shared-prefix, multi-turn, tool-agent, "
        "with its parameters (docs/simulation.md), seeded by --seed",
    )
    source.add_argument(
        "--matrix",
        action="store_true",
        help="every policy x workload x profile x speed x shape, and whether mooncake wins "
        "each (--limit caps requests per workload, default 1000; --trace-file is the "
        "synthetic trace)",
    )
    p.add_argument(
        "--trace-file",
        default="benchmarks/traces/synthetic_trace.jsonl",
        help="the synthetic trace the matrix runs (benchmarks/traces/synthetic_trace.jsonl)",
    )
    p.add_argument(
        "--write-trace", metavar="PATH", help="write the --workload's requests here (JSON lines)"
    )
    p.add_argument(
        "--policy",
        default="mooncake",
        help="policies, comma-separated: random, round-robin, least-loaded, local-prefix, "
        "sglang-cache-aware, dynamo-kv, mooncake, and coupled (the paper's vLLM baseline on "
        "--prefill + --decode instances) (default mooncake)",
    )
    p.add_argument(
        "--admission",
        default="predicted",
        help="the conductor's admission policies, comma-separated: none, early, predicted",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    capacity = p.add_argument_group("capacity search (--capacity)")
    capacity.add_argument(
        "--capacity",
        action="store_true",
        help="for each policy, the highest arrival rate (by --speedup, bisected) at which "
        ">= 90%% of requests meet both SLOs; --speedup is then ignored",
    )
    capacity.add_argument(
        "--capacity-min-speedup", type=float, default=0.125, help="search from (0.125)"
    )
    capacity.add_argument(
        "--capacity-max-speedup", type=float, default=32.0, help="search up to (32)"
    )
    capacity.add_argument(
        "--capacity-iterations",
        type=int,
        default=8,
        help="bisections after both ends (8): a policy costs this + 2 runs",
    )
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--prefill", type=int, default=8, help="prefill instances (8)")
    cluster.add_argument("--decode", type=int, default=8, help="decode instances (8)")
    cluster.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="hosts with a kvstore (default: one per prefill instance)",
    )
    cluster.add_argument(
        "--max-instances",
        type=int,
        default=0,
        metavar="N",
        help="elastic pools (with --set planner=true): the instances the planner may "
        "hold; --prefill and --decode are the start",
    )
    cluster.add_argument(
        "--start-s",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds from the planner's decision to an added instance's start (60)",
    )
    cluster.add_argument(
        "--prefill-tp",
        type=int,
        default=0,
        metavar="N",
        help="devices (tensor-parallel ranks) of each prefill instance (default: the "
        "profile's, 8 for llama2-70b-a800)",
    )
    cluster.add_argument(
        "--decode-tp",
        type=int,
        default=0,
        metavar="N",
        help="devices (tensor-parallel ranks) of each decode instance (default: the profile's)",
    )
    cluster.add_argument(
        "--profile",
        default="llama2-70b-a800",
        help="cost model: llama2-70b-a800, dynamo-mocker, or a `yb profile` file",
    )
    cluster.add_argument(
        "--pool-tokens",
        type=int,
        default=3_000_000,
        help="KV pool per host of one profile instance's devices, tokens (3M)",
    )
    cluster.add_argument(
        "--eviction",
        default="lru",
        choices=get_args(EvictionPolicyName),
        help="pool eviction (lru)",
    )
    cluster.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=0.0,
        help="host-to-host KV bandwidth, GB/s (default: the profile's)",
    )
    cluster.add_argument(
        "--block-size", type=int, default=0, help="tokens per KV block (default: the profile's)"
    )
    cluster.add_argument(
        "--decode-kv-tokens",
        type=int,
        default=0,
        help="KV room per decode instance, tokens (default: the profile's)",
    )
    cluster.add_argument(
        "--decode-max-batch", type=int, default=256, help="batch limit per decode instance"
    )
    cluster.add_argument(
        "--decode-admission",
        default="engine",
        choices=["engine", "reject", "queue"],
        help="a decode instance refuses a request without KV room when its prefill "
        "starts and parks one that finds its batch full (engine: what Yuebing's decode "
        "does), or rejects after the prefill a request without batch room or over the "
        "TBT SLO (reject, the paper's baseline), or queues any request without room",
    )
    cluster.add_argument(
        "--prefill-groups",
        default="",
        metavar="N,N,...",
        help="prefill groups (chunked pipeline parallelism) formed of the first prefill "
        "instances: stage counts, e.g. 2,2 (none)",
    )
    cluster.add_argument(
        "--piggyback",
        action="store_true",
        help="decode instances take prompts into their batch (chunked prefill in decode steps)",
    )
    cluster.add_argument(
        "--chunk-tokens", type=int, default=2048, help="a prefill group's chunk, tokens (2048)"
    )
    cluster.add_argument(
        "--model-layers", type=int, default=80, help="layers a group's stages split (80)"
    )
    load = p.add_argument_group("load and objectives")
    load.add_argument("--speedup", type=float, default=1.0, help="arrival speed-up (1)")
    load.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO, s (30)")
    load.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, s (0.1)")
    load.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="what each request asks for (0: the trace's output length)",
    )
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds (600)")
    load.add_argument(
        "--limit", type=int, default=-1, help="only the first N requests (all; matrix 1000)"
    )
    load.add_argument("--jitter", type=float, default=0.0, help="prefill time noise, +-fraction")
    load.add_argument("--seed", type=int, default=0, help="seed of every random draw (0)")
    load.add_argument(
        "--seeds",
        default="",
        metavar="LIST",
        help="with --matrix: the matrix on each of these seeds, e.g. 0-5 or 0,3,7, and each "
        "setting across them (instead of --seed)",
    )
    load.add_argument(
        "--priority-mix",
        default="",
        metavar="MIX",
        help="requests' priorities as priority:share,... e.g. 1:0.2,0:0.8 (all 0)",
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a conductor setting for every run (repeatable), e.g. decode_time_alpha=0.05",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--plots", metavar="PREFIX", help="PNG prefix (default: the JSON path without .json)"
    )
    out.add_argument("--no-plots", action="store_true", help="write no PNG")
    out.add_argument("--log-dir", metavar="DIR", help="write each run's event log here")
    out.add_argument(
        "--report",
        metavar="PATH",
        help="write each run's timeline (docs/timeline.md) as one HTML file: PATH for one "
        "run, PATH with the run's label before the suffix for several (out-mooncake.html)",
    )
    out.add_argument(
        "--sample-interval", type=float, default=5.0, help="load sampling period, s (5)"
    )
    out.add_argument(
        "--report-interval",
        type=float,
        default=1.0,
        help="instances' load reports (heartbeats), s (1, as the real engines)",
    )
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def params_from(args: argparse.Namespace) -> SimParams:
    """The simulation parameters the flags describe."""
    from yb_tools.sim.params import SimParams, parse_groups, parse_priority_mix

    return SimParams(
        prefill=args.prefill,
        decode=args.decode,
        profile=args.profile,
        block_size=args.block_size,
        pool_tokens=args.pool_tokens,
        eviction=args.eviction,
        bandwidth_gbps=args.bandwidth_gbps,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        speedup=args.speedup,
        decode_kv_tokens=args.decode_kv_tokens,
        decode_max_batch=args.decode_max_batch,
        decode_admission=args.decode_admission,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        sample_interval_s=args.sample_interval,
        report_interval_s=args.report_interval,
        jitter=args.jitter,
        seed=args.seed,
        limit=max(0, args.limit),
        priority_mix=parse_priority_mix(args.priority_mix),
        prefill_groups=parse_groups(args.prefill_groups),
        piggyback=args.piggyback,
        chunk_tokens=args.chunk_tokens,
        model_layers=args.model_layers,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        hosts=args.hosts,
        max_instances=args.max_instances,
        start_s=args.start_s,
    )


# Flags that one kind of run reads and the others do not, by `argparse` dest and how
# the flag is spelt: given to a run that would not read them, they are refused.
_SETTING_FLAGS = {
    "policy": "--policy",
    "admission": "--admission",
    "profile": "--profile",
    "prefill": "--prefill",
    "decode": "--decode",
    "speedup": "--speedup",
    "prefill_tp": "--prefill-tp",
    "decode_tp": "--decode-tp",
}
_OUTPUT_FLAGS = {"plots": "--plots", "log_dir": "--log-dir", "report": "--report"}
_CAPACITY_FLAGS = {
    "capacity_min_speedup": "--capacity-min-speedup",
    "capacity_max_speedup": "--capacity-max-speedup",
    "capacity_iterations": "--capacity-iterations",
}


def ineffective_flags(args: argparse.Namespace) -> str | None:
    """Why the flags given cannot all take effect together, or None (a flag is given
    when it differs from its default: `yb_tools.cli.flags`)."""
    defaults = defaults_of(add_parser)
    if args.matrix and args.capacity:
        return "--matrix and --capacity are different runs; ask for one"
    if args.write_trace and not args.workload:
        return "--write-trace writes the requests of a --workload; give one, or leave it out"
    if args.plots and args.no_plots:
        return "--plots and --no-plots contradict each other"
    if not args.capacity and (flags := given(args, defaults, _CAPACITY_FLAGS)):
        return f"{', '.join(flags)} only apply with --capacity"
    if not args.matrix and args.trace_file != defaults.get_default("trace_file"):
        return "--trace-file is the trace of --matrix; without it, use --trace"
    # The matrix sets each of these itself, for every setting it runs.
    if args.matrix and (flags := given(args, defaults, _SETTING_FLAGS)):
        return (
            "--matrix runs every policy, profile, speed-up and shape: "
            f"{', '.join(flags)} would be ignored"
        )
    if (args.matrix or args.capacity) and (flags := given(args, defaults, _OUTPUT_FLAGS)):
        mode = "--matrix" if args.matrix else "--capacity"
        return f"{mode} writes no plots, logs or timelines: {', '.join(flags)} would be ignored"
    if args.seeds and not args.matrix:
        return "--seeds runs the matrix on each seed; without --matrix, use --seed"
    if args.seeds and args.seed != defaults.get_default("seed"):
        return "--seed and --seeds both choose the seeds; give one"
    if args.limit < -1:
        return f"--limit {args.limit}: a count of requests, 0 or more"
    elastic = {"max_instances": "--max-instances", "start_s": "--start-s"}
    planner_on = any(
        key.strip() == "planner" and value.strip().lower() in ("true", "yes", "on", "1")
        for key, _, value in (item.partition("=") for item in args.settings)
    )
    if not planner_on and (flags := given(args, defaults, elastic)):
        return f"{', '.join(flags)} size elastic pools: they need --set planner=true"
    return None


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb sim`."""
    del cfg  # the simulated cluster is described by the flags alone
    from yb_conductor.cost_model import CostModelError
    from yb_conductor.settings import SettingsError, parse_assignments
    from yb_tools.sim.progress import ProgressBar
    from yb_tools.sim.report import group_table, markdown_table, priority_table, summary_line
    from yb_tools.sim.results import write_json
    from yb_tools.sim.runner import expand, simulate
    from yb_tools.sim.workloads import generate, write_trace

    if (why := ineffective_flags(args)) is not None:
        print(f"yb sim: {why}", file=sys.stderr)
        return 2
    if args.matrix:
        return run_matrix_command(args)
    if args.capacity:
        return run_capacity_command(args)
    records = None
    try:
        if args.workload:
            records = generate(args.workload, seed=args.seed)
    except ValueError as exc:
        print(f"yb sim: {exc}", file=sys.stderr)
        return 2
    if records is not None and args.write_trace:
        write_trace(args.write_trace, records)
        print(f"trace: {args.write_trace} ({len(records)} requests)")
    if not args.json:
        if args.write_trace:
            return 0
        print("yb sim: --json PATH is required to simulate", file=sys.stderr)
        return 2
    try:
        specs = expand(_names(args.policy), _names(args.admission))
        settings: dict[str, Any] = parse_assignments(args.settings)
        params = params_from(args)
        params.check_groups()
    except (ValueError, SettingsError) as exc:
        print(f"yb sim: {exc}", file=sys.stderr)
        return 2
    if params.prefill < 1 or params.decode < 1:
        print("yb sim: need at least one prefill and one decode instance", file=sys.stderr)
        return 2
    if params.prefill_tp < 0 or params.decode_tp < 0:
        print("yb sim: --prefill-tp and --decode-tp count devices: 1 or more", file=sys.stderr)
        return 2
    if params.speedup <= 0:
        print(f"yb sim: --speedup {params.speedup:g}: a factor above 0", file=sys.stderr)
        return 2

    def progress(label: str) -> tuple[ProgressBar, Any]:
        bar = ProgressBar(label, enabled=not args.quiet)
        return bar, bar.close

    try:
        report = simulate(
            args.trace or args.workload,
            specs,
            params,
            records=records,
            settings=settings,
            progress=progress,
            log_dir=args.log_dir,
            on_log=_report_writer(args, len(specs)) if args.report else None,
        )
    except (OSError, CostModelError, SettingsError, ValueError) as exc:
        print(f"yb sim: {exc}", file=sys.stderr)
        return 1
    out = write_json(args.json, report)
    print(summary_line(report))
    print()
    print(markdown_table(report))
    by_priority = priority_table(report)
    if by_priority:
        print()
        print(by_priority)
    groups = group_table(report)
    if groups:
        print()
        print(groups)
    if not args.no_plots:
        from yb_tools.sim.plots import write_plots

        prefix = Path(args.plots) if args.plots else out.with_suffix("")
        try:
            paths = write_plots(report, prefix)
        except ImportError as exc:
            print(f"yb sim: no plots ({exc}); install matplotlib", file=sys.stderr)
        else:
            print()
            print("plots: " + ", ".join(str(p) for p in paths))
    print(f"figures: {out}")
    return 0


def run_matrix_command(args: argparse.Namespace) -> int:
    """`yb sim --matrix`: print the matrix as it runs and the table; JSON to --json.
    With `--seeds`, the matrix on each seed (as many at once as there are cores), a
    line per seed as it completes, then each setting across the seeds."""
    import os

    from yb_conductor.cost_model import CostModelError
    from yb_conductor.settings import SettingsError, parse_assignments, with_overrides
    from yb_core.config import ConductorConfig
    from yb_tools.sim.matrix import (
        DEFAULT_LIMIT,
        Matrix,
        matrix_table,
        parse_seeds,
        run_matrix,
        run_seeds,
        setting_row,
        spread_table,
    )

    def seed_done(m: Matrix) -> None:
        if not args.quiet:
            print(f"seed {m.seed}: mooncake wins {m.wins} of {len(m.settings)}", file=sys.stderr)

    limit = DEFAULT_LIMIT if args.limit < 0 else args.limit
    try:
        base = params_from(args)
        settings: dict[str, Any] = parse_assignments(args.settings)
        common: dict[str, Any] = {
            "trace": args.trace_file,
            "limit": limit,
            "base": base,
            "settings": settings,
        }
        result: object
        if args.seeds:
            seeds = parse_seeds(args.seeds)
            with_overrides(ConductorConfig(), settings)  # refused here, not in every worker
            jobs = min(len(seeds), os.cpu_count() or 1)
            result = run_seeds(seeds, jobs=jobs, on_matrix=seed_done, **common)
            table = spread_table(result)
        else:
            show = None if args.quiet else lambda s: print(setting_row(s), file=sys.stderr)
            result = run_matrix(seed=args.seed, on_setting=show, **common)
            table = matrix_table(result)
    except (OSError, CostModelError, ValueError, SettingsError) as exc:
        print(f"yb sim: {exc}", file=sys.stderr)
        return 1
    print(table)
    if args.json:
        write_figures(args.json, result)
    return 0


def write_figures(path: str, figures: object) -> None:
    """A run's whole result as JSON at `path`, and say where."""
    from yb_tools.sim.results import write_json

    print(f"figures: {write_json(path, figures)}")


def run_capacity_command(args: argparse.Namespace) -> int:
    """`yb sim --capacity`: each policy's capacity; the table, JSON to --json."""
    from yb_conductor.cost_model import CostModelError
    from yb_conductor.settings import SettingsError, parse_assignments
    from yb_tools.sim.capacity import capacity_table, run_capacity
    from yb_tools.sim.runner import expand
    from yb_tools.sim.workloads import generate
    from yb_tools.traces import read_trace

    try:
        specs = expand(_names(args.policy), _names(args.admission))
        settings: dict[str, Any] = parse_assignments(args.settings)
        params = params_from(args)
        if params.prefill < 1 or params.decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        records = generate(args.workload, seed=args.seed) if args.workload else None
        if records is None:
            records = read_trace(args.trace)
        report = run_capacity(
            args.trace or args.workload,
            records,
            specs,
            params,
            settings=settings,
            min_speedup=args.capacity_min_speedup,
            max_speedup=args.capacity_max_speedup,
            iterations=args.capacity_iterations,
            on_run=None
            if args.quiet
            else lambda label, point: print(
                f"{label}: speedup {point.speedup:.4g} ({point.rate_rps:.3f} req/s): "
                f"{point.slo_attainment:.3f} within SLOs",
                file=sys.stderr,
            ),
        )
    except (OSError, CostModelError, SettingsError, ValueError) as exc:
        print(f"yb sim: {exc}", file=sys.stderr)
        return 2
    print(capacity_table(report))
    if args.json:
        write_figures(args.json, report)
    return 0


def report_path(path: str | Path, label: str, runs: int) -> Path:
    """Where a run's timeline goes: `path` itself for a single run, else the run's
    label before the suffix (`out.html` -> `out-mooncake-early.html`)."""
    from yb_tools.sim.runner import file_label

    out = Path(path)
    if runs == 1:
        return out
    return out.with_name(f"{out.stem}-{file_label(label)}{out.suffix or '.html'}")


def _report_writer(
    args: argparse.Namespace, runs: int
) -> Callable[[RunSpec, list[LogRecord]], None]:
    """What writes each run's timeline from its event log, as the run ends."""
    from yb_tools.timeline.report import write_report

    def write(spec: RunSpec, records: list[LogRecord]) -> None:
        path = report_path(args.report, spec.label, runs)
        timeline = write_report(
            records,
            path,
            title=f"yb sim: {spec.label}",
            source=f"trace {args.trace or args.workload}",
        )
        note = f" ({timeline.meta.note})" if timeline.meta.note else ""
        print(f"timeline: {path}{note}")

    return write
