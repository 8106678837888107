"""The run as a PNG: TTFT and inter-token latency over time and as distributions.

Four panels: TTFT of each request at the time it was sent (failures marked on the
axis, so a burst of 429s shows where it happened), every inter-token gap at the time
it arrived, and the CDFs of both with the SLOs drawn in. matplotlib is imported
here only, with the file-only Agg backend, so `yb bench` without `--plot` does not pay
for it and no display is needed.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from yb_tools.bench.client import CANCELLED, RequestResult
from yb_tools.bench.report import Report, Slo


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def _slo_line(ax: Any, slo_s: float, values: Sequence[float], *, vertical: bool) -> None:
    """The SLO as a dashed line when it is near the data; named off-scale otherwise,
    so that a far-away SLO does not squash every sample against the axis."""
    top = max(values, default=0.0)
    label = f"SLO {slo_s:g} s"
    if top and slo_s > 1.5 * top:
        ax.plot([], [], " ", label=f"{label} (off scale)")
        return
    draw = ax.axvline if vertical else ax.axhline
    draw(slo_s, color="tab:gray", linestyle="--", linewidth=1, label=label)


def write_plot(
    path: Path | str, results: Sequence[RequestResult], report: Report, slo: Slo, title: str
) -> None:
    """Draw the run into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok and r.ttft_s is not None and r.sent_s is not None]
    failed = [r for r in results if r.error and r.error != CANCELLED and r.sent_s is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (ax_ttft, ax_itl), (cdf_ttft, cdf_itl) = axes

    ax_ttft.scatter([r.sent_s for r in done], [r.ttft_s for r in done], s=10, label="completed")
    if failed:
        ax_ttft.scatter(
            [r.sent_s for r in failed],
            [0.0] * len(failed),
            marker="x",
            color="tab:red",
            label=f"failed ({len(failed)})",
        )
    _slo_line(ax_ttft, slo.ttft_s, [r.ttft_s or 0.0 for r in done], vertical=False)
    ax_ttft.set(xlabel="request sent at (s)", ylabel="TTFT (s)", title="Time to first token")
    ax_ttft.set_ylim(bottom=0)
    ax_ttft.legend(loc="upper left", fontsize="small")

    gap_x: list[float] = []
    gap_y: list[float] = []
    for r in done:
        assert r.sent_s is not None
        for at, gap in zip(r.token_times[1:], r.gaps(), strict=True):
            gap_x.append(r.sent_s + at)
            gap_y.append(gap)
    ax_itl.scatter(gap_x, gap_y, s=3, alpha=0.4)
    _slo_line(ax_itl, slo.tbt_s, gap_y, vertical=False)
    ax_itl.set(xlabel="token arrived at (s)", ylabel="gap (s)", title="Inter-token latency")
    ax_itl.set_ylim(bottom=0)
    ax_itl.legend(loc="upper left", fontsize="small")

    for ax, values, slo_s, name in (
        (cdf_ttft, [r.ttft_s for r in done if r.ttft_s is not None], slo.ttft_s, "TTFT"),
        (cdf_itl, gap_y, slo.tbt_s, "inter-token latency"),
    ):
        if values:
            xs, ys = _cdf(values)
            ax.step(xs, ys, where="post")
        _slo_line(ax, slo_s, values, vertical=True)
        ax.legend(loc="lower right", fontsize="small")
        ax.set(xlabel=f"{name} (s)", ylabel="fraction of samples", title=f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)

    f = report.figures
    summary = (
        f"{f.get('requests_ok')} ok / {f.get('requests_failed')} failed, "
        f"goodput {float(f.get('goodput_rps') or 0):.3f} req/s, "
        f"cache hit {float(f.get('cache_hit_ratio') or 0):.1%}"
    )
    # Long workload descriptions would run off the figure's edges.
    wrapped = textwrap.fill(title, width=120)
    fig.suptitle(f"{wrapped}\n{summary}", fontsize="medium")
    fig.savefig(path, dpi=110)
    plt.close(fig)
