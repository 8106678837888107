"""From per-request results to figures: latency percentiles, throughput, goodput, cache.

Latency figures (TTFT, inter-token latency, time per output token, end-to-end) are
over the requests that completed; a failed request has no meaningful latency, it is
counted in `errors_<kind>` instead. Goodput is completed requests per second that met
both SLOs: TTFT within `ttft_s`, and TBT within `tbt_s`, where a request's TBT is
the `tbt_percentile`-th percentile of its own inter-token gaps (90 by default, as the
paper reports TBT; 100 makes it the worst gap). The cache figure is what the gateway
reports in `usage.prompt_tokens_details.cached_tokens`, over the prompt tokens of the
requests whose usage came back; TTFT is also split between completed requests that
hit the cache and those that did not.

`figures` is one flat JSON object, as every benchmark of the project writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from yb_core.stats import percentile
from yb_tools.bench.client import CANCELLED, RequestResult

Figure = float | int | str | None

# Kinds whose counts are always present in the JSON, so a consumer can rely on them.
ALWAYS_COUNTED = ("http_429", "http_503", "timeout")


@dataclass(frozen=True, slots=True)
class Slo:
    """The service-level objectives goodput is measured against."""

    ttft_s: float
    tbt_s: float
    tbt_percentile: float = 90.0


def request_tbt(result: RequestResult, q: float) -> float | None:
    """A request's time between tokens (the `q`-th percentile of its gaps); None when
    it streamed fewer than two text frames, so it has no gap to judge."""
    gaps = result.gaps()
    return percentile(gaps, q) if gaps else None


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Whether a request completed within both SLOs."""
    if not result.ok or result.ttft_s is None or result.ttft_s > slo.ttft_s:
        return False
    tbt = request_tbt(result, slo.tbt_percentile)
    return tbt is None or tbt <= slo.tbt_s


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first: the decode pace a user sees."""
    if result.ttft_s is None or result.e2e_s is None or result.completion_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)


def _distribution(name: str, values: Sequence[float]) -> dict[str, Figure]:
    if not values:
        return {f"{name}_{stat}_s": None for stat in ("mean", "p50", "p90", "p99")}
    return {
        f"{name}_mean_s": sum(values) / len(values),
        f"{name}_p50_s": percentile(values, 50),
        f"{name}_p90_s": percentile(values, 90),
        f"{name}_p99_s": percentile(values, 99),
    }


@dataclass
class Report:
    """The figures of one run, and one example message per error kind."""

    figures: dict[str, Figure]
    error_examples: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """The human-readable summary."""
        return render_table(self)


def summarize(
    results: Sequence[RequestResult],
    elapsed_s: float,
    slo: Slo,
    context: dict[str, Figure] | None = None,
) -> Report:
    """Every figure of a run; `context` (workload, flags) is copied into the figures."""
    done = [r for r in results if r.ok]
    cancelled = [r for r in results if r.error == CANCELLED]
    failed = [r for r in results if r.error and r.error != CANCELLED]
    duration = max(elapsed_s, 1e-9)

    figures: dict[str, Figure] = dict(context or {})
    figures.update(
        {
            "requests_planned": len(results),
            "requests_sent": sum(1 for r in results if r.sent_s is not None),
            "requests_ok": len(done),
            "requests_failed": len(failed),
            "requests_cancelled": len(cancelled),
            "duration_s": elapsed_s,
            "request_throughput_rps": len(done) / duration,
        }
    )
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    gaps = [g for r in done for g in r.gaps()]
    tpots = [t for r in done if (t := tpot(r)) is not None]
    e2es = [r.e2e_s for r in done if r.e2e_s is not None]
    figures.update(_distribution("ttft", ttfts))
    figures.update(_distribution("itl", gaps))
    figures.update(_distribution("tpot", tpots))
    figures.update(_distribution("e2e", e2es))

    # TTFT apart for requests that reused cached prefix KV and those that did not:
    # the reuse speed-up as a client sees it, under this load.
    for label, hit in (("hit", True), ("miss", False)):
        split = [r.ttft_s for r in done if r.ttft_s is not None and (r.cached_tokens > 0) == hit]
        figures[f"requests_cache_{label}"] = len(split)
        figures[f"ttft_cache_{label}_mean_s"] = sum(split) / len(split) if split else None
        figures[f"ttft_cache_{label}_p50_s"] = percentile(split, 50) if split else None

    output_tokens = sum(r.completion_tokens for r in done)
    with_usage = [r for r in results if r.usage_reported]
    prompt_tokens = sum(r.prompt_tokens for r in with_usage)
    cached_tokens = sum(r.cached_tokens for r in with_usage)
    good = [r for r in done if meets_slo(r, slo)]
    judged = len(done) + len(failed)
    queued = [r.queued_s for r in results if r.error != CANCELLED]
    figures.update(
        {
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / duration,
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_per_s": prompt_tokens / duration,
            "cached_tokens": cached_tokens,
            "cache_hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "requests_with_cache_hit": sum(1 for r in with_usage if r.cached_tokens > 0),
            "ttft_slo_s": slo.ttft_s,
            "tbt_slo_s": slo.tbt_s,
            "tbt_percentile": slo.tbt_percentile,
            "requests_meeting_slo": len(good),
            "slo_attainment": len(good) / judged if judged else 0.0,
            "goodput_rps": len(good) / duration,
            "client_queue_mean_s": sum(queued) / len(queued) if queued else 0.0,
            "client_queue_max_s": max(queued, default=0.0),
            "errors_total": len(failed),
        }
    )
    kinds = Counter(r.error for r in failed)
    for kind in ALWAYS_COUNTED:
        figures[f"errors_{kind}"] = kinds.get(kind, 0)
    for kind, count in sorted(kinds.items()):
        figures[f"errors_{kind}"] = count
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error, r.message)
    return Report(figures, examples)


def _fmt_s(value: Figure) -> str:
    if not isinstance(value, int | float):
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def _num(figures: dict[str, Figure], key: str) -> float:
    value = figures.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def render_table(report: Report) -> str:
    """The summary as printed by `yb bench`."""
    f = report.figures
    lines = []
    head = f.get("workload")
    if head:
        lines.append(f"workload   {head}")
    if f.get("note"):
        lines.append(f"note       {f['note']}")
    lines.append(
        f"requests   {f['requests_ok']} ok, {f['requests_failed']} failed, "
        f"{f['requests_cancelled']} cancelled, of {f['requests_planned']}, "
        f"in {_num(f, 'duration_s'):.1f} s"
    )
    lines.append("")
    lines.append(f"{'':<26}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, label in (
        ("ttft", "time to first token"),
        ("itl", "inter-token latency"),
        ("tpot", "time per output token"),
        ("e2e", "end-to-end latency"),
    ):
        cells = "".join(
            f"{_fmt_s(f.get(f'{name}_{s}_s')):>10}" for s in ("mean", "p50", "p90", "p99")
        )
        lines.append(f"{label:<26}{cells}")
    lines.append("")
    lines.append(
        f"throughput {_num(f, 'request_throughput_rps'):.3f} req/s, "
        f"{_num(f, 'output_tokens_per_s'):.1f} output tok/s, "
        f"{_num(f, 'prompt_tokens_per_s'):.0f} prompt tok/s"
    )
    lines.append(
        f"goodput    {_num(f, 'goodput_rps'):.3f} req/s: {f['requests_meeting_slo']} requests "
        f"with TTFT <= {_num(f, 'ttft_slo_s'):g} s and TBT p{_num(f, 'tbt_percentile'):g} "
        f"<= {_num(f, 'tbt_slo_s'):g} s ({_num(f, 'slo_attainment'):.0%} of those sent)"
    )
    lines.append(
        f"cache      {int(_num(f, 'cached_tokens')):,} of {int(_num(f, 'prompt_tokens')):,} "
        f"prompt tokens cached ({_num(f, 'cache_hit_ratio'):.1%}); "
        f"{f['requests_with_cache_hit']} requests hit"
    )
    if f.get("requests_cache_hit") and f.get("requests_cache_miss"):
        lines.append(
            f"TTFT p50   {_fmt_s(f['ttft_cache_hit_p50_s'])} with a cache hit "
            f"({f['requests_cache_hit']} requests), {_fmt_s(f['ttft_cache_miss_p50_s'])} "
            f"without ({f['requests_cache_miss']})"
        )
    if _num(f, "client_queue_max_s") > 0.05:
        lines.append(
            f"queueing   requests waited for the concurrency cap: mean "
            f"{_fmt_s(f['client_queue_mean_s'])}, max {_fmt_s(f['client_queue_max_s'])}"
        )
    kinds = {
        k.removeprefix("errors_"): v
        for k, v in f.items()
        if k.startswith("errors_") and k != "errors_total" and v
    }
    if kinds:
        listed = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items()))
        lines.append(f"errors     {listed}")
        for kind, message in sorted(report.error_examples.items()):
            lines.append(f"  {kind}: {message}")
    return "\n".join(lines)
