"""The best fixed split of a budget of instances into prefill and decode, with
hindsight: the baseline an elastic planner is measured against.

`static_splits` plays one workload at every split of `budget` instances (at least
one of each role) with everything else equal, and `best_static_split` picks the one
a user would have chosen knowing the whole trace: the most goodput, then the best
SLO attainment, then the lowest mean TTFT. Each split holds its instances for the
whole run, so its instance-hours are the budget times the run's simulated length.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from yb_conductor.cost_model import CostModel
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem


@dataclass(frozen=True, slots=True)
class SplitResult:
    """One split's run."""

    prefill: int
    decode: int
    result: PolicyResult

    @property
    def label(self) -> str:
        """`P<prefill>/D<decode>`."""
        return f"P{self.prefill}/D{self.decode}"

    @property
    def instance_hours(self) -> float:
        """Instances held, times the run's simulated length, in hours."""
        return (self.prefill + self.decode) * self.result.simulated_s / 3600.0


def static_splits(
    items: list[TraceItem],
    params: SimParams,
    cost: CostModel,
    budget: int,
    *,
    policy: str = "mooncake",
    admission: str = "predicted",
) -> list[SplitResult]:
    """`items` played at every split of `budget` instances, fewest prefill first.
    ValueError for a budget below two (a split needs one instance of each role)."""
    if budget < 2:
        raise ValueError(f"a budget of {budget} instance(s) cannot hold a prefill and a decode")
    out = []
    for prefill in range(1, budget):
        split = msgspec.structs.replace(params, prefill=prefill, decode=budget - prefill)
        sim = Simulation(
            items, split, cost, policy=policy, admission=admission, label=f"P{prefill}"
        )
        out.append(SplitResult(prefill, budget - prefill, sim.run()))
    return out


def best_static_split(splits: list[SplitResult]) -> SplitResult:
    """The split chosen with hindsight: most goodput, then SLO attainment, then the
    lowest mean TTFT."""
    return max(
        splits,
        key=lambda s: (s.result.goodput_rps, s.result.slo_attainment, -s.result.ttft_mean_s),
    )
