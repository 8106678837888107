"""What only logs recorded by older conductors need: the behaviour version and its switches.

A conductor records the behaviour version it decides by (`BEHAVIOUR_VERSION`) in its
`ConductorConfigured` event and in its snapshots. Some settings exist only so that a
log recorded before today's behaviour replays decision for decision: each is a
`Switch`, listed in `SWITCHES`, whose `old` value reproduces how conductors decided
before behaviour version `retired_at`, and whose default is today's rule.

Reading a recorded configuration (`settings.recorded_settings`): a setting the
record does not carry takes `old` when the record's version is below the switch's
`retired_at` (version 0 is a record made before versions existed, which carries no
version at all), and its default otherwise. A setting the record carries is taken as
recorded, whatever its version.

The switches stay settable (`conductor.<name>` in the config file, `yb replay --set
<name>=...` for a what-if run), but they exist for old logs: a new conductor has no
reason to turn today's behaviour off. Each `Switch.keeps` says what the old value
does and where its branch is, so every branch kept for old logs is found from here.

When a change of behaviour needs a switch: add the setting to `ConductorConfig` with
today's rule as its default, add a `Switch` here with the old value and
`retired_at=BEHAVIOUR_VERSION + 1`, and bump `BEHAVIOUR_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: The behaviour version a conductor of this software decides by. 1 is the first
#: version recorded; the switches that predate versions retired at 1. 2: batch
#: lines' prefills are pre-empted, and pending prefixes count by priority. 3: the
#: planner's margin is its forecast's noise, an over-budget split loads the busier
#: pool least, and the decode pool is sized for its occupancy a start time ahead.
#: 4: retention predicts a block's reuse from its class.
BEHAVIOUR_VERSION: Final = 4
#: The version of a record that carries none (written before versions existed).
UNVERSIONED: Final = 0


@dataclass(frozen=True, slots=True)
class Switch:
    """A setting that exists so that logs recorded before `retired_at` replay as recorded.

    `old`: the value that reproduces a conductor of an earlier behaviour version;
    `retired_at`: the behaviour version from which the setting's default is the rule
    (a record of that version or later that lacks the setting takes the default);
    `keeps`: what the old value does, and where its branch is.
    """

    name: str
    old: bool | int | float
    retired_at: int
    keeps: str


SWITCHES: Final[tuple[Switch, ...]] = (
    Switch(
        "learn_speed",
        False,
        1,
        "Estimates straight from the cost model: no per-instance prefill speed, no "
        "first-token lag, no slowdown of engines sharing compute "
        "(`state.ClusterState`: what completions teach, `speed_queue_s`, "
        "`first_token_lag_s`; `prefill_placement.PrefillPlanner.options`).",
    ),
    Switch(
        "priority_order",
        False,
        1,
        "Every queue priced in arrival order, as before engines ran their queues by "
        "priority (`prefill_placement.PrefillPlanner`, `decode_placement.DecodePlanner`, "
        "`state.ClusterState` queue accounting).",
    ),
    Switch(
        "prefix_stickiness",
        0.0,
        1,
        "The lowest TTFT wins, ties by instance id, with no price on the blocks a "
        "prefix copy evicts; explanations say `lowest TTFT` "
        "(`prefill_placement.CopyCost`, `policy.MooncakePolicy._on_prefill`).",
    ),
    Switch(
        "calibrated_admission",
        False,
        1,
        "Admission judges the raw estimates, and decode KV is accounted whole from the "
        "placement on (`policy.MooncakePolicy._admission`, "
        "`decode_placement.DecodePlanner.choose`).",
    ),
    Switch(
        "eviction_regret",
        False,
        1,
        "Every block a prefix copy evicts counts as one its next request computes "
        "again (`prefill_placement.CopyCost`).",
    ),
    Switch(
        "explain_decode_top_k",
        0,
        1,
        "Explanations list every decode instance (`decode_placement.DecodePlanner.table`).",
    ),
    Switch(
        "admit_unqueued_overrun",
        False,
        1,
        "A request that misses its TTFT SLO with nothing queued ahead of it is refused "
        "(`admission.AdmissionPolicy`).",
    ),
    Switch(
        "kv_reserved_at_start",
        False,
        1,
        "Decode pages counted as taken at the prefill's end, not its start "
        "(`decode_placement.DecodePlanner.choose`, `state.ClusterState` KV accounting).",
    ),
    Switch(
        "prefix_load_overlap",
        False,
        1,
        "A prefix load and the prefill's compute add up instead of overlapping layer "
        "by layer (`prefill_placement.PrefillPlanner`).",
    ),
    Switch(
        "learn_from_cut_short",
        True,
        1,
        "A request cut short for lack of decode KV teaches decode time and output "
        "length like any completion (`state.ClusterState` completion learning).",
    ),
    Switch(
        "pending_prefixes",
        False,
        1,
        "Only stored blocks count as held; a prefix a queued prefill is computing does "
        "not (`prefill_placement.PrefillPlanner.view`, `candidates`).",
    ),
    Switch(
        "decode_now_floor",
        False,
        1,
        "Under `predicted` admission the prediction alone decides, without the test "
        "of the batch decoding now (`admission.AdmissionPolicy`).",
    ),
    Switch(
        "retention",
        False,
        1,
        "No retention advice: each kvstore evicts by its own policy alone (`retention.Retention`).",
    ),
    Switch(
        "decode_kv_peak",
        False,
        1,
        "A decode instance is judged by the budget of every request there at once, "
        "not by the projected peak of what they hold (`decode_placement`, "
        "`state.ClusterState.held_blocks_now`).",
    ),
    Switch(
        "pending_by_priority",
        False,
        2,
        "No pending prefix counts for any request while one of a lower priority is "
        "placed (`prefill_placement.PrefillPlanner.view`).",
    ),
    Switch(
        "batch_preemption",
        False,
        2,
        "A batch line's prefill that runs is never overtaken, as before engines paused "
        "it for work of a higher priority (`prefill_placement.overtaken_s`, "
        "`state.ClusterState._overtake`).",
    ),
    Switch(
        "planner_rate_sigmas",
        0.0,
        3,
        "The forecast rule runs each instance at `planner_utilization` instead of "
        "adding a margin for the forecast's noise (`planner.Planner._forecast_needs`).",
    ),
    Switch(
        "planner_balanced_share",
        False,
        3,
        "Over budget, the pools share it in proportion to their needs, rounded (`planner._share`).",
    ),
    Switch(
        "planner_decode_trend",
        False,
        3,
        "The decode pool holds the requests decoding now, not as many as they will "
        "be a start time ahead (`planner.Planner._forecast_needs`).",
    ),
    Switch(
        "retention_by_class",
        False,
        4,
        "Retention predicts a block's reuse from its own gaps and, for a new block, "
        "from all new blocks, without its class (`retention.Retention.interval`).",
    ),
)


def absent_means(behaviour: int) -> dict[str, bool | int | float]:
    """The value of each setting a record of behaviour version `behaviour` does not
    carry and that must not take its default: the old value of every switch retired
    after that version."""
    return {s.name: s.old for s in SWITCHES if behaviour < s.retired_at}
