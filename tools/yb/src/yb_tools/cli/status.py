"""`yb status`: instances, roles, loads and cache use, read from the event log.

Everything a person needs to see is already in the log (`InstanceUp`, `LoadReport`,
`InstanceDraining`, `InstanceDown`), so status folds the instance events and prints a
table; it asks no service anything. It reads them from the instance stream, which keeps the newest
event of every instance whatever the log trimmed (`Bus.read_instances`), once that
stream has copied every instance event the log holds (`Bus.sync_instances`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from yb_core import events as ev
from yb_core.bus import Bus, BusError


@dataclass
class InstanceRow:
    """One line of the status table."""

    up: ev.InstanceUp
    report: ev.LoadReport | None = None
    down: str = ""
    last_seen: float = 0.0
    draining: bool = False


async def collect(bus: Bus, timeout_s: float = 5.0) -> dict[str, InstanceRow]:
    """Fold the newest instance events, as of now, into one row per instance.

    Raises `BusError` when the instance stream does not exist (no service of this
    version has started against this NATS) or does not catch up within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    last = await bus.sync_instances(timeout_s)
    rows: dict[str, InstanceRow] = {}
    if last == 0:
        return rows
    reader = await bus.read_instances()
    try:
        # Last-per-subject delivers in stream order and the stream's newest message
        # is the newest of its subject, so `last` is delivered last of what was there.
        while True:
            remaining = deadline - time.monotonic()
            item = await reader.next(timeout_s=remaining) if remaining > 0 else None
            if item is None:
                raise BusError(f"instance events up to {last} not read within {timeout_s:.1f}s")
            match item.event:
                case ev.InstanceUp() as up:
                    rows[up.instance_id] = InstanceRow(up=up, last_seen=up.time)
                case ev.LoadReport() as report if report.instance_id in rows:
                    row = rows[report.instance_id]
                    row.report, row.last_seen = report, report.time
                case ev.InstanceDown() as down if down.instance_id in rows:
                    rows[down.instance_id].down = down.reason or "down"
                case ev.InstanceDraining() as draining if draining.instance_id in rows:
                    # Delivered in log order: a later announcement (a new process)
                    # made a new row.
                    rows[draining.instance_id].draining = True
            if item.seq >= last:
                break
    finally:
        await reader.close()
    return rows


def render(rows: dict[str, InstanceRow], heartbeat_timeout_s: float, now: float) -> str:
    """The status table as text."""
    header = (
        f"{'INSTANCE':<14} {'ROLE':<10} {'HOST':<8} {'STATE':<8} {'QUEUE':>5} {'RUN':>4} "
        f"{'KV USED':>13} {'DRAM':>6} {'SSD':>6} {'ATTENTION':<15} {'SEEN':>6}"
    )
    lines = [header]
    order = {"gateway": 0, "conductor": 1, "prefill": 2, "decode": 3, "kvstore": 4}
    for row in sorted(rows.values(), key=lambda r: (order.get(r.up.role, 9), r.up.instance_id)):
        up, rep = row.up, row.report
        age = now - row.last_seen if row.last_seen else float("inf")
        heartbeating = up.role in ("prefill", "decode", "kvstore")
        if row.down:
            state = "down"
        elif heartbeating and age > heartbeat_timeout_s:
            state = "silent"
        elif row.draining:
            state = "draining"
        else:
            state = "up"
        kv = f"{rep.kv_used_blocks}/{rep.kv_total_blocks}" if rep and rep.kv_total_blocks else "-"
        lines.append(
            f"{up.instance_id:<14} {up.role:<10} {up.host:<8} {state:<8} "
            f"{rep.queued_requests if rep else 0:>5} {rep.running_requests if rep else 0:>4} "
            f"{kv:>13} {rep.dram_blocks if rep else 0:>6} {rep.ssd_blocks if rep else 0:>6} "
            f"{up.attention_backend or '-':<15} {_age(age):>6}"
        )
    if len(lines) == 1:
        lines.append("(no instances in the log)")
    lines.extend(group_lines(rows))
    lines.extend(block_size_warnings(rows))
    return "\n".join(lines)


def group_lines(rows: dict[str, InstanceRow]) -> list[str]:
    """One line per prefill group: its stages' layers in order, and whether the
    stages not down cover every layer (only then can the conductor plan on it)."""
    groups: dict[str, list[ev.InstanceUp]] = {}
    for row in rows.values():
        if row.up.role == "prefill" and row.up.group and not row.down:
            groups.setdefault(row.up.group, []).append(row.up)
    lines = []
    for name, stages in sorted(groups.items()):
        stages.sort(key=lambda up: (up.layer_start, up.instance_id))
        covered = 0
        for up in stages:
            if up.layer_start == covered:
                covered = max(covered, up.layer_end)
        layers = stages[0].num_layers
        chain = " -> ".join(f"{up.instance_id} [{up.layer_start}, {up.layer_end})" for up in stages)
        state = "runs" if layers and covered == layers else f"layers {covered}+ uncovered"
        lines.append(
            f"prefill group {name}: {chain} of {layers} layers, "
            f"{stages[0].chunk_tokens}-token chunks: {state}"
        )
    return lines


def block_size_warnings(rows: dict[str, InstanceRow]) -> list[str]:
    """A warning when the live instances announce different block sizes: prefix
    hashes, the index and every page must use one (`ModelConfig.block_size`), and a
    process that resolved its own on another machine breaks reuse silently."""
    sizes: dict[int, list[str]] = {}
    for row in rows.values():
        if not row.down and row.up.block_size:
            sizes.setdefault(row.up.block_size, []).append(row.up.instance_id)
    if len(sizes) < 2:
        return []
    parts = "; ".join(f"{size}: {', '.join(sorted(ids))}" for size, ids in sorted(sizes.items()))
    return [
        f"WARNING: instances disagree on model.block_size ({parts}); every process of a "
        "cluster must use one (set YB_MODEL__BLOCK_SIZE everywhere)"
    ]


def _age(seconds: float) -> str:
    if seconds == float("inf"):
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"
