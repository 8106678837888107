"""The conductor as a pure function of the ordered log: `apply(seq, event) -> decisions`.

For an admission it decides on the spot, from the state folded so far, and accounts
the decision's load at once, so the next admission sees it. When the recorded
decision comes by later in the log, it is checked against the one computed here: in
a live conductor they are the same object; in a replay a difference is a divergence,
and the recorded decision wins (the log is the truth), so the state stays the one the
live conductor had.
"""

from __future__ import annotations

from dataclasses import dataclass

from yb_conductor.policy import Decision, Policy
from yb_conductor.state import ClusterState
from yb_shared import events as ev


@dataclass(frozen=True, slots=True)
class Divergence:
    """A recorded decision that this conductor would have made differently."""

    seq: int
    request_id: str
    recorded: Decision
    recomputed: Decision | None


class Conductor:
    """Folds events and makes decisions; owns no I/O."""

    def __init__(self, policy: Policy, *, heartbeat_timeout_s: float = 15.0) -> None:
        self.policy = policy
        self.state = ClusterState(heartbeat_timeout_s=heartbeat_timeout_s)
        self.last_seq = 0
        # Decisions computed here whose recorded copy has not been seen yet.
        self.unrecorded: dict[str, Decision] = {}
        self.divergences: list[Divergence] = []

    def apply(self, seq: int, event: ev.AnyEvent) -> list[Decision]:
        """Fold the event at stream sequence `seq`; return the decisions it calls for.

        Events at or below the last applied sequence are redeliveries and ignored.
        """
        if seq and seq <= self.last_seq:
            return []
        if seq:
            self.last_seq = seq
        match event:
            case ev.RequestAdmitted():
                self.state.apply(event)
                if event.request_id in self.state.placements:
                    return []  # decided already (a retried admission)
                decision = self.policy.decide(self.state, event, seq)
                if isinstance(decision, ev.RequestScheduled):
                    self.state.place(decision)
                self.unrecorded[event.request_id] = decision
                return [decision]
            case ev.RequestScheduled() | ev.RequestRejected():
                self._recorded(seq, event)
                self.state.apply(event)
                return []
            case _:
                self.state.apply(event)
                return []

    def _recorded(self, seq: int, recorded: Decision) -> None:
        mine = self.unrecorded.pop(recorded.request_id, None)
        if mine == recorded:
            return
        self.divergences.append(Divergence(seq, recorded.request_id, recorded, mine))
        # The log is the truth: replace our accounting with the recorded decision's.
        if isinstance(mine, ev.RequestScheduled):
            self.state.unplace(recorded.request_id)
