"""Prometheus files for a `yb up` cluster: which listeners to scrape, and how.

`yb up` keeps two files in `<data dir>/prometheus/`:

- `targets.json`, for Prometheus' file-based service discovery (`file_sd_configs`):
  one group per instance, its metrics listener's `host:port` as the target,
  labelled `role`, `instance` and `host`. The `instance` label replaces the
  address Prometheus would otherwise use, so series are named by instance id.
- `prometheus.yml`, a scrape config ready for `prometheus --config.file=...`: one
  job that reads the targets file and authenticates with the metrics token by file
  (`authorization.credentials_file`), so the token never appears in the config.

Where to scrape comes from the instances themselves: each announces its metrics
listener in `InstanceUp` (`metrics_address`; engines and stores bind any free port,
the gateway serves `/metrics` on its HTTP port). Which instances to scrape comes
from the launcher: only processes it started and that still run, and only an
announcement made after the process started, so an address left in the instance
stream by an earlier run of the same data directory is never scraped.
The launcher's `ClusterWatcher` (`yb_tools.cli.cluster_watch`) follows the instance
stream and the launcher's children, and rewrites the targets file whenever that set
changes; Prometheus reloads a file_sd file when it changes, and every write is atomic
(a rename), so it never reads half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from yb_core import events as ev

#: Directory under the data dir that holds the files.
PROMETHEUS_DIR = "prometheus"
TARGETS_FILE = "targets.json"
SCRAPE_CONFIG_FILE = "prometheus.yml"
#: The job every target of a `yb up` cluster belongs to (Prometheus' `job` label).
JOB_NAME = "yuebing"
#: How often the generated config scrapes: a local cluster is small, and a dashboard
#: over a minute of activity needs more than the one point per minute of the default.
DEFAULT_SCRAPE_INTERVAL_S = 5.0


@dataclass(frozen=True, order=True, slots=True)
class ScrapeTarget:
    """One metrics listener and the labels its series get."""

    instance: str
    role: str
    host: str
    address: str


def file_sd_groups(targets: Iterable[ScrapeTarget]) -> list[dict[str, Any]]:
    """The targets in file_sd's JSON form: one group per target, sorted by instance."""
    return [
        {
            "targets": [t.address],
            "labels": {"role": t.role, "instance": t.instance, "host": t.host},
        }
        for t in sorted(targets)
    ]


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` in one rename, created with `mode`, so a reader (a
    Prometheus re-reading its file_sd file) sees the old file or the new one, never
    a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_file_sd(path: Path, targets: Iterable[ScrapeTarget]) -> None:
    """Write the file_sd file for `targets` (an empty list when none)."""
    text = json.dumps(file_sd_groups(targets), indent=2) + "\n"
    write_atomically(path, text.encode())


def read_file_sd(path: Path) -> list[ScrapeTarget]:
    """The targets of a file `write_file_sd` wrote (for tools and tests)."""
    groups = json.loads(path.read_text())
    return sorted(
        ScrapeTarget(
            instance=group["labels"]["instance"],
            role=group["labels"]["role"],
            host=group["labels"]["host"],
            address=address,
        )
        for group in groups
        for address in group["targets"]
    )


def scrape_config(
    targets_file: Path,
    token_file: Path,
    *,
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
    job: str = JOB_NAME,
) -> dict[str, Any]:
    """A Prometheus configuration that scrapes the targets of `targets_file` at
    `/metrics` with the Bearer token read from `token_file` (Prometheus reads the
    file at every scrape and trims its whitespace, so the file may end in a newline)."""
    interval = _duration(scrape_interval_s)
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": interval}],
            }
        ],
    }


def write_scrape_config(path: Path, config: Mapping[str, Any], header: str = "") -> None:
    """Write `config` as YAML, after `header` (comment lines)."""
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    body = yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)
    write_atomically(path, (comment + body).encode())


def _duration(seconds: float) -> str:
    """Seconds as a Prometheus duration ("5s", "500ms")."""
    if seconds <= 0:
        raise ValueError(f"a scrape interval must be positive, got {seconds}")
    millis = round(seconds * 1000)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


class TargetFold:
    """Which announced instances have a metrics listener, folded from instance events.

    Pure data: `apply` takes `InstanceUp` and `InstanceDown` in log order, `targets`
    picks those to scrape given the processes running now.
    """

    def __init__(self) -> None:
        # instance id -> (its target, when it announced it: the publisher's clock)
        self._announced: dict[str, tuple[ScrapeTarget, float]] = {}

    def apply(self, event: ev.AnyEvent) -> None:
        """Fold one instance event (other events are ignored)."""
        match event:
            case ev.InstanceUp() if event.metrics_address:
                target = ScrapeTarget(
                    instance=event.instance_id,
                    role=event.role,
                    host=event.host,
                    address=event.metrics_address,
                )
                self._announced[event.instance_id] = (target, event.time)
            case ev.InstanceUp() | ev.InstanceDown():
                self._announced.pop(event.instance_id, None)
            case _:
                pass

    def targets(self, running: Mapping[str, float]) -> list[ScrapeTarget]:
        """The announced targets whose process runs now (`running`: instance id ->
        when its process started, wall clock) and announced itself since then."""
        return sorted(
            target
            for instance, (target, announced_at) in self._announced.items()
            if instance in running and announced_at >= running[instance]
        )
