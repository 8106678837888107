"""The timeline report in a real headless chromium (Debian's), driven over the
DevTools protocol: the page renders without errors and draws its lanes, a real mouse
click on a request's bar opens that request's decision, the wheel zooms."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from yb_conductor.cost_model import load_cost_model
from yb_conductor.replay import LogRecord
from yb_core import events as ev
from yb_testkit.browser import Browser, Page, find_chromium
from yb_tools.sim.params import SimParams
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import load_workload
from yb_tools.timeline.model import Timeline
from yb_tools.timeline.page import write_page
from yb_tools.timeline.report import build_report

pytestmark = pytest.mark.skipif(
    find_chromium() is None, reason="needs chromium (Debian package `chromium`) on PATH"
)

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
PARAMS = SimParams(
    prefill=8, decode=2, speedup=4.0, tbt_slo_s=0.02, ttft_slo_s=10.0, limit=300,
    pool_tokens=100_000,
)  # fmt: skip
PANEL = "document.getElementById('yb-decision')"


@pytest.fixture(scope="module")
def records() -> list[LogRecord]:
    items = load_workload(TRACE, block_size=512, speedup=PARAMS.speedup, limit=PARAMS.limit)
    sim = Simulation(
        items, PARAMS, load_cost_model("llama2-70b-a800"), policy="mooncake",
        admission="early", record_log=True,
    )  # fmt: skip
    sim.run()
    assert sim.records is not None
    return sim.records


@pytest.fixture(scope="module")
def report(records: list[LogRecord]) -> Timeline:
    return build_report(records, overrides={"policy": "least-loaded"})


@pytest.fixture
async def page(report: Timeline, tmp_path: Path) -> AsyncIterator[Page]:
    path = write_page(report, tmp_path / "timeline.html")
    async with Browser.launch() as browser:
        page = await browser.new_page(width=1400, height=900)
        await page.navigate(path.as_uri())
        await page.wait_for("window.__ybTimelineReady", timeout_s=30)
        yield page
        assert page.errors == []


async def test_the_page_renders_its_lanes(page: Page, report: Timeline) -> None:
    drawn = await page.evaluate("({...document.getElementById('yb-canvas').dataset})")
    assert int(drawn["lanes"]) == len(report.lanes)
    assert int(drawn["requests"]) == len(report.requests)
    # Fitted to the whole span, every prefill that started is drawn as a bar.
    started = sum(1 for r in report.requests if r.started is not None)
    assert int(drawn["bars"]) == started > 0
    assert int(drawn["rejections"]) == sum(1 for r in report.requests if r.outcome == 4) > 0
    assert int(drawn["series"]) == len(report.series)
    assert int(drawn["transfers"]) == len(report.transfers) > 0
    # The canvas holds the colours drawn: the recompute bars' blue-grey among them.
    colours = await page.evaluate(
        """(() => {
          const c = document.getElementById('yb-canvas');
          const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let recompute = 0, painted = 0;
          for (let i = 0; i < px.length; i += 4) {
            if (px[i + 3] === 0) continue;
            painted++;
            if (px[i] === 0x7f && px[i + 1] === 0x8f && px[i + 2] === 0xa6) recompute++;
          }
          return {recompute, painted, total: px.length / 4};
        })()"""
    )
    assert colours["painted"] == colours["total"]
    assert colours["recompute"] > 1000


async def _click_request(page: Page, request_id: str) -> dict[str, str]:
    assert await page.evaluate(f"window.ybTimeline.zoomTo({request_id!r})")
    box = await page.evaluate(f"window.ybTimeline.requestBox({request_id!r})")
    assert box is not None and box["width"] >= 1
    await page.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    await page.wait_for(f"{PANEL}.dataset.loaded === 'true'", timeout_s=10)
    shown: dict[str, str] = await page.evaluate(
        f"""({{id: {PANEL}.dataset.requestId,
              title: {PANEL}.querySelector('.rid').textContent,
              decision: {PANEL}.querySelector('.decision').textContent,
              chosen: [...{PANEL}.querySelectorAll('.decision .chosen')]
                        .map(e => e.textContent).join('\\n'),
              whatIf: {PANEL}.querySelector('.what-if').textContent}})"""
    )
    return shown


def _decision(records: list[LogRecord], request_id: str) -> ev.Decision:
    return next(
        r.event
        for r in records
        if isinstance(r.event, ev.Decision) and r.event.request_id == request_id
    )


async def test_a_click_opens_the_requests_decision(
    page: Page, records: list[LogRecord], report: Timeline
) -> None:
    # A request that pulled a prefix from another host, and one refused at admission.
    pulled = report.requests[report.transfers[0].request].id
    refused = next(r.id for r in report.requests if r.outcome == 4)
    for request_id in (pulled, refused):
        shown = await _click_request(page, request_id)
        assert shown["id"] == shown["title"] == request_id
        decision = _decision(records, request_id)
        assert decision.explain is not None
        assert shown["decision"].startswith(f"request {request_id}: ")
        for candidate in decision.explain.candidates:
            assert candidate.instance_id in shown["decision"]
        for decode in decision.explain.decode_candidates:
            assert decode.instance_id in shown["decision"]
        if isinstance(decision, ev.RequestScheduled):
            # The chosen candidates are the highlighted rows.
            assert decision.prefill_instance in shown["chosen"]
            assert decision.decode_instance in shown["chosen"]
            assert "transfer" in shown["decision"]
        else:
            assert "REJECTED" in shown["decision"] and shown["chosen"] == ""
        assert f"request {request_id}: " in shown["whatIf"]
        assert "policy least-loaded" in shown["whatIf"]
    assert await page.evaluate("window.ybTimeline.selected()") == refused


async def test_the_wheel_zooms_around_the_pointer(page: Page) -> None:
    before = await page.evaluate("window.ybTimeline.view()")
    box = await page.evaluate(
        "document.getElementById('yb-canvas').getBoundingClientRect().toJSON()"
    )
    x, y = box["left"] + box["width"] / 2, box["top"] + 60
    await page.send(
        "Input.dispatchMouseEvent",
        {"type": "mouseWheel", "x": x, "y": y, "deltaX": 0, "deltaY": -400},
    )
    after = await page.wait_for(
        f"(v => v.t1 - v.t0 < {before['t1'] - before['t0']} && v)(window.ybTimeline.view())"
    )
    assert before["t0"] < after["t0"] < after["t1"] < before["t1"]


async def test_a_drain_is_drawn_on_its_lane(records: list[LogRecord], tmp_path: Path) -> None:
    # The simulated cluster never stops an instance; a live one logs these.
    mid = records[len(records) // 2]
    t = mid.event.time
    stop = [
        LogRecord(seq=mid.seq, event=ev.InstanceDraining(
            time=t, instance_id="decode-1", reason="stopping", deadline=t + 20,
        )),
        LogRecord(seq=mid.seq, event=ev.InstanceDown(
            time=t + 1, instance_id="decode-1", reason="stopped",
        )),
    ]  # fmt: skip
    log = records[: len(records) // 2] + stop + records[len(records) // 2 :]
    path = write_page(build_report(log), tmp_path / "timeline.html")
    async with Browser.launch() as browser:
        page = await browser.new_page(width=1400, height=900)
        await page.navigate(path.as_uri())
        await page.wait_for("window.__ybTimelineReady", timeout_s=30)
        drawn = await page.evaluate("({...document.getElementById('yb-canvas').dataset})")
        assert (drawn["drains"], drawn["downs"]) == ("1", "1")
        legend = await page.evaluate("document.getElementById('yb-legend').textContent")
        assert "instance draining" in legend
        assert page.errors == []


def _plan(t: float, actions: list[ev.PoolAction], prefill: int) -> ev.PoolPlanned:
    return ev.PoolPlanned(
        time=t, planner_id="conductor-0", max_instances=4,
        forecast=ev.PoolForecast(window_s=30, lead_s=10, arrival_rate=3.5, forecast_rate=4.25),
        pools=[
            ev.PoolSize(role="prefill", current=prefill, needed=2.6, target=3),
            ev.PoolSize(role="decode", current=2, draining=1, needed=0.4, target=1,
                        held_by="hysteresis"),
        ],
        actions=actions, reason=f"prefill {prefill} -> 3",
    )  # fmt: skip


async def test_the_planner_lane_shows_each_decision(
    records: list[LogRecord], tmp_path: Path
) -> None:
    # The simulated cluster here runs no planner; a live one logs these: an add, a
    # decision without actions, and a drain with a move.
    at = [records[len(records) * k // 4] for k in (1, 2, 3)]
    plans = [
        _plan(at[0].event.time, [ev.PoolAction(action="add", role="prefill")], 1),
        _plan(at[1].event.time, [], 2),
        _plan(at[2].event.time, [
            ev.PoolAction(action="drain", role="decode", instance_id="decode-1"),
            ev.PoolAction(action="move", role="prefill", instance_id="decode-0"),
        ], 3),
    ]  # fmt: skip
    log = list(records)
    for record, plan in reversed(list(zip(at, plans, strict=True))):
        log.insert(log.index(record) + 1, LogRecord(seq=record.seq, event=plan))
    path = write_page(build_report(log), tmp_path / "timeline.html")
    async with Browser.launch() as browser:
        page = await browser.new_page(width=1400, height=900)
        await page.navigate(path.as_uri())
        await page.wait_for("window.__ybTimelineReady", timeout_s=30)
        drawn = await page.evaluate("({...document.getElementById('yb-canvas').dataset})")
        # A mark per decision, a glyph per action, a step line per pool.
        assert int(drawn["plans"]) == len(plans)
        assert int(drawn["actions"]) == sum(len(p.actions) for p in plans) == 3
        assert drawn["pools"] == "2"
        legend = await page.evaluate("document.getElementById('yb-legend').textContent")
        assert "planner: add" in legend and "prefill serving" in legend
        # A real click at the last decision's mark opens it: actions, reason, pools.
        box = await page.evaluate("window.ybTimeline.planBox(2)")
        assert box is not None
        await page.click(box["x"] + 1, box["y"] + box["height"] / 2)
        await page.wait_for(f"{PANEL}.dataset.plan === '2'", timeout_s=10)
        shown = await page.evaluate(
            f"""({{actions: {PANEL}.querySelector('.actions').textContent,
                  reason: {PANEL}.querySelector('.reason').textContent,
                  pools: [...{PANEL}.querySelectorAll('.pools tr')]
                           .map(tr => [...tr.cells].map(td => td.textContent))}})"""
        )
        assert shown["actions"] == "drain decode-1, move decode-0 to prefill"
        assert shown["reason"] == plans[2].reason
        assert shown["pools"][1:] == [
            ["prefill", "3", "0", "0", "2.60", "3", "-"],
            ["decode", "2", "0", "1", "0.40", "1", "hysteresis"],
        ]
        assert await page.evaluate("window.ybTimeline.selectedPlan()") == 2
        # Hovering it says the same in a tooltip (the open panel narrowed the chart).
        box = await page.evaluate("window.ybTimeline.planBox(2)")
        await page.send(
            "Input.dispatchMouseEvent",
            {"type": "mouseMoved", "x": box["x"] + 1, "y": box["y"] + box["height"] / 2},
        )
        tip = await page.wait_for(
            "(t => !t.hidden && t.textContent)(document.getElementById('yb-tip'))"
        )
        assert plans[2].reason in tip and "decode: 2 serving" in tip
        assert page.errors == []
