"""`python -m yb_tools.compose_actuator`: the planner's actuator for Docker Compose.

    python -m yb_tools.compose_actuator [--project P] [--max-instances N]
                                        [--drain-grace-s S] [--socket PATH]

Its settings are the services' (`YB_*`, `load_config`): NATS (as the operator's
`admin` user), `conductor.planner_max_instances` and `planner_start_timeout_s`. The
project is the compose project of the container it runs in (its labels, asked of
Docker), unless `--project` names one. Exits 2 on settings it cannot run with, 1 when
Docker or the log fails it (compose restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from yb_core.config import ConfigError, load_config
from yb_tools.compose_actuator.actuator import ActuatorSettings, ComposeActuator
from yb_tools.compose_actuator.clone import PROJECT_LABEL
from yb_tools.compose_actuator.docker_api import DEFAULT_SOCKET, DockerApi, DockerError

#: The file the container's health check reads the age of.
ALIVE_FILE = Path("/tmp/planner-actuator.alive")


def say(line: str) -> None:
    print(line, flush=True)


async def own_project(docker: DockerApi) -> str:
    """The compose project of the container this process runs in (its hostname is its
    short id, unless the compose file set another)."""
    info = await docker.inspect(socket.gethostname())
    project = info.labels.get(PROJECT_LABEL)
    if not project:
        raise DockerError("read this container's compose project", None, "it has no label")
    return project


async def serve(args: argparse.Namespace) -> int:
    cfg = load_config(env=dict(os.environ))
    docker = DockerApi(args.socket)
    try:
        project = args.project or await own_project(docker)
        settings = ActuatorSettings(
            project=project,
            max_instances=args.max_instances or cfg.conductor.planner_max_instances,
            start_timeout_s=cfg.conductor.planner_start_timeout_s,
            drain_grace_s=args.drain_grace_s,
            alive_file=args.alive_file,
        )
        if settings.max_instances < 2:
            say("planner-actuator: --max-instances or planner_max_instances must be 2 or more")
            return 2
        actuator = ComposeActuator(docker, settings, say)
        try:
            await actuator.prepare()
        except ValueError as exc:  # more engine containers than the budget
            say(f"planner-actuator: {exc} (--max-instances)")
            return 2
        runner = asyncio.create_task(actuator.run(cfg.nats), name="planner-actuator")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        halt = asyncio.create_task(stop.wait(), name="planner-actuator-stop")
        try:
            await asyncio.wait({runner, halt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (runner, halt):
                task.cancel()
            await asyncio.gather(runner, halt, return_exceptions=True)
        error = runner.exception() if runner.done() and not runner.cancelled() else None
        if error is not None:
            raise error
        say("planner-actuator: stopped")
        return 0
    except DockerError as exc:
        say(f"planner-actuator: {exc}")
        return 1
    finally:
        with contextlib.suppress(Exception):
            await docker.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m yb_tools.compose_actuator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--project", help="the compose project (default: this container's)")
    parser.add_argument(
        "--max-instances",
        type=int,
        default=0,
        help="the most engine containers at once (default conductor.planner_max_instances)",
    )
    parser.add_argument(
        "--drain-grace-s",
        type=int,
        default=30,
        help="stop grace of a container that sets none (compose's stop_grace_period does)",
    )
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the Docker daemon's socket")
    parser.add_argument("--alive-file", type=Path, default=ALIVE_FILE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        return asyncio.run(serve(args))
    except ConfigError as exc:
        say(f"planner-actuator: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
