"""`yb`: the one command people use to run and inspect Yuebing.

    yb up [--port N] [--data-dir DIR] [--model SOURCE] [--prefill N --decode N --kvstore N]
          [--prefill-groups N[,N...]]
          [--prefill-tp N --decode-tp M]    tensor-parallel degree of each instance
          [--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16]
          [--gpus all|I[,I...]]             the GPUs the engines take, their own each
          [--conductors N]                  one active conductor, the rest standby
          [--on-exit restart|keep-going|stop]  an exited process: restarted (default),
                                            left down, or the cluster stopped
          [--restart-max-backoff SECONDS]   the longest wait before a restart (30)
          [--nats-cluster 3]                three NATS nodes, the event stream at R3
          [--elastic --max-instances N]     the planner sizes the pools, `yb up` adds,
                                            drains and moves engines (at most N)
    yb status [--data-dir DIR | --nats URL]
    yb prepare [--model SOURCE]     convert and cache the model (setup.sh runs it)

    yb replay [--file LOG] [--export LOG] [--policy P --set k=v]   the conductor's decisions
    yb replay ... --report out.html [--last N | --since S --for S]  a timeline of decisions
    yb explain REQUEST_ID [--file LOG] [--full]                   why one decision
    yb profile [--quick] [--out FILE]                             fit the cost model here

    yb sim --trace FILE --policy P[,P...] [--admission A[,A...]] --json OUT   simulate
    yb bench trace|shared-prefix [--json PATH] [--plot PATH]   real load via the gateway

Each command's `--help` says more.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from yb_core.config import ConfigError, YbConfig, load_config
from yb_tools.cli.supervision import ON_EXIT_CHOICES, RestartPolicy


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `yb` command."""
    parser = argparse.ArgumentParser(prog="yb", description="Yuebing: KVCache-centric serving")
    parser.add_argument("--config", help="config file (TOML, YAML or JSON); default $YB_CONFIG")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole cluster locally until Ctrl-C")
    up.add_argument("--port", type=int, help="gateway port (default 8000)")
    up.add_argument("--host", help="gateway interface (default 127.0.0.1)")
    up.add_argument("--data-dir", help="NATS store, logs, SSD tier and model cache go here")
    up.add_argument("--model", help="'default', 'tiny-random' or a local HF model directory")
    up.add_argument("--model-name", help="the name clients ask for")
    add_device_arguments(up)
    up.add_argument("--prefill", type=int, default=2, help="prefill instances (default 2)")
    up.add_argument(
        "--prefill-groups",
        type=_group_sizes,
        default=(),
        metavar="N[,N...]",
        help="prefill groups beside the --prefill instances, one of N pipeline stages "
        "per entry (chunked pipeline parallelism: each stage holds 1/N of the layers)",
    )
    up.add_argument(
        "--prefill-tp",
        type=_degree,
        metavar="N",
        help="tensor-parallel degree of each prefill instance: N ranks (devices) each "
        "(prefill.tensor_parallel; default model.tensor_parallel, 1)",
    )
    up.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    up.add_argument(
        "--decode-tp",
        type=_degree,
        metavar="N",
        help="tensor-parallel degree of each decode instance (decode.tensor_parallel)",
    )
    up.add_argument(
        "--gpus",
        type=_gpu_list,
        metavar="all|I[,I...]",
        help="the GPUs the engines may use, by nvidia-smi's index (default all): each "
        "engine instance gets its own, as many as its tensor-parallel degree "
        "(CUDA_VISIBLE_DEVICES per instance)",
    )
    up.add_argument("--kvstore", type=int, default=2, help="kvstore instances (default 2)")
    up.add_argument(
        "--piggyback",
        action="store_true",
        help="decode instances take short prompts into their batch when the conductor "
        "predicts that faster (decode.piggyback)",
    )
    up.add_argument(
        "--conductors", type=int, default=1, help="conductors: one active, the rest standby"
    )
    up.add_argument(
        "--on-exit",
        choices=ON_EXIT_CHOICES,
        default="restart",
        help="when a process exits: restart it with a growing back-off, giving up on one "
        "that keeps dying at start (restart, the default); leave it down and keep the rest "
        "up (keep-going); or stop the whole cluster (stop)",
    )
    up.add_argument(
        "--restart-max-backoff",
        type=float,
        default=RestartPolicy.max_backoff_s,
        metavar="SECONDS",
        help="the longest wait before a restart (the wait doubles from 1 s with each "
        f"exit in a row; default {RestartPolicy.max_backoff_s:g})",
    )
    up.add_argument(
        "--keep-going",
        dest="on_exit",
        action="store_const",
        const="keep-going",
        help="the same as --on-exit keep-going",
    )
    up.add_argument("--nats-port", type=int, help="NATS client port (default 4222; 0: any free)")
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="N nats-server nodes in one JetStream cluster (3: the event stream at R3); "
        "node i listens on the NATS port + i",
    )
    up.add_argument(
        "--elastic",
        action="store_true",
        help="turn the conductor's planner on and carry out its decisions: add, drain "
        "and move engine instances while the cluster runs, starting from --prefill and "
        "--decode (needs --max-instances; docs/elastic.md)",
    )
    up.add_argument(
        "--max-instances",
        type=int,
        metavar="N",
        help="with --elastic: the most engine instances (prefill and decode, starting "
        "and draining ones included) at once (conductor.planner_max_instances)",
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait")

    status = sub.add_parser("status", help="instances, roles, loads and cache use")
    status.add_argument("--data-dir", help="data directory of a running `yb up`")
    status.add_argument("--nats", help="NATS URL (default: the running `yb up`'s)")

    prepare = sub.add_parser("prepare", help="convert and cache the model once")
    prepare.add_argument("--model", help="'default' or a local HF model directory")
    prepare.add_argument("--data-dir", help="cache the model under DIR/models")

    # The conductor's tools: thin front ends, importing the conductor only when run.
    from yb_tools.cli import bench, explain, profile, replay, sim

    replay.add_parser(sub)
    explain.add_parser(sub)
    profile.add_parser(sub)
    sim.add_parser(sub)
    bench.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"yb: {exc}", file=sys.stderr)
        return 2
    match args.command:
        case "up":
            return _up(cfg, args)
        case "status":
            return _status(cfg, args)
        case "prepare":
            return _prepare(cfg)
        case "replay":
            return replay.run(cfg, args)
        case "explain":
            return explain.run(cfg, args)
        case "profile":
            return profile.run(cfg, args)
        case "sim":
            return sim.run(cfg, args)
        case "bench":
            return bench.run(cfg, args)
    return 2


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--dtype` and `--kv-dtype`: `model.device`, `model.dtype` and
    `model.kv_dtype` for the engines."""
    parser.add_argument(
        "--device",
        help="where engines run the model: auto (CUDA when torch sees it), cpu, cuda, cuda:N",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' and KV's dtype (auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=["auto", "fp8_e4m3"],
        help="the KV cache's, transfers' and pool's dtype (auto: --dtype; fp8_e4m3: "
        "8 bits with a scale per token and head, half of bfloat16's bytes)",
    )


def _prepare(cfg: YbConfig) -> int:
    from yb_engine.prepare import prepare_model

    prepare_model(cfg, lambda line: print(f"[yb] {line}", flush=True))
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "data_dir", None):
        out["data_dir"] = args.data_dir
    gateway: dict[str, Any] = {}
    if getattr(args, "port", None):
        gateway["port"] = args.port
    if getattr(args, "host", None):
        gateway["host"] = args.host
    if gateway:
        out["gateway"] = gateway
    model: dict[str, Any] = {}
    if getattr(args, "model", None):
        model["source"] = args.model
    if getattr(args, "model_name", None):
        model["name"] = args.model_name
    for key in ("device", "dtype", "kv_dtype"):
        if getattr(args, key, None):
            model[key] = getattr(args, key)
    if model:
        out["model"] = model
    if getattr(args, "piggyback", False) and args.command == "up":
        out["decode"] = {"piggyback": True}
    for role in ("prefill", "decode"):
        if (degree := getattr(args, f"{role}_tp", None)) is not None:
            out.setdefault(role, {})["tensor_parallel"] = degree
    if getattr(args, "nats_port", None) is not None and args.command == "up":
        out["nats"] = {"url": f"nats://127.0.0.1:{args.nats_port}"}
    if getattr(args, "elastic", False) and args.max_instances is not None:
        # Every service gets it (`service_env`); the conductor's planner acts on it.
        out["conductor"] = {"planner": True, "planner_max_instances": args.max_instances}
    return out


def _degree(text: str) -> int:
    """`--prefill-tp` / `--decode-tp`: a tensor-parallel degree, 1 or more."""
    try:
        degree = int(text)
    except ValueError:
        degree = 0
    if degree < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a degree is a whole number, 1 or more")
    return degree


def _gpu_list(text: str) -> list[int] | None:
    """`--gpus`: `all`, or GPU indices."""
    from yb_tools.placement import parse_gpus

    try:
        return parse_gpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _group_sizes(text: str) -> tuple[int, ...]:
    """`--prefill-groups`: stage counts, comma-separated, each 2 or more."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: stage counts like 2 or 2,4") from None
    if any(size < 2 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: a group has 2 or more stages")
    return sizes


def _up(cfg: YbConfig, args: argparse.Namespace) -> int:
    from yb_tools.cli.elastic import ElasticPools, refusal
    from yb_tools.cli.launcher import Cluster, ModelNotPrepared, Topology

    def say(line: str) -> None:
        print(f"[yb] {line}", flush=True)

    refused = refusal(
        elastic=args.elastic,
        max_instances=args.max_instances,
        engines=args.prefill + args.decode,
        prefill_groups=args.prefill_groups,
        gpus=args.gpus,
    )
    if refused:
        print(f"yb up: {refused}", file=sys.stderr)
        return 2

    topology = Topology(
        args.prefill,
        args.decode,
        args.kvstore,
        args.conductors,
        nats=args.nats_cluster,
        prefill_groups=args.prefill_groups,
    )
    try:
        policy = RestartPolicy(max_backoff_s=args.restart_max_backoff)
    except ValueError as exc:
        print(f"yb up: --restart-max-backoff: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(cfg, topology, say, gpus=args.gpus)
    if args.elastic:
        cluster.max_engines = args.max_instances
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        say(f"{signal.Signals(signum).name}: stopping the cluster ...")

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    from yb_engine.models import DeviceUnavailable

    try:
        cluster.check_device()
    except DeviceUnavailable as exc:
        print(f"yb up: {exc}", file=sys.stderr)
        return 2
    if args.elastic and cluster.devices:
        print(
            "yb up: engines placed on GPUs of their own are not supported with --elastic "
            "yet (an added engine would get none); use --device cpu or cuda:N",
            file=sys.stderr,
        )
        return 2
    code = 0
    try:
        say(f"data directory: {cluster.data_dir}")
        try:
            cluster.prepare_model()
        except ModelNotPrepared as exc:
            if stopping:
                return 130
            print(f"yb up: {exc}", file=sys.stderr)
            return 2 if exc.unsupported else 1
        if stopping:
            return 130
        cluster.start_nats()
        cluster.start_services()
        supervisor = cluster.supervisor(args.on_exit, policy)

        def check(ready: bool) -> str | None:
            failure = supervisor.tick(ready=ready)
            cluster.record_supervision(supervisor)
            return failure

        if not cluster.wait_ready(args.ready_timeout, lambda: stopping, lambda: check(False)):
            if not stopping:
                say("the cluster did not become ready; see the logs above")
                code = 1
        else:
            cluster.mark_ready()
            say(f"ready: {cluster.gateway_url}/v1  (OpenAI-compatible; Ctrl-C stops)")
            for line in cluster.access_hint():
                say(line)
            kv_reported = False
            pools = ElasticPools(cluster, supervisor, say) if args.elastic else None
            if pools is not None:
                say(
                    f"elastic: the planner sizes the pools, up to {args.max_instances} "
                    "engine instances; its decisions are carried out here"
                )
            while not stopping:
                if failure := check(True):
                    say(f"{failure}: stopping the cluster")
                    code = 1
                    break
                if pools is not None:
                    pools.tick()
                # Once every engine has announced what it took.
                if not kv_reported and (report := cluster.kv_report()):
                    for line in report:
                        say(line)
                    kv_reported = True
                time.sleep(0.5)
    finally:
        cluster.stop()
        say("stopped")
    return code


def _status(cfg: YbConfig, args: argparse.Namespace) -> int:
    from yb_core.bus import Bus, BusError
    from yb_core.credentials import cli_nats_config
    from yb_tools.cli.launcher import read_cluster_info
    from yb_tools.cli.status import collect, render

    url = args.nats
    if not url:
        info = read_cluster_info(cfg.resolved_data_dir())
        url = info.nats_url if info else cfg.nats.url
    cfg.nats = cli_nats_config(cfg, url)

    async def run() -> str:
        bus = await Bus.connect(cfg.nats, "yb-status", timeout_s=3.0)
        try:
            rows = await collect(bus)
        finally:
            await bus.close()
        return render(rows, cfg.conductor.heartbeat_timeout_s, time.time())

    try:
        print(asyncio.run(run()))
    except BusError as exc:  # unreachable, or no instance stream yet
        print(f"yb status: {exc} (is `yb up` running?)", file=sys.stderr)
        return 1
    return 0
