"""docker-compose.yml from `up --build` to ready, cold and warm; first chat; memory.

    python benchmarks/compose.py --json PATH [--keep-images]

Run from a checkout set up with ./setup.sh, on a machine with a Docker engine (root).
deploy/compose-env.sh chooses the compose command, the base image and torch's index, as
for deploy/compose-smoke.sh. In order:

1. **Cold:** the project's images and Docker's build cache are removed (the base image
   is kept: it stands for `python:3.11-slim` already pulled), then `up -d --build` is
   timed until every service with a health check is healthy (the gateway's is
   /readyz: a request can be served). `--keep-images` skips the removal (then "cold"
   is not).
2. **First chat:** one streamed chat through the official `openai` client, timed to its
   first text and to its end.
3. **Idle memory:** every container's memory (`docker stats`), once the chat ended and
   `--settle` seconds passed.
4. **Under load:** `yb bench shared-prefix` against the gateway (2 groups of 6 users on
   a 1,024-token prefix, 4 in flight), every container's memory sampled meanwhile; the
   peak of each is kept.
5. **Warm:** `down -v` (volumes too: the model is converted again), then `up -d --build`
   timed again, the images and the build cache left in place.

Memory is what `docker stats` reports (the cgroup's usage less its inactive file
cache), in MB. The project is left down (`down -v`) whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))

import compose_checks  # noqa: E402  (the smoke's client side: key, client, docker)
from compose_checks import docker  # noqa: E402

PROJECT: Final = "ybbench"
IMAGES: Final = tuple(
    f"yuebing-{name}" for name in ("nats", "conductor", "gateway", "kvstore", "prefill", "decode")
)
READY_DEADLINE_S: Final = 1800.0  # a cold build installs torch and every dependency
BENCH_DEADLINE_S: Final = 600.0
UNITS: Final = {"B": 1e-6, "KiB": 1024e-6, "MiB": 1.048576, "GiB": 1073.741824}


def compose_env() -> tuple[list[str], dict[str, str]]:
    """The compose command and the environment deploy/compose-env.sh prints."""
    script = ROOT / "deploy" / "compose-env.sh"
    shell = f'eval "$({shlex.quote(str(script))})" && env -0'
    done = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        sys.exit(f"deploy/compose-env.sh failed: {done.stderr[-2000:]}")
    env = dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)
    return json.loads(env["YB_COMPOSE"]), env


class Compose:
    def __init__(self) -> None:
        self.command, self.env = compose_env()

    def run(self, *args: str, timeout: float = 120.0) -> str:
        cmd = [*self.command, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), *args]
        done = subprocess.run(
            cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {(done.stdout + done.stderr)[-3000:]}")
        return done.stdout

    def checked_services(self) -> set[str]:
        """The services with a health check (model-init runs once and exits)."""
        config = self.run("config")
        services: set[str] = set()
        current = None
        for line in config.splitlines():
            if re.fullmatch(r"  [a-z0-9-]+:", line):
                current = line.strip(" :")
            elif current and line.startswith("    healthcheck:"):
                services.add(current)
        return services


def containers() -> dict[str, tuple[str, str]]:
    """Running containers of the project: id -> (service, status)."""
    out = docker(
        "ps",
        "--filter",
        f"label=com.docker.compose.project={PROJECT}",
        "--format",
        '{{.ID}}\t{{.Label "com.docker.compose.service"}}\t{{.Status}}',
    )
    rows = [line.split("\t") for line in out.splitlines() if line]
    return {cid: (service, status) for cid, service, status in rows}


def wait_ready(services: set[str], started: float) -> float:
    """Seconds from `started` until every one of `services` is healthy."""
    while True:
        healthy = {s for s, status in containers().values() if "(healthy)" in status}
        if services <= healthy:
            return time.monotonic() - started
        if time.monotonic() - started > READY_DEADLINE_S:
            raise RuntimeError(f"not healthy after {READY_DEADLINE_S:.0f}s: {services - healthy}")
        time.sleep(1.0)


def memory_mb() -> dict[str, float]:
    """Every running container's memory, MB, by service."""
    by_id = containers()
    if not by_id:
        return {}
    out = docker("stats", "--no-stream", "--format", "{{.ID}}\t{{.MemUsage}}", *by_id)
    usage: dict[str, float] = {}
    for line in out.splitlines():
        cid, mem = line.split("\t")
        used = re.fullmatch(r"([\d.]+)\s*([KMG]?i?B)", mem.split("/")[0].strip())
        if used is None:
            raise RuntimeError(f"docker stats: unreadable memory {mem!r}")
        usage[by_id[cid][0]] = round(float(used[1]) * UNITS[used[2]], 1)
    return usage


