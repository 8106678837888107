"""`yb explain <request-id>`: why the conductor decided what it did for one request.

    yb explain REQUEST_ID [--file LOG | --nats URL | --data-dir DIR] [--full] [--json]
    yb explain planner [--file LOG | ...] [--full] [--json]

The decision event carries its explanation (the best prefill candidates by
estimated TTFT, every decode instance, the branch and the reason), so explaining
needs no recomputation. `--full` recomputes the decision from the log with every
prefill instance in the table, which needs the log from seq 1: on a log whose head
was trimmed (`nats.max_bytes`) it says so and shows the recorded table.

`yb explain planner` shows the planner's decisions (`PoolPlanned`) that asked for an
action, each with what it forecast and each pool's size, need and target (`--full`:
every decision, also those that changed nothing).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from yb_core import events as ev
from yb_core.config import YbConfig
from yb_tools.cli.replay import add_source_args, load_log


def add_parser(sub: Any) -> None:
    """Register `yb explain`."""
    p = sub.add_parser("explain", help="the candidate table and reason behind one decision")
    p.add_argument("request_id", help="a request's id, or `planner` for the pools' planner")
    add_source_args(p)
    p.add_argument("--full", action="store_true", help="recompute with every candidate")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")


def render(seq: int, decision: ev.Decision, admitted: ev.RequestAdmitted | None = None) -> str:
    """The decision and its explanation as text tables; with its admission, the
    request's tier and priority, and whether it is a batch line."""
    lines = []
    x = decision.explain
    est = decision.estimates
    if isinstance(decision, ev.RequestScheduled):
        head = (
            f"request {decision.request_id}: SCHEDULED at seq {seq} "
            f"(admitted at seq {decision.admitted_seq}, policy {decision.policy})\n"
            f"  prefill {decision.prefill_instance}, decode {decision.decode_instance}; "
            f"reuses {decision.reused_blocks} blocks, computes {decision.computed_tokens} "
            f"of {decision.prompt_tokens} tokens"
        )
        if decision.piggyback:
            head += f"\n  prefilled inside {decision.decode_instance}'s decode batch (piggyback)"
        if decision.prefill_stages:
            head += (
                f"\n  prefill group: {len(decision.prefill_stages)} pipeline stages, "
                f"{' -> '.join(decision.prefill_stages)}"
            )
    else:
        head = (
            f"request {decision.request_id}: REJECTED at seq {seq} "
            f"(admitted at seq {decision.admitted_seq}, policy {decision.policy})\n"
            f"  reason: {decision.reason}; Retry-After {decision.retry_after_s:g}s"
        )
    lines.append(head)
    if admitted is not None:
        lines.append(f"  {describe_request(admitted)}")
    lines.append(
        f"  estimates: TTFT {est.ttft_s:.4f}s = queue {est.queue_s:.4f} + transfer "
        f"{est.transfer_s:.4f} + prefill {est.prefill_s:.4f}; TBT {est.tbt_s:.4f}s "
        f"at batch {est.decode_batch}"
    )
    if isinstance(decision, ev.RequestScheduled) and decision.reuse:
        plan = ", ".join(
            f"[{r.first_block}..{r.first_block + r.num_blocks}) from {r.source_instance} ({r.tier})"
            for r in decision.reuse
        )
        lines.append(f"  reuse plan: {plan}")
    if x is None:
        lines.append("  (no explanation recorded: decided by a policy that keeps none)")
        return "\n".join(lines)
    lines.append(
        f"  branch: {x.branch}; admission: {x.admission}; limits TTFT {x.ttft_limit_s:g}s, "
        f"TBT {x.tbt_limit_s:g}s; best prefix anywhere: {x.best_blocks} blocks"
        + (f" on {x.best_source}" if x.best_source else "")
    )
    lines.append(f"  why: {x.reason}")
    lines.append("")
    # A stages column only where a prefill group was weighed (groups are rare).
    grouped = any(c.stages for c in x.candidates)
    lines.append(
        f"  {'prefill':<16} {'option':<9} {'local':>5} {'best':>5} {'reuse':>5} "
        f"{'source':<14} {'queue_s':>8} {'xfer_s':>8} {'prefill_s':>9} {'ttft_s':>8}"
        + (f" {'stages':>6}" if grouped else "")
    )
    for i, c in enumerate(x.candidates):
        mark = "*" if i == 0 and isinstance(decision, ev.RequestScheduled) else " "
        lines.append(
            f"{mark} {c.instance_id:<16} {c.option:<9} {c.local_blocks:>5} {c.best_blocks:>5} "
            f"{c.reuse_blocks:>5} {c.source or '-':<14} {c.queue_s:>8.4f} {c.transfer_s:>8.4f} "
            f"{c.prefill_s:>9.4f} {c.ttft_s:>8.4f}" + (f" {c.stages or 1:>6}" if grouped else "")
        )
    if x.decode_candidates:
        lines.append("")
        lines.append(f"  {'decode':<16} {'batch now':>9} {'predicted':>9} {'tbt_s':>8}")
        chosen = decision.decode_instance if isinstance(decision, ev.RequestScheduled) else ""
        for d in x.decode_candidates:
            mark = "*" if d.instance_id == chosen else " "
            lines.append(
                f"{mark} {d.instance_id:<16} {d.batch:>9} {d.predicted_batch:>9} {d.tbt_s:>8.4f}"
            )
    return "\n".join(lines)


