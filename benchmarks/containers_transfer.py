"""KV transfer between Docker containers over UCX, against memcpy, two ways in one run.

    python benchmarks/containers_transfer.py --json PATH [--image yuebing-kvstore]
                                             [--sizes 16,64,256] [--repeat 5]

Runs benchmarks/transfer.py with the sender and the receiver placed three ways:

- `host`: two processes on this host, with this interpreter (no container): the
  baseline. UCX counts them as one node; the receiver reads the sender's pages with
  cross-memory attach (CMA).
- `tcp`: each in its own container of the kvstore image (which holds the data plane and
  nothing else) on a bridge network, as the compose files run the services. Separate
  PID and IPC namespaces make UCX count them as separate nodes, so the KV crosses the
  bridge over TCP.
- `cma`: the same two containers sharing the receiver's PID and IPC namespaces
  (`--pid`/`--ipc container:`) with `--cap-add SYS_PTRACE` on both (Docker's default
  seccomp profile refuses `process_vm_readv` without it): UCX counts them as one node
  again and reads the sender's pages with CMA, as on the host. (Without ptrace they
  would talk TCP: the data plane leaves UCX's shared-memory FIFOs out, see
  yb_dataplane.transport.ucx_env.)

Every sender also times `numpy.copyto` of the same bytes in its own container, in the
same run (`{variant}_memcpy_gbps_*`), and `{variant}_over_memcpy_*` divides the two.
`{variant}_rendezvous_transport` is the lane UCX reported (`UCX_PROTO_INFO`) for large
tagged messages: what actually carried the KV. Needs a Docker engine and the kvstore
image (`docker-compose build kvstore-0`, or `deploy/compose-smoke.sh`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[1]
VARIANTS: Final = ("host", "tcp", "cma")
#: Bounds on each docker call: starting a container, and one variant's whole run.
START_TIMEOUT_S: Final = 60.0
RUN_TIMEOUT_S: Final = 900.0
# What transfer.py writes that is worth keeping per variant (its `_best` figures and
# xxh3 are the same story as the host run's, on benchmarks/transfer.py's page section).
KEPT: Final = re.compile(r"(ucx_gbps_\d+mb(_contiguous)?|memcpy_gbps_\d+mb|sender_cpu_s_per_gb_.*)")


def docker(*args: str, timeout: float = START_TIMEOUT_S) -> str:
    """What the command printed, stdout then stderr; raises if it failed."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout + done.stderr


def rendezvous_transport(ucx_log: str) -> str:
    """The lane UCX_PROTO_INFO names for large tagged sends (e.g. `cma/memory`)."""
    lanes = []
    in_tag_table = False
    for line in ucx_log.splitlines():
        if "ucp_context" in line:
            in_tag_table = "tagged message by ucp_tag_send" in line
        elif in_tag_table and "rendezvous" in line:
            lanes.append(line.rstrip(" |").rsplit("|", 1)[-1].strip())
    return ",".join(sorted(set(lanes))) or "unknown"


