"""Regenerates docs/debugging.md's pictures and prints the command outputs it quotes.

    .venv/bin/python docs/debugging.py [--work /tmp/yb-debugging] [--ttft-slo 0.2]

Everything is real: `yb profile --quick` fits a cost model for the tiny model on
this machine; a real `yb up` (the tiny-random model, `gateway.ttft_slo_s` set tight
through YB_GATEWAY__TTFT_SLO_S) runs with the conductor's default cost model, which
was fitted for the default model; Debian's `prometheus` scrapes it every second
with the config `yb up` wrote; `yb bench` sends a burst of long prompts, then a
stretch of Mooncake's trace. Then, in Debian's headless chromium:

- docs/images/debugging-rejections.png and debugging-ttft-ratio.png: the queries of
  the Cluster overview's "Rejections by reason" panel and of the Conductor
  dashboard's "TTFT: actual over estimate" panel (read from deploy/grafana, with
  Grafana's `$__rate_interval` replaced), drawn by Prometheus' own graph page
  (Grafana is not installed here);
- docs/images/debugging-timeline.png: `yb replay --report` of the log, with the
  first refused request's decision open.

It prints `yb explain` of that request and `yb replay --set` what-if tables, then
starts the cluster again with the fitted cost model (YB_CONDUCTOR__COST_MODEL) and
sends the same load. The work directory is emptied first and kept afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
WAIT_S = 120.0  # every wait's deadline
RATE_WINDOW = "10s"  # for $__rate_interval: ten scrapes at the 1 s scrape interval
MAX_PNG_BYTES = 300_000

from yb_testkit.browser import Browser, Page, find_chromium  # noqa: E402
from yb_testkit.fixtures import LocalCluster  # noqa: E402
from yb_testkit.prometheus import (  # noqa: E402
    PrometheusServer,
    prometheus_binary,
    with_scrape_interval,
)
from yb_tools.cli.launcher import read_cluster_info  # noqa: E402


def yb(*args: str, check: bool = True) -> str:
    """Run `yb ARGS`, print the command and its output, return the output."""
    print(f"\n$ yb {' '.join(args)}", flush=True)
    result = subprocess.run(
        [sys.executable, "-m", "yb_tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S * 3,
    )
    out = result.stdout + result.stderr
    print(out.rstrip(), flush=True)
    if check and result.returncode != 0:
        raise SystemExit(f"yb {args[0]} exited with {result.returncode}")
    return out


def load(data_dir: Path, work: Path, label: str, ttft_slo: float) -> list[dict[str, Any]]:
    """The same two loads for every cluster: a burst of 12 prompts of 136 tokens
    (two shared prefixes), then 60 requests of Mooncake's trace at its own pace
    (2 tokens per hash id, mean prompt about 50 tokens). Their figures."""
    common = ["--data-dir", str(data_dir), "--ttft-slo", str(ttft_slo), "--no-progress"]
    common += ["--concurrency", "4", "--seed", "3"]
    burst = work / f"{label}-burst.json"
    yb(
        *("bench", "shared-prefix", "--groups", "2", "--users", "6", "--prefix-tokens", "128"),
        *("--question-tokens", "8", "--output-tokens", "8", *common, "--json", str(burst)),
        check=False,  # it exits 1 when requests failed; refusals are the point
    )
    trace = work / f"{label}-trace.json"
    yb(
        *("bench", "trace", "--tokens-per-block", "2", "--max-requests", "60"),
        *("--output-cap", "8", *common, "--json", str(trace)),
        check=False,
    )
    return [json.loads(burst.read_text()), json.loads(trace.read_text())]


# --- the panels, drawn by Prometheus -----------------------------------------------------


def panel_query(title: str) -> str:
    """The first query of the dashboard panel titled `title`, `$__rate_interval`
    replaced."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        panels: list[dict[str, Any]] = []
        for panel in dashboard["panels"]:
            panels += panel.get("panels", []) if panel.get("type") == "row" else [panel]
        for panel in panels:
            if panel["title"] == title:
                expr: str = panel["targets"][0]["expr"]
                return expr.replace("$__rate_interval", RATE_WINDOW)
    raise SystemExit(f"no panel titled {title!r} in {DASHBOARDS}")