def describe_request(admitted: ev.RequestAdmitted) -> str:
    """What the admission says of the request: its tier, priority and SLO, and, for a
    batch line, when it is due."""
    tier = admitted.service_tier or "default"
    text = (
        f"tier {tier} (priority {admitted.priority}; SLO TTFT {admitted.slo.ttft_s:g}s, "
        f"TBT {admitted.slo.tbt_s:g}s)"
    )
    if admitted.batch:
        due = max(0.0, admitted.batch_deadline - admitted.time) if admitted.batch_deadline else 0
        text += f"; a Batch API line, due in {due:.0f}s"
    return text


def render_plan(seq: int, plan: ev.PoolPlanned) -> str:
    """One planner decision as a text table."""
    f = plan.forecast
    lines = [
        f"seq {seq}, t={plan.time:.1f}: planner {plan.planner_id}, budget {plan.max_instances}",
        f"  forecast: {f.arrival_rate:.3f} req/s over {f.window_s:g}s -> {f.forecast_rate:.3f} "
        f"req/s in {f.lead_s:g}s; prompt {f.prompt_tokens:g} tokens (computed "
        f"{f.computed_tokens:g}), output {f.output_tokens:g}",
        f"  {'pool':<8} {'serving':>7} {'starting':>8} {'draining':>8} {'needs':>7} "
        f"{'target':>6}  held by",
    ]
    for p in plan.pools:
        lines.append(
            f"  {p.role:<8} {p.current:>7} {p.starting:>8} {p.draining:>8} {p.needed:>7.2f} "
            f"{p.target:>6}  {p.held_by or '-'}"
        )
    for a in plan.actions:
        what = a.instance_id + (f" to {a.role}" if a.action == "move" else "")
        lines.append(f"  action: {a.action} {what or a.role}")
    return "\n".join(lines)


def _explain_planner(records: list[Any], args: argparse.Namespace) -> int:
    from yb_conductor.replay import to_json

    plans = [
        (r.seq, r.event)
        for r in records
        if isinstance(r.event, ev.PoolPlanned) and (args.full or r.event.actions)
    ]
    if not plans:
        print(
            "yb explain: no planner decision in the log" + ("" if args.full else " with an action")
        )
        return 1
    for seq, plan in plans:
        print(to_json(plan) if args.json else render_plan(seq, plan))
    return 0


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb explain`."""
    from yb_conductor.replay import find_decision, recompute_decision, to_json
    from yb_conductor.settings import RecordedSettingsError
    from yb_core.bus import BusUnavailable

    try:
        loaded = load_log(cfg, args)
    except (OSError, BusUnavailable) as exc:
        print(f"yb explain: cannot read the log: {exc}", file=sys.stderr)
        return 1
    records = loaded.records
    if args.request_id == "planner":
        return _explain_planner(records, args)
    found = find_decision(records, args.request_id)
    if found is None:
        gone = f" ({loaded.gone()}: an older decision is gone)" if loaded.trimmed else ""
        print(f"yb explain: no decision for request {args.request_id!r} in the log{gone}")
        return 1
    seq, decision = found
    if args.full and loaded.trimmed:
        print(
            f"yb explain: {loaded.gone()}: --full recomputes from seq 1, so this is the "
            "recorded table",
            file=sys.stderr,
        )
    elif args.full:
        try:
            full = recompute_decision(records, args.request_id, top_k=0)
        except RecordedSettingsError as exc:
            print(f"yb explain: {exc}", file=sys.stderr)
            return 1
        if full is not None:
            decision = full
    admitted = next(
        (
            r.event
            for r in records
            if r.seq == decision.admitted_seq and isinstance(r.event, ev.RequestAdmitted)
        ),
        None,
    )
    print(to_json(decision) if args.json else render(seq, decision, admitted))
    return 0
