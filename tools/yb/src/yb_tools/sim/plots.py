"""PNG figures of a `yb sim` report (matplotlib, imported only when plotting).

- `<prefix>_ttft.png`: TTFT mean / p90 / p99 per policy (log scale: the spread
  between cache-blind and cache-aware policies is orders of magnitude);
- `<prefix>_load.png`: each policy's prefill backlog and decode TBT ratio over time,
  on twin axes — the seesaw of the paper's §7;
- `<prefix>_cache.png`: cache hit ratio (local and remote) and rejections per policy.
"""

from __future__ import annotations

from pathlib import Path

from yb_tools.sim.runner import SimReport


def write_plots(report: SimReport, prefix: str | Path) -> list[Path]:
    """Write the figures next to `prefix`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    labels = list(report.policies)
    results = [report.policies[k] for k in labels]
    xs = range(len(labels))
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels)), 4.0))
    width = 0.27
    for k, (name, values) in enumerate(
        (
            ("mean", [r.ttft_mean_s for r in results]),
            ("p90", [r.ttft_p90_s for r in results]),
            ("p99", [r.ttft_p99_s for r in results]),
        )
    ):
        ax.bar([x + (k - 1) * width for x in xs], [max(v, 1e-3) for v in values], width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s)")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right")
    ax.set_title(f"TTFT by policy (speedup {report.params.speedup:g}x)")
    ax.legend()
    fig.tight_layout()
    path = prefix.with_name(prefix.name + "_ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    rows = len(results)
    fig, axes = plt.subplots(rows, 1, figsize=(9.0, 1.9 * rows + 0.6), sharex=True, squeeze=False)
    for ax, label, r in zip(axes[:, 0], labels, results, strict=True):
        load = r.load_over_time
        ax.plot(load.t, load.prefill_backlog_s, color="tab:blue", lw=0.9)
        ax.set_ylabel("prefill\nbacklog s", color="tab:blue", fontsize=8)
        twin = ax.twinx()
        twin.plot(load.t, load.decode_tbt_ratio, color="tab:red", lw=0.9)
        twin.axhline(1.0, color="tab:red", lw=0.5, ls=":")
        twin.set_ylabel("decode\nTBT/SLO", color="tab:red", fontsize=8)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    path = prefix.with_name(prefix.name + "_load.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 2.0 * len(labels)), 4.0))
    local = [r.local_reused_tokens / max(1, r.prefilled_prompt_tokens) for r in results]
    remote = [r.remote_reused_tokens / max(1, r.prefilled_prompt_tokens) for r in results]
    left.bar(xs, local, label="own host")
    left.bar(xs, remote, bottom=local, label="pulled from another host")
    left.set_ylabel("share of prompt tokens reused")
    left.set_xticks(list(xs), labels, rotation=30, ha="right")
    left.set_title("cache hit ratio")
    left.legend(fontsize=8)
    arrival = [r.rejected_at_arrival for r in results]
    decode = [r.rejected_at_decode for r in results]
    right.bar(xs, arrival, label="at arrival")
    right.bar(xs, decode, bottom=arrival, label="at decode (prefill wasted)")
    right.set_ylim(bottom=0)
    right.set_ylabel("requests rejected")
    right.set_xticks(list(xs), labels, rotation=30, ha="right")
    right.set_title("rejections")
    right.legend(fontsize=8)
    fig.tight_layout()
    path = prefix.with_name(prefix.name + "_cache.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