def wait_for_scrapes(prometheus: PrometheusServer, instances: set[str]) -> None:
    """Wait until Prometheus has scraped every instance (its first scrape comes
    seconds after it starts: file discovery, then the scrape loops)."""
    deadline = time.monotonic() + WAIT_S
    scraped: set[str] = set()
    while time.monotonic() < deadline:
        scraped = {s["metric"]["instance"] for s in prometheus.query('up{job="yuebing"} == 1')}
        if scraped >= instances:
            return
        time.sleep(0.5)
    raise SystemExit(f"Prometheus scraped {sorted(scraped)}, not {sorted(instances)}")


def wait_for_series(prometheus: PrometheusServer, expr: str) -> None:
    """Wait until `expr` has a sample above 0 somewhere in the last 5 minutes."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if prometheus.query(f"max_over_time(({expr})[5m:1s]) > 0"):
            return
        time.sleep(1.0)
    raise SystemExit(f"Prometheus has no sample above 0 of {expr}")


async def graph_screenshot(page: Page, prometheus: PrometheusServer, expr: str) -> bytes:
    """Prometheus' graph page drawing `expr` over the last minute, once drawn."""
    query = urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0", "g0.range_input": "1m"})
    await page.navigate(f"{prometheus.url}/graph?{query}", timeout_s=60)
    # The classic UI draws an SVG with a path per series once the query answers.
    await page.wait_for(
        "document.querySelectorAll('.graph_area svg path').length > 0", timeout_s=60
    )
    await page.evaluate("new Promise(r => setTimeout(() => r(true), 500))")
    return await page.screenshot()


# --- the timeline ------------------------------------------------------------------------

PANEL = "document.getElementById('yb-decision')"


async def timeline_screenshot(page: Page, report: Path, request_id: str) -> bytes:
    """The report with `request_id` clicked, then the view widened around it."""
    await page.navigate(report.as_uri(), timeout_s=60)
    await page.wait_for("window.__ybTimelineReady", timeout_s=60)
    await page.evaluate(f"window.ybTimeline.zoomTo({request_id!r})")
    box = await page.evaluate(f"window.ybTimeline.requestBox({request_id!r})")
    if box is None:
        raise SystemExit(f"request {request_id} is not drawn")
    await page.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    await page.wait_for(
        f"{PANEL}.dataset.loaded === 'true' && {PANEL}.dataset.requestId === {request_id!r}",
        timeout_s=30,
    )
    # Widen to the first half minute, the request still selected, so the picture
    # shows the burst refused and the trace's prefills that followed.
    view = await page.evaluate("window.ybTimeline.view()")
    mid = (view["t0"] + view["t1"]) / 2
    await page.evaluate(f"window.ybTimeline.setView({mid - 2}, {mid + 28})")
    await page.evaluate("window.scrollTo(0, 0)")
    await page.evaluate("new Promise(r => requestAnimationFrame(() => r(true)))")
    if page.errors:
        raise SystemExit(f"the report reported errors: {page.errors}")
    return await page.screenshot()


async def screenshots(
    prometheus: PrometheusServer, queries: dict[str, str], report: Path, request_id: str
) -> dict[str, bytes]:
    async with Browser.launch() as browser:
        graphs = await browser.new_page(width=1100, height=760)
        out = {name: await graph_screenshot(graphs, prometheus, q) for name, q in queries.items()}
        timeline = await browser.new_page(width=1400, height=860)
        out["timeline"] = await timeline_screenshot(timeline, report, request_id)
    return out


def save(name: str, png: bytes) -> None:
    path = IMAGES / f"debugging-{name}.png"
    if len(png) >= MAX_PNG_BYTES:
        raise SystemExit(f"{path.name} is {len(png)} bytes, over {MAX_PNG_BYTES}")
    path.write_bytes(png)
    print(f"wrote {path.relative_to(ROOT)} ({len(png) // 1024} KB)")


