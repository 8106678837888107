"""The markdown tables `yb sim` prints: one row per policy, the figures that compare
(`needless`: rejections that met both SLOs with admission `none`, and their share;
`kv exhausted`: requests a decode instance ended mid-stream when its KV pages ran
out, failed like the rejected but after their first token);
and one row per policy and priority class when a run mixes priorities."""

from __future__ import annotations

from yb_tools.sim.results import PolicyResult
from yb_tools.sim.runner import SimReport

COLUMNS = (
    "policy",
    "TTFT mean s",
    "p50",
    "p90",
    "p99",
    "TBT p90 ms",
    "SLO %",
    "goodput rps",
    "rejected",
    "at decode",
    "needless",
    "kv exhausted",
    "wasted prefill s",
    "hit ratio",
    "remote share",
    "transfer GB",
)


def markdown_table(report: SimReport) -> str:
    """The policies side by side."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + " |",
    ]
    for label, r in report.policies.items():
        remote = r.remote_reused_tokens / r.reused_tokens if r.reused_tokens else 0.0
        cells = [
            label,
            f"{r.ttft_mean_s:.2f}",
            f"{r.ttft_p50_s:.2f}",
            f"{r.ttft_p90_s:.2f}",
            f"{r.ttft_p99_s:.2f}",
            f"{r.tbt_p90_s * 1000:.1f}",
            f"{r.slo_attainment * 100:.1f}",
            f"{r.goodput_rps:.2f}",
            str(r.rejected),
            str(r.rejected_at_decode),
            needless_cell(r),
            str(r.kv_exhausted),
            f"{r.wasted_prefill_s:.0f}",
            f"{r.cache_hit_ratio:.3f}",
            f"{remote:.2f}",
            f"{r.transfer_bytes / 1e9:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def needless_cell(r: PolicyResult) -> str:
    """Needless rejections and their share of the rejections ("0" with none)."""
    if not r.needless_rejections:
        return "0"
    return f"{r.needless_rejections} ({r.needless_rejection_share * 100:.0f}%)"


PRIORITY_COLUMNS = (
    "policy",
    "priority",
    "requests",
    "completed",
    "rejected",
    "kv exhausted",
    "timed out",
    "TTFT p50 s",
    "p90",
    "p99",
    "max",
    "TTFT within SLO %",
    "TBT p90 ms",
    "SLO %",
)


def priority_table(report: SimReport) -> str:
    """Each policy's priority classes side by side ("" when no run mixes priorities)."""
    if all(len(r.by_priority) <= 1 for r in report.policies.values()):
        return ""
    lines = [
        "| " + " | ".join(PRIORITY_COLUMNS) + " |",
        "| " + " | ".join(["---"] + ["---:"] * (len(PRIORITY_COLUMNS) - 1)) + " |",
    ]
    for label, r in report.policies.items():
        for c in r.by_priority.values():
            cells = [
                label,
                str(c.priority),
                str(c.requests),
                str(c.completed),
                str(c.rejected),
                str(c.kv_exhausted),
                str(c.timed_out),
                f"{c.ttft_p50_s:.2f}",
                f"{c.ttft_p90_s:.2f}",
                f"{c.ttft_p99_s:.2f}",
                f"{c.ttft_max_s:.2f}",
                f"{c.ttft_within_slo * 100:.1f}",
                f"{c.tbt_p90_s * 1000:.1f}",
                f"{c.slo_attainment * 100:.1f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def group_table(report: SimReport) -> str:
    """Where each policy's prompts were prefilled, when some went to prefill groups
    or into decode batches ("" when none did): requests, median prompt, mean TTFT."""
    runs = [
        (label, r)
        for label, r in report.policies.items()
        if r.group_requests or r.piggyback_requests
    ]
    if not runs:
        return ""
    lines = [
        "| policy | where | requests | prompt p50 | TTFT mean s |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for label, r in runs:
        piggy = (r.piggyback_requests, r.piggyback_prompt_p50, r.piggyback_ttft_mean_s)
        placed = [
            ("prefill groups", r.group_requests, r.group_prompt_p50, r.group_ttft_mean_s),
            ("decode batches", *piggy),
            ("whole-model instances", r.whole_requests, r.whole_prompt_p50, r.whole_ttft_mean_s),
        ]
        for where, n, prompt, ttft in placed:
            if n:
                lines.append(f"| {label} | {where} | {n} | {prompt:,.0f} | {ttft:.2f} |")
    return "\n".join(lines)


def summary_line(report: SimReport) -> str:
    """What ran, on what, how fast."""
    p = report.params
    return (
        f"{report.requests} requests, {p.prefill} prefill (TP {report.prefill_tp}) + "
        f"{p.decode} decode (TP {report.decode_tp}) instances on {report.devices} devices, "
        f"profile {report.cost_model}, block {report.block_size}, speedup {p.speedup:g}x"
        + (
            f", prefill groups of {'+'.join(map(str, p.prefill_groups))} stages "
            f"(chunks of {p.chunk_tokens} tokens)"
            if p.prefill_groups
            else ""
        )
        + f", SLO TTFT {p.ttft_slo_s:g}s / TBT {p.tbt_slo_s * 1000:g}ms: "
        f"{report.simulated_seconds_per_wall_second:,.0f} simulated s per wall s "
        f"({report.wall_s:.1f}s wall)"
    )
