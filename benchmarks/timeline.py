"""Timeline report benchmark: how fast a 10,000-request report opens in a real browser.

    python benchmarks/timeline.py --json PATH [--requests 10000] [--repeats 5]
    python benchmarks/timeline.py --screenshot docs/images/timeline.png [--requests 1000]

The workload is Mooncake's synthetic trace (benchmarks/traces/), repeated end to end
until it holds `--requests` requests (3,993 per copy; later copies keep the hash ids,
so they reuse the first copy's prefixes as a recurring workload would). `yb sim`'s
simulator runs it on the paper's cluster (8 prefill, 8 decode, llama2-70b-a800
profile) around the real conductor and records the log; `yb_tools.timeline` builds
the report of the whole log, as `yb replay --file LOG --report` does. Then, in
Debian's headless chromium (`yb_testkit.browser`), each of `--repeats` fresh tabs
opens the file:

- `open_ms_*`: from navigation start to the page's ready mark (`__ybTimelineReady`:
  the data parsed, every lane drawn, and two animation frames later, so the frame is
  on screen); the goal is under 2 s for 10,000 requests;
- `decision_ms_*`: a click on a request's bar (a real mouse event at its box) until
  its decision text is in the panel, right after the ready mark (the decisions are
  inflated from their gzip block in the background from then on, so this includes
  what is left of that).

`--screenshot PATH` instead writes a PNG of a `--requests` window (1,000 for the
docs) with a request's decision open, for docs/timeline.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src", "tools/testkit/src"):
    sys.path.insert(0, str(ROOT / src))

from yb_conductor.cost_model import load_cost_model  # noqa: E402
from yb_conductor.replay import LogRecord  # noqa: E402
from yb_testkit.browser import Browser, Page, find_chromium  # noqa: E402
from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.simulator import Simulation  # noqa: E402
from yb_tools.sim.workload import workload_from  # noqa: E402
from yb_tools.timeline.model import Timeline, Window  # noqa: E402
from yb_tools.timeline.page import write_page  # noqa: E402
from yb_tools.timeline.report import build_report  # noqa: E402
from yb_tools.traces import TraceRecord, read_trace  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"
GOAL_OPEN_MS = 2000.0
PANEL = "document.getElementById('yb-decision')"


def repeated_trace(n: int) -> list[TraceRecord]:
    """The first `n` requests of the trace repeated end to end, a second apart."""
    base = read_trace(TRACE)
    span = base[-1].timestamp + 1000.0
    out: list[TraceRecord] = []
    copy = 0
    while len(out) < n:
        for r in base[: n - len(out)]:
            out.append(
                TraceRecord(r.timestamp + copy * span, r.input_length, r.output_length, r.hash_ids)
            )
        copy += 1
    return out


def simulate(n: int) -> tuple[list[LogRecord], float]:
    """The log of `n` requests through the simulated cluster, and how long it took."""
    started = time.perf_counter()
    params = SimParams(prefill=8, decode=8, limit=n)
    items = workload_from(repeated_trace(n), block_size=512)
    sim = Simulation(
        items, params, load_cost_model("llama2-70b-a800"), policy="mooncake", record_log=True
    )
    sim.run()
    assert sim.records is not None
    return sim.records, time.perf_counter() - started


async def open_page(browser: Browser, url: str, width: int, height: int) -> tuple[Page, float]:
    """A fresh tab at `url`; the ready mark, ms after navigation start."""
    page = await browser.new_page(width=width, height=height)
    await page.navigate(url, timeout_s=60)
    ready = float(await page.wait_for("window.__ybTimelineReady", timeout_s=60))
    if page.errors:
        raise SystemExit(f"the page reported errors: {page.errors}")
    return page, ready


async def click_request(page: Page, request_id: str) -> float:
    """Zoom to a request, click its bar, wait for its decision; ms from the click."""
    await page.evaluate(f"window.ybTimeline.zoomTo({request_id!r})")
    box = await page.evaluate(f"window.ybTimeline.requestBox({request_id!r})")
    if box is None:
        raise SystemExit(f"request {request_id} is not drawn")
    started = time.perf_counter()
    await page.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    await page.wait_for(
        f"{PANEL}.dataset.loaded === 'true' && {PANEL}.dataset.requestId === {request_id!r}",
        timeout_s=30,
        poll_s=0.005,
    )
    return (time.perf_counter() - started) * 1e3


def a_pulling_request(timeline: Timeline) -> str:
    """A request whose plan pulls a prefix from another host (else the middle one)."""
    pulls = [t.request for t in timeline.transfers if t.kind == 0 and t.request >= 0]
    index = pulls[len(pulls) // 2] if pulls else len(timeline.requests) // 2
    return timeline.requests[index].id


async def measure(path: Path, timeline: Timeline, repeats: int) -> dict[str, float]:
    opens, clicks = [], []
    async with Browser.launch() as browser:
        for _ in range(repeats):
            page, ready = await open_page(browser, path.as_uri(), 1600, 1000)
            opens.append(ready)
            clicks.append(await click_request(page, a_pulling_request(timeline)))
            await page.send("Page.close")
    return {
        "open_ms_median": round(statistics.median(opens), 1),
        "open_ms_max": round(max(opens), 1),
        "decision_ms_median": round(statistics.median(clicks), 1),
    }


async def screenshot(path: Path, timeline: Timeline) -> tuple[str, bytes]:
    """A PNG of the report with a request's decision open; the request's id."""
    async with Browser.launch() as browser:
        page, _ = await open_page(browser, path.as_uri(), 1400, 860)
        request_id = a_pulling_request(timeline)
        await click_request(page, request_id)
        # Back to a view of a minute around it, the request still selected, so the
        # picture shows the lanes' load as well as the decision.
        view = await page.evaluate("window.ybTimeline.view()")
        mid = (view["t0"] + view["t1"]) / 2
        await page.evaluate(f"window.ybTimeline.setView({mid - 30}, {mid + 30})")
        await page.evaluate("window.scrollTo(0, 0)")
        await page.evaluate("new Promise(r => requestAnimationFrame(() => r(true)))")
        return request_id, await page.screenshot()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--requests", type=int, default=0, help="10,000 (1,000 with --screenshot)")
    parser.add_argument("--repeats", type=int, default=5, help="fresh tabs opened")
    parser.add_argument("--screenshot", type=Path, help="write a PNG of the report instead")
    args = parser.parse_args()
    if find_chromium() is None:
        raise SystemExit("needs chromium on PATH (Debian package `chromium`)")
    n = args.requests or (1000 if args.screenshot else 10_000)

    records, sim_s = simulate(n)
    started = time.perf_counter()
    timeline = build_report(
        records,
        Window(last=0),
        title=f"yb sim: mooncake, {n:,} requests",
        source="Mooncake's synthetic trace" + (" (repeated)" if n > 3993 else ""),
    )
    build_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="yb-timeline-") as tmp:
        path = write_page(timeline, Path(tmp) / "timeline.html")
        size_mb = path.stat().st_size / 1e6
        print(
            f"log: {len(records)} events of {n} requests, simulated in {sim_s:.1f}s; report "
            f"built in {build_s:.2f}s, {size_mb:.2f} MB"
        )
        if args.screenshot:
            request_id, png = asyncio.run(screenshot(path, timeline))
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            args.screenshot.write_bytes(png)
            kb = len(png) / 1024
            print(f"{args.screenshot}: request {request_id}'s decision open ({kb:.0f} KB)")
            return 0
        figures: dict[str, float | int] = {
            "requests": len(timeline.requests),
            "log_events": len(records),
            "lanes": len(timeline.lanes),
            "report_mb": round(size_mb, 2),
            "build_s": round(build_s, 2),
            **asyncio.run(measure(path, timeline, args.repeats)),
        }
    print(f"\n{'figure':<22} {'value':>10}  goal")
    for name, value in figures.items():
        note = ""
        if name == "open_ms_median":
            met = "met" if value < GOAL_OPEN_MS else "NOT met"
            note = f"< {GOAL_OPEN_MS:g}  {met}"
        print(f"{name:<22} {value:>10}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
