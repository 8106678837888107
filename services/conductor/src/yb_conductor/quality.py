"""Decision-quality figures, folded from decisions and completions.

Two questions an operator asks of a scheduler, answered as counters the service
exports (and `yb replay` prints):

- did it reuse what it could? Per decision, the blocks it planned to reuse against
  the longest prefix held anywhere (`best_blocks`); a deliberate recompute (cheaper
  than loading) shows up here too, which is the point: the gap is visible;
- were its estimates right? After each completion, the measured TTFT and mean TBT
  against the estimates the decision carried (ratios, and absolute errors).

Counters per branch (local, transfer, recompute) and per refusal code.
"""

from __future__ import annotations

import msgspec

from yb_conductor.state import Outcome
from yb_core import events as ev


class DecisionQuality(msgspec.Struct, kw_only=True):
    """Running totals; pure data (snapshotted with the conductor)."""

    decisions: int = 0
    scheduled: int = 0
    rejected: int = 0
    branches: dict[str, int] = msgspec.field(default_factory=dict)
    reject_codes: dict[str, int] = msgspec.field(default_factory=dict)
    reused_blocks: int = 0
    best_blocks: int = 0
    best_reached: int = 0
    with_prefix: int = 0
    outcomes: int = 0
    ttft_ratio_sum: float = 0.0
    tbt_ratio_sum: float = 0.0
    ttft_abs_error_sum: float = 0.0
    tbt_abs_error_sum: float = 0.0

    def record(self, decision: ev.Decision) -> None:
        """Count one decision."""
        self.decisions += 1
        explain = decision.explain
        if isinstance(decision, ev.RequestRejected):
            self.rejected += 1
            code = reject_code(decision.reason)
            self.reject_codes[code] = self.reject_codes.get(code, 0) + 1
            return
        self.scheduled += 1
        branch = explain.branch if explain and explain.branch else "unexplained"
        self.branches[branch] = self.branches.get(branch, 0) + 1
        best = explain.best_blocks if explain else decision.reused_blocks
        self.reused_blocks += decision.reused_blocks
        self.best_blocks += max(best, decision.reused_blocks)
        if best:
            self.with_prefix += 1
            if decision.reused_blocks >= best:
                self.best_reached += 1

    def record_outcome(self, outcome: Outcome) -> None:
        """Compare one completion with its estimates."""
        self.outcomes += 1
        if outcome.est_ttft_s > 0 and outcome.ttft_s > 0:
            self.ttft_ratio_sum += outcome.ttft_s / outcome.est_ttft_s
        self.ttft_abs_error_sum += abs(outcome.ttft_s - outcome.est_ttft_s)
        if outcome.est_tbt_s > 0 and outcome.tbt_s > 0:
            self.tbt_ratio_sum += outcome.tbt_s / outcome.est_tbt_s
        self.tbt_abs_error_sum += abs(outcome.tbt_s - outcome.est_tbt_s)

    @property
    def reuse_ratio(self) -> float:
        """Blocks reused over the best reuse available, over all decisions."""
        return self.reused_blocks / self.best_blocks if self.best_blocks else 1.0

    def summary(self) -> dict[str, float | int]:
        """A flat dict for tables and JSON."""
        n = max(1, self.outcomes)
        out: dict[str, float | int] = {
            "decisions": self.decisions,
            "scheduled": self.scheduled,
            "rejected": self.rejected,
            "reused_blocks": self.reused_blocks,
            "best_blocks": self.best_blocks,
            "reuse_ratio": round(self.reuse_ratio, 4),
            "outcomes": self.outcomes,
            "ttft_actual_over_estimate": round(self.ttft_ratio_sum / n, 4),
            "tbt_actual_over_estimate": round(self.tbt_ratio_sum / n, 4),
        }
        for branch, count in sorted(self.branches.items()):
            out[f"branch_{branch}"] = count
        for code, count in sorted(self.reject_codes.items()):
            out[f"rejected_{code}"] = count
        return out


def reject_code(reason: str) -> str:
    """The refusal code: the first word of a rejection's reason."""
    head = reason.split(":", 1)[0].strip()
    return head if head and " " not in head else "other"