# --- the walkthrough ---------------------------------------------------------------------


def first_refused(log: Path) -> str:
    """The request id of the log's first refusal."""
    for line in log.read_text().splitlines():
        event = json.loads(line)["event"]
        if event["type"] == "request_rejected":
            return str(event["request_id"])
    raise SystemExit(f"nothing was refused in {log}: no bad decision to find")


def start_cluster(data_dir: Path, env: dict[str, str]) -> LocalCluster:
    cluster = LocalCluster(data_dir, "--model", "tiny-random", env=env)
    cluster.start(timeout_s=300)
    return cluster


def summary(label: str, runs: list[dict[str, Any]]) -> None:
    keys = ("requests_planned", "requests_ok", "errors_http_429", "ttft_p50_s", "ttft_p99_s")
    for name, figures in zip(("burst", "trace"), runs, strict=True):
        shown = ", ".join(f"{k}={figures.get(k)}" for k in keys)
        print(f"{label} {name}: {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/yb-debugging"))
    parser.add_argument("--ttft-slo", type=float, default=0.2, help="gateway.ttft_slo_s")
    args = parser.parse_args()
    if prometheus_binary() is None or find_chromium() is None:
        raise SystemExit("needs Debian's prometheus and chromium on PATH")
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    slo_env = {"YB_GATEWAY__TTFT_SLO_S": str(args.ttft_slo)}
    print(time.strftime("run of %Y-%m-%d %H:%M %Z"), flush=True)

    fitted = work / "tiny-cost.json"
    yb("profile", "--quick", "--model", "tiny-random", "--out", str(fitted))

    data = work / "cluster"
    cluster = start_cluster(data, slo_env)
    prometheus: PrometheusServer | None = None
    try:
        info = read_cluster_info(data)
        assert info is not None and info.prometheus_config
        config = with_scrape_interval(Path(info.prometheus_config), work / "prometheus.yml", "1s")
        prometheus = PrometheusServer(config, work / "tsdb", work / "prometheus.log")
        prometheus.start()
        wait_for_scrapes(prometheus, {n for n in info.pids if not n.startswith("nats-server")})
        time.sleep(3)  # a few scrapes at rest, so the graphs start at 0
        runs = load(data, work, "default", args.ttft_slo)
        queries = {
            "rejections": panel_query("Rejections by reason"),
            "ttft-ratio": panel_query("TTFT: actual over estimate"),
        }
        for expr in queries.values():
            wait_for_series(prometheus, expr)
        time.sleep(5)  # the scrapes after the load, so the graphs show it end
        for name, expr in queries.items():
            print(f"\n{name}: {expr}")
            for sample in prometheus.query(expr.replace(RATE_WINDOW, "5m")):
                print(f"  over the last 5m: {sample['metric']} {sample['value'][1]}")

        log = work / "log.jsonl"
        yb("replay", "--data-dir", str(data), "--export", str(log))
        report = work / "timeline.html"
        yb("replay", "--data-dir", str(data), "--report", str(report))
        refused = first_refused(log)
        pictures = asyncio.run(screenshots(prometheus, queries, report, refused))
        for name, png in pictures.items():
            save(name, png)

        yb("explain", refused, "--data-dir", str(data))
        yb("replay", "--data-dir", str(data), "--set", "admission=none")
        yb("replay", "--data-dir", str(data), "--set", "learn_speed=false")
        yb("replay", "--data-dir", str(data), "--set", f"cost_model={fitted}")
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()

    # The fix itself: the same cluster and load, the cost model fitted on this machine.
    fixed_data = work / "cluster-fitted"
    cluster = start_cluster(fixed_data, {**slo_env, "YB_CONDUCTOR__COST_MODEL": str(fitted)})
    try:
        fixed_runs = load(fixed_data, work, "fitted", args.ttft_slo)
    finally:
        cluster.stop()
    print()
    summary("default cost model", runs)
    summary("fitted cost model ", fixed_runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
