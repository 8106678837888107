"""A real Prometheus for tests: the `prometheus` binary (Debian's package) on a free
loopback port, with its TSDB in a temporary directory.

`PrometheusServer.start()` returns once `/-/ready` answers; `query()` and the other
readers speak its HTTP API (`/api/v1/...`) and raise `PrometheusError` on an error
answer. `with_scrape_interval` copies a scrape config with a shorter interval, so a
test sees its samples within seconds. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from yb_tools.natsserver import die_with_parent, env_without_proxies, free_port


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its API answered with an error."""


def prometheus_binary() -> str | None:
    """The `prometheus` binary on PATH, None when it is not installed."""
    return shutil.which("prometheus")


def with_scrape_interval(config: Path, out: Path, interval: str) -> Path:
    """Copy the Prometheus config `config` to `out` with `interval` (a Prometheus
    duration, "1s") as its global scrape and evaluation interval, and as the refresh
    interval of every file_sd config; returns `out`. Everything else is kept."""
    data = yaml.safe_load(config.read_text())
    data.setdefault("global", {}).update(scrape_interval=interval, evaluation_interval=interval)
    for job in data.get("scrape_configs", []):
        job.pop("scrape_interval", None)
        for sd in job.get("file_sd_configs", []):
            sd["refresh_interval"] = interval
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@dataclass
class PrometheusServer:
    """One Prometheus process scraping what `config_file` says."""

    config_file: Path
    storage_dir: Path
    log_file: Path
    host: str = "127.0.0.1"
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """Base URL of its HTTP API and UI."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until it is ready; raises `PrometheusError` with its log
        when it exits or is not ready within `timeout_s`."""
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError("prometheus is not installed (Debian: apt install prometheus)")
        self.port = self.port or free_port(self.host)
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config_file}",
                    f"--storage.tsdb.path={self.storage_dir}",
                    f"--web.listen-address={self.host}:{self.port}",
                ],
                stdout=log,
                stderr=log,
                env=env_without_proxies(),
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise PrometheusError(
                        f"prometheus exited with {self.process.returncode}:\n{self.log()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/-/ready").status_code == 200:
                        return
                time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus not ready within {timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop it (SIGTERM, then SIGKILL past `timeout_s`); idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def log(self) -> str:
        """The end of what it logged."""
        try:
            return self.log_file.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def api(self, path: str, **params: Any) -> Any:
        """GET `/api/v1/<path>` and return its `data`; raises `PrometheusError` when
        the answer is not a success."""
        with httpx.Client(trust_env=False, timeout=10.0) as client:
            response = client.get(f"{self.url}/api/v1/{path}", params=params)
        try:
            body = response.json()
        except ValueError as exc:
            raise PrometheusError(f"{path}: HTTP {response.status_code}, not JSON") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to (at `at`, Unix seconds; default
        now): a list of `{"metric": labels, "value": [time, "text"]}`. A scalar
        comes back as one sample without labels."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        match data["resultType"]:
            case "vector":
                return list(data["result"])
            case "scalar" | "string":
                return [{"metric": {}, "value": data["result"]}]
            case other:
                raise PrometheusError(f"{expr}: a {other} where an instant vector was expected")

    def metric_names(self) -> set[str]:
        """Every metric name Prometheus holds series of."""
        return set(self.api("label/__name__/values"))

    def active_targets(self) -> list[dict[str, Any]]:
        """The targets it scrapes now, with their labels and health."""
        return list(self.api("targets", state="active")["activeTargets"])

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