class Receiver:
    """transfer.py's receiver in a container of its own; its stdin keeps it running."""

    def __init__(self, name: str, run_args: list[str], bench_args: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            ["docker", "run", "--rm", "-i", "--name", name, *run_args, *bench_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(
            target=lambda: lines.put(self.proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        ).start()
        try:
            self.address = lines.get(timeout=START_TIMEOUT_S).strip()
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"{name} printed no address within {START_TIMEOUT_S:.0f}s") from None
        if not self.address.startswith("ucx://"):
            err = self.stop()
            raise RuntimeError(f"{name} did not start: {self.address!r} {err[-2000:]}")

    def stop(self) -> str:
        """Close its stdin (it exits), or remove it; its stderr."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)
            self.proc.wait(timeout=30)
        return self.proc.stderr.read()


def run_variant(
    variant: str, image: str, sizes: str, repeat: int, out: Path, tag: str
) -> tuple[dict[str, Any], str]:
    """transfer.py's figures for one placement, and what its sender printed."""
    mounts = ["-v", f"{ROOT / 'benchmarks'}:/bench:ro", "-v", f"{out}:/out"]
    bench = ["--entrypoint", "python", image, "/bench/transfer.py", "--sizes", sizes]
    send = ["--repeat", str(repeat), "--no-perftest", "--json"]
    if variant == "host":
        local = [sys.executable, str(ROOT / "benchmarks" / "transfer.py"), "--sizes", sizes]
        done = subprocess.run(
            [*local, *send, str(out / f"{variant}.json")],
            # Printed by the sender's UCX when it first sends: which lane carries what.
            env={**os.environ, "UCX_PROTO_INFO": "y"},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=True,
        )
        return json.loads((out / f"{variant}.json").read_text()), done.stdout + done.stderr
    network = f"yb-bench-{tag}"
    rx_name = f"yb-bench-rx-{tag}"
    # The receiver's namespaces are made shareable and the sender joins them, or not.
    rx_extra: list[str] = []
    tx_extra: list[str] = []
    if variant != "tcp":
        rx_extra += ["--ipc", "shareable"]
        tx_extra += ["--pid", f"container:{rx_name}", "--ipc", f"container:{rx_name}"]
    if variant == "cma":
        rx_extra += ["--cap-add", "SYS_PTRACE"]
        tx_extra += ["--cap-add", "SYS_PTRACE"]
    receiver: Receiver | None = None
    docker("network", "create", network)
    try:
        receiver = Receiver(
            rx_name,
            ["--network", network, *rx_extra, *mounts],
            [*bench, "--role", "receiver", "--ucx-host", rx_name],
        )
        log = docker(
            "run",
            "--rm",
            "--network",
            network,
            *tx_extra,
            "-e",
            "UCX_PROTO_INFO=y",
            *mounts,
            *bench,
            *send,
            f"/out/{variant}.json",
            "--peer",
            receiver.address,
            timeout=RUN_TIMEOUT_S,
        )
    finally:
        if receiver is not None:
            receiver.stop()
        # `--rm` removes the receiver asynchronously; the network outlives it otherwise.
        subprocess.run(["docker", "rm", "-f", rx_name], capture_output=True, timeout=60)
        docker("network", "rm", network)
    return json.loads((out / f"{variant}.json").read_text()), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--image", default="yuebing-kvstore")
    parser.add_argument("--sizes", default="16,64,256", help="payload sizes, MiB")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if shutil.which("docker") is None:
        sys.exit("needs the docker CLI and a running Docker engine")
    try:
        docker("image", "inspect", args.image)
    except RuntimeError:
        sys.exit(f"no image {args.image!r}: build it first (docker-compose build kvstore-0)")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        out.chmod(0o777)  # the image runs as its own user
        for variant in VARIANTS:
            got, log = run_variant(
                variant, args.image, args.sizes, args.repeat, out, str(os.getpid())
            )
            figures[f"{variant}_rendezvous_transport"] = rendezvous_transport(log)
            for key, value in got.items():
                if KEPT.fullmatch(key):
                    figures[f"{variant}_{key}"] = value
            for mb in args.sizes.split(","):
                ucx, memcpy = got[f"ucx_gbps_{mb}mb"], got[f"memcpy_gbps_{mb}mb"]
                figures[f"{variant}_over_memcpy_{mb}mb"] = round(ucx / memcpy, 3)
    print(
        f"{'placement':<10} {'UCX lane':<12} {'payload':>8} {'ucx GB/s':>9} "
        f"{'adjacent':>9} {'memcpy GB/s':>12} {'ucx/memcpy':>11}"
    )
    for variant in VARIANTS:
        lane = figures[f"{variant}_rendezvous_transport"]
        for mb in args.sizes.split(","):
            print(
                f"{variant:<10} {lane:<12} {mb:>6}MB "
                f"{figures[f'{variant}_ucx_gbps_{mb}mb']:>9.2f} "
                f"{figures[f'{variant}_ucx_gbps_{mb}mb_contiguous']:>9.2f} "
                f"{figures[f'{variant}_memcpy_gbps_{mb}mb']:>12.2f} "
                f"{figures[f'{variant}_over_memcpy_{mb}mb']:>10.0%}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
