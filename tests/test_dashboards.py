"""The Grafana dashboards against a real Prometheus scraping a real `yb up`.

A real `yb up` (tiny model) runs; a real Prometheus (the `prometheus` binary,
Debian's package) scrapes it with the files `yb up` wrote (its scrape config, copied
with a 1 s interval, and the file_sd targets file it keeps current), while `yb bench
shared-prefix` sends a short load twice (the second run meets the prefixes the first
left, so reuse happens). Then, for every target of every panel of
deploy/grafana/dashboards/*.json:

- every metric the query names must be a series Prometheus scraped from some
  service (a panel naming a metric no service exports fails, with its title);
- the query, with Grafana's `$__rate_interval` replaced by a window that covers the
  load, must return at least one finite sample (waited for, with a deadline).

Refusal panels read counters every service exports at 0 for each known reason from
its start: a rate of 0 is their true value under a load nothing refused, so no
refusal is provoked. Without the `prometheus` binary these tests skip and say so.

Also checked, without a cluster: the dashboards are a valid Grafana model (unique
uids and panel ids, every panel with a query, every datasource the provisioned one)
and compose's Prometheus config scrapes exactly compose's services.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from yb_testkit.fixtures import LocalCluster
from yb_testkit.prometheus import PrometheusServer, prometheus_binary, with_scrape_interval
from yb_tools.cli.launcher import read_cluster_info
from yb_tools.cli.prometheus_files import read_file_sd

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
COMPOSE_PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
WAIT_S = 90.0  # every wait's deadline: generous, no outcome races it
SCRAPE_INTERVAL = "1s"

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="the prometheus binary is not installed (Debian: apt install prometheus)",
)


# --- the dashboards as data -----------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included, rows themselves left out."""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def _targets() -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, expr) of every panel target."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in _panels(dashboard):
            for target in panel.get("targets", []):
                out.append((dashboard["title"], panel["title"], target["expr"]))
    return out


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan", "Inf", "NaN"}


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not
    functions, aggregations, keywords, label names or parts of a number/duration."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors and subqueries
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":
            continue  # 1e-5, 5m
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group() not in _KEYWORDS:
            names.add(match.group())
    return names


def test_metric_names_in() -> None:
    """The extractor finds what a query selects and nothing else."""
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(yb_a_bucket{role="x"}[$__rate_interval])))'
        " / on (instance) group_left (role) max without (job) (up offset 5m) > 1e-5"
    )
    assert metric_names_in(expr) == {"yb_a_bucket", "up"}
    assert metric_names_in("sum(yb_b_total) or yb_c") == {"yb_b_total", "yb_c"}


def with_variables(expr: str, window_s: int) -> str:
    """`expr` with Grafana's variables replaced as Grafana would over a window of
    `window_s` seconds; raises on one it does not know."""
    out = expr.replace("$__rate_interval", f"{window_s}s").replace("$__range", f"{window_s}s")
    if "$" in out:
        raise AssertionError(f"a Grafana variable this test cannot substitute: {out}")
    return out


# --- the dashboards as a Grafana model, no cluster needed -----------------------------


