"""A live benchmark's cluster log, read back as `yb replay --export` writes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from yb_conductor.replay import LogRecord, read_log
from yb_testkit.fixtures import LocalCluster
from yb_tools.natsserver import env_without_proxies


def export_log(cluster: LocalCluster, path: Path) -> list[LogRecord]:
    """The cluster's log, as `yb replay --export` writes it to `path`, read back."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "yb_tools.cli", "replay"),
            *("--data-dir", str(cluster.data_dir), "--export", str(path)),
        ],
        env=env_without_proxies(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise SystemExit(f"yb replay --export failed: {done.stderr.strip()}")
    return read_log(path)
