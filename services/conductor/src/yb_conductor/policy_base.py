"""What every placement policy shares: the protocol, a decision with its predictions,
a rejection.

Kept apart from `policy` (which registers every policy by name) so that policies in
modules of their own (`baselines`) can build on it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from yb_conductor.admission import Verdict
from yb_conductor.cost_model import CostModel
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig


@dataclass(slots=True)
class Decided:
    """A decision and the events published with it (load predictions)."""

    decision: ev.Decision
    predictions: list[ev.LoadPrediction]


class Policy(Protocol):
    """What the conductor asks of a placement policy."""

    name: str
    cost: CostModel

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """The decision for `request`, admitted at stream sequence `seq`."""
        ...


# How a policy is built from the settings (and a cost model overriding theirs).
PolicyFactory = Callable[[ConductorConfig | None, CostModel | None], Policy]


def reject(
    request: ev.RequestAdmitted,
    seq: int,
    policy: str,
    verdict: Verdict,
    estimates: ev.Estimates | None = None,
    explain: ev.Explanation | None = None,
) -> ev.RequestRejected:
    """A rejection carrying the verdict's reason and Retry-After."""
    return ev.RequestRejected(
        time=request.time,
        request_id=request.request_id,
        gateway_id=request.gateway_id,
        reason=verdict.reason,
        retry_after_s=verdict.retry_after_s,
        estimates=estimates or ev.Estimates(),
        policy=policy,
        admitted_seq=seq,
        explain=explain,
    )