def test_dashboards_are_a_valid_grafana_model() -> None:
    """Unique uids and panel ids, a layout and a query for every panel, and every
    datasource the one provisioned (by uid); the provisioner reads the directory
    compose mounts them at."""
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    provisioned = {ds["uid"] for ds in datasources if ds["type"] == "prometheus"}
    assert len(provisioned) == 1, datasources
    assert len(DASHBOARDS) >= 2, DASHBOARDS
    uids = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        title = dashboard.get("title")
        assert title and dashboard.get("uid"), path
        assert isinstance(dashboard.get("schemaVersion"), int), path
        uids.append(dashboard["uid"])
        ids = [p["id"] for p in dashboard["panels"]] + [
            p["id"] for row in dashboard["panels"] for p in row.get("panels", [])
        ]
        assert len(ids) == len(set(ids)), f"{title}: panel ids repeat: {ids}"
        for panel in _panels(dashboard):
            where = f"{title} / {panel.get('title')}"
            assert panel.get("title") and panel.get("type"), where
            assert {"h", "w", "x", "y"} <= set(panel.get("gridPos", {})), where
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
            targets = panel.get("targets", [])
            assert targets, f"{where}: no query"
            refs = [t.get("refId") for t in targets]
            assert all(refs) and len(refs) == len(set(refs)), f"{where}: refIds {refs}"
            for ref in [panel.get("datasource"), *(t.get("datasource") for t in targets)]:
                assert ref == {"type": "prometheus", "uid": next(iter(provisioned))}, where
            for target in targets:
                assert target.get("expr", "").strip(), f"{where}: empty query"
                assert metric_names_in(target["expr"]), f"{where}: selects no metric"
                assert "vector(" not in target["expr"], f"{where}: made-up data"
    assert len(uids) == len(set(uids)), f"dashboard uids repeat: {uids}"

    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "yuebing.yml").read_text()
    )["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(
        volume.split(":")[:2]
        for volume in compose["services"]["grafana"]["volumes"]
        if volume.startswith("./")
    )
    assert [p["options"]["path"] for p in providers] == [mounts["./deploy/grafana/dashboards"]]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_prometheus_scrapes_every_compose_service(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml names every compose service that serves
    metrics, at its metrics port, with the labels `yb up`'s targets carry, reads the
    token from the file compose's prometheus service writes; promtool accepts it."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    expected = {}
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if "--instance-id" not in command:
            continue
        env = service["environment"]
        role = service["image"].removeprefix("yuebing-")
        port = env["YB_GATEWAY__PORT"] if role == "gateway" else env["YB_TELEMETRY__METRICS_PORT"]
        instance = command[command.index("--instance-id") + 1]
        expected[f"{name}:{port}"] = {"role": role, "instance": instance, "host": env["YB_HOST"]}
    config = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    found = {
        target: group["labels"] for group in job["static_configs"] for target in group["targets"]
    }
    assert found == expected
    token_file = job["authorization"]["credentials_file"]
    command = " ".join(compose["services"]["prometheus"]["command"])
    assert f"> {token_file}" in command, command

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (it comes with Debian's prometheus)")
    job["authorization"]["credentials_file"] = str(tmp_path / "token")
    (tmp_path / "token").write_text("x\n")
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool, "check", "config", str(checked)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- against a cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if prometheus_binary() is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt install prometheus)")
    data = tmp_path_factory.mktemp("dashboards")
    # --keep-going: the last check stops one instance on purpose.
    cluster = LocalCluster(data, "--model", "tiny-random", "--keep-going")
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def prometheus(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    info = read_cluster_info(cluster.data_dir)
    assert info is not None and info.prometheus_config, "yb up wrote no Prometheus config"
    work = tmp_path_factory.mktemp("prometheus")
    config = with_scrape_interval(
        Path(info.prometheus_config), work / "prometheus.yml", SCRAPE_INTERVAL
    )
    server = PrometheusServer(config, work / "tsdb", work / "prometheus.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _bench(cluster: LocalCluster, out: Path) -> dict[str, Any]:
    """A short shared-prefix load through the gateway with `yb bench`; its figures."""
    args = [
        *("bench", "shared-prefix", "--data-dir", str(cluster.data_dir)),
        *("--groups", "2", "--users", "3", "--prefix-tokens", "128"),
        *("--question-tokens", "8", "--output-tokens", "8", "--concurrency", "3"),
        *("--request-timeout", "60", "--seed", "3", "--json", str(out)),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "yb_tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def _wait_for_targets(prometheus: PrometheusServer, instances: set[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    healthy: set[str] = set()
    while time.monotonic() < deadline:
        targets = prometheus.active_targets()
        healthy = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
        if healthy == instances:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus scrapes {healthy}, not {instances}:\n{prometheus.log()}")


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


@needs_prometheus
def test_every_panel_has_data(
    cluster: LocalCluster, prometheus: PrometheusServer, tmp_path: Path
) -> None:
    """Every panel's metrics are exported, and every query returns data under load."""
    info = read_cluster_info(cluster.data_dir)
    assert info is not None
    instances = {name for name in info.pids if not name.startswith("nats-server")}
    announced = read_file_sd(Path(info.prometheus_targets))
    assert {t.instance for t in announced} == instances
    assert {t.instance: t.role for t in announced} == {
        name: name.rsplit("-", 1)[0] for name in instances
    }
    _wait_for_targets(prometheus, instances)

    load_started = time.time()
    for run in range(2):
        figures = _bench(cluster, tmp_path / f"bench-{run}.json")
        assert figures["requests_ok"] == figures["requests_planned"] > 0, figures

    targets = _targets()
    assert targets
    # Both checks wait for the scrapes that follow the load, with a deadline.
    unknown: list[str] = []
    pending = list(targets)
    last: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        exported = prometheus.metric_names()
        unknown = [
            f"{dashboard} / {panel}: {name}"
            for dashboard, panel, expr in targets
            for name in sorted(metric_names_in(expr))
            if name not in exported
        ]
        window = math.ceil(time.time() - load_started) + 5
        still = []
        for target in pending:
            result = prometheus.query(with_variables(target[2], window))
            last[target] = result
            if not _finite(result):
                still.append(target)
        pending = still
        if not (unknown or pending):
            break
        time.sleep(1.0)
    assert not unknown, "panels name metrics no service exports:\n" + "\n".join(unknown)
    assert not pending, "panels without data:\n" + "\n".join(
        f"{dashboard} / {panel}: {expr} -> {last.get((dashboard, panel, expr))}"
        for dashboard, panel, expr in pending
    )
    # The liveness panel: every engine and kvstore alive, and nothing else on it (a
    # gateway or conductor sends no heartbeat, so the fold's view of it means nothing).
    alive = {
        sample["metric"]["exported_instance"]: float(sample["value"][1])
        for sample in prometheus.query("yb_conductor_instance_alive")
    }
    engines = {name for name in instances if not name.startswith(("gateway", "conductor"))}
    assert alive == dict.fromkeys(engines, 1.0), alive


@needs_prometheus
def test_targets_follow_instances(cluster: LocalCluster, prometheus: PrometheusServer) -> None:
    """An instance that stops leaves the targets file, and Prometheus stops scraping it."""
    info = read_cluster_info(cluster.data_dir)
    assert info is not None
    victim = "kvstore-1"
    targets_file = Path(info.prometheus_targets)
    assert victim in {t.instance for t in read_file_sd(targets_file)}

    os.kill(info.pids[victim], signal.SIGTERM)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if victim not in {t.instance for t in read_file_sd(targets_file)}:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{victim} stopped but is still in {targets_file}")
    while time.monotonic() < deadline:
        if victim not in {t["labels"]["instance"] for t in prometheus.active_targets()}:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus still scrapes {victim}")