def first_chat() -> tuple[float, float]:
    """(seconds to the first text, seconds to the end) of one streamed chat."""
    _, first, total = compose_checks.streamed_chat(
        compose_checks.client(), "What is the capital of France?", max_tokens=32
    )
    return first, total


def bench_under_watch(out: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """`yb bench shared-prefix`'s figures, and each service's peak memory meanwhile."""
    yb = Path(sys.executable).with_name("yb")
    cmd = [
        str(yb), "bench", "shared-prefix", "--url", "http://127.0.0.1:8000",
        "--api-key", compose_checks.api_key(), "--groups", "2", "--users", "6",
        "--prefix-tokens", "1024", "--question-tokens", "32", "--output-tokens", "32",
        "--concurrency", "4", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    peaks: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for service, mb in memory_mb().items():
                peaks[service] = max(mb, peaks.get(service, 0.0))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        subprocess.run(cmd, check=True, timeout=BENCH_DEADLINE_S, stdout=subprocess.DEVNULL)
    finally:
        stop.set()
        watcher.join(timeout=60)
    return json.loads(out.read_text()), peaks


def up_to_ready(compose: Compose, services: set[str]) -> float:
    started = time.monotonic()
    compose.run("up", "-d", "--build", timeout=READY_DEADLINE_S)
    return wait_ready(services, started)


def measure(compose: Compose, keep_images: bool, settle_s: float, tmp: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {"compose": " ".join(compose.command)}
    services = compose.checked_services()
    compose.run("down", "-v", "--remove-orphans")
    if not keep_images:
        present = [image for image in IMAGES if docker("images", "-q", image)]
        if present:
            docker("rmi", "-f", *present)
        docker("builder", "prune", "-af")
    figures["cold"] = not keep_images
    figures["up_to_ready_cold_s"] = round(up_to_ready(compose, services), 1)
    ttft, total = first_chat()
    figures["first_chat_ttft_s"] = round(ttft, 3)
    figures["first_chat_total_s"] = round(total, 3)
    time.sleep(settle_s)
    for service, mb in sorted(memory_mb().items()):
        figures[f"memory_mb_idle_{service}"] = mb
    bench, peaks = bench_under_watch(tmp / "bench.json")
    for key in ("requests_ok", "requests_failed", "duration_s"):
        value = bench.get(key)
        figures[f"load_{key}"] = round(value, 1) if isinstance(value, float) else value
    for service, mb in sorted(peaks.items()):
        figures[f"memory_mb_load_peak_{service}"] = mb
    compose.run("down", "-v", "--remove-orphans")
    figures["up_to_ready_warm_s"] = round(up_to_ready(compose, services), 1)
    for image in IMAGES:
        size = docker("image", "inspect", "-f", "{{.Size}}", image)
        figures[f"image_mb_{image.removeprefix('yuebing-')}"] = round(int(size) / 1e6)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep-images", action="store_true", help="no cold start")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds before idle memory")
    args = parser.parse_args()
    compose = Compose()
    env_made = not (ROOT / ".env").exists()
    if env_made:
        subprocess.run([str(ROOT / "deploy" / "make-env.sh")], check=True, capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            figures = measure(compose, args.keep_images, args.settle, Path(tmp))
    except Exception:
        print(f"the project's containers when it failed:\n{compose_checks.describe(PROJECT)}")
        raise
    finally:
        try:
            compose.run("down", "-v", "--remove-orphans")
        finally:
            if env_made:
                os.unlink(ROOT / ".env")
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
