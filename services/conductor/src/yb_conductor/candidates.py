"""Which instances a decision must evaluate: the ones that can win.

Algorithm 1 prices every prefill instance for every request; at a thousand instances
that is most of a decision's time. Most of them, though, are alike: no prefix of the
request anywhere on their host and nothing queued. Such a *quiet non-holder* takes
the one "best option" every non-holder shares (work `w` at the cost model's speed)
with no queue, so its TTFT is exactly `0.0 + w * f`, `f` its learned slowdown alone
(`InstanceSpeed.solo`, 1.0 before it has learned anything). Those TTFTs rank as the
instances rank by `f`: `w * f` is monotone in `f` in floating point too.

So a decision evaluates, exactly as before:
- every holder (an engine holding the prefix or computing it, `pending_prefixes`;
  every prefill engine on a host whose kvstore holds it): their estimates are their
  own;
- every instance that may have a queue (`may_be_queued`): its TTFT depends on it;
- the quiet non-holders in (`f`, id) order until `keep` of them are taken and the
  next one's `w * f` is larger than the last taken one's.

The bound that makes it exact: an instance left out is a quiet non-holder whose
TTFT is strictly greater than that of at least `keep` evaluated ones, so it is
neither the fastest nor among the `keep` fastest, ties included (ties go to the
lower id, and a tie with the last taken is taken too). The decision, the candidate
table of the explanation (its best `keep - 1` besides the chosen one) and every
figure in them are the full scan's, to the bit.

With prefix stickiness the pick is by TTFT plus a copy cost that every quiet
non-holder pays alike, ties going to the instance idle longest rather than the
lowest id. The one quiet non-holder that can be picked is then the first quiet
entry, among the lowest slowdown, of a second order kept beside the first:
(slowdown, `busy_until` when last found drained, id). An instance whose
`busy_until` moves is marked as possibly queued first, so a quiet instance's entry
is always its current `busy_until`. It is evaluated too; the table is the TTFT's,
as above.

What it assumes: the slowdown of a quiet engine is its `solo` alone, so only when
engines do not share compute (`compute_sharing = "none"`, the default) or speed is
not learned; otherwise the planner scans every instance.

Decode placement is alike: a decode instance with nothing assigned (and no KV or
request left accounted there) predicts a batch of one, the same TBT as every other
such instance, and the smallest assigned count; of those only the first by id can be
chosen, and their figures in the explanation are that one TBT. So the decode
planner works out only the instances that may have work (`decode_busy`), and the
first idle one, provided the request fits every instance's KV (else it looks at
each).

The structures change with the state, never per decision: the speed order is kept
sorted as engines learn (one bisect per completed prefill) and the set of possibly
queued instances grows when a request is placed and shrinks lazily, when a decision
finds an instance drained. Both are rebuilt from the state when its instances or
speeds were replaced wholesale (a snapshot restored).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from yb_conductor.speed import InstanceSpeed

# Pools of at most this many instances are evaluated whole: the candidate sets
# cost more than they save there. Where each one pays, timing one planner pruned
# and whole with the other whole (`benchmarks/conductor.py --compare --prune-above
# 0,100000 --shapes 80x20,96x24`, then `100000,0 --shapes 64x32,64x64`): 64 prefill
# instances decide 0.6 to 3% faster whole, 80 3% slower; 32 decode instances 4%
# faster whole, 64 4% slower.
PREFILL_PRUNE_ABOVE = 64
DECODE_PRUNE_ABOVE = 48


Instance = TypeVar("Instance")


def still_busy(
    members: dict[str, None],
    instances: Mapping[str, Instance],
    busy: Callable[[Instance], bool],
    positions: Mapping[str, int],
    on_idle: Callable[[Instance], None] | None = None,
) -> list[int]:
    """The positions of the members of a "may be busy" set that still are, in
    order; those found idle (or gone) leave the set, and `on_idle` is told of
    each one found idle."""
    drained = []
    found = []
    for instance_id in members:
        inst = instances.get(instance_id)
        if inst is None or not busy(inst):
            drained.append(instance_id)
            if inst is not None and on_idle is not None:
                on_idle(inst)
            continue
        i = positions.get(instance_id)
        if i is not None:
            found.append(i)
    for instance_id in drained:
        del members[instance_id]
    found.sort()
    return found


def solo_factor(speed: InstanceSpeed | None) -> float:
    """An engine's slowdown alone: what `speed.slowdown` gives with no other busy."""
    return speed.solo if speed is not None else 1.0


def _factor(entry: tuple[float, str] | tuple[float, float, str]) -> float:
    return entry[0]


Key = TypeVar("Key", tuple[float, str], tuple[float, float, str])


def _rekey(entries: list[Key], keys: dict[str, Key], instance_id: str, key: Key) -> None:
    """Move an instance's entry in a sorted list to `key` (or add it)."""
    old = keys.get(instance_id)
    if old == key:
        return
    if old is not None:
        del entries[bisect.bisect_left(entries, old)]
    bisect.insort(entries, key)
    keys[instance_id] = key


class Candidates:
    """Prefill instances in order of their slowdown alone, those that may be queued,
    and the decode instances that may have work (see the module docstring)."""

    def __init__(self) -> None:
        # (factor, instance id), sorted; and each id's current key.
        self._by_speed: list[tuple[float, str]] = []
        self._key: dict[str, tuple[float, str]] = {}
        # (factor, idle since, instance id), sorted, and each id's current key: the
        # order in which prefix stickiness breaks ties among quiet instances. "Idle
        # since" is the instance's `busy_until` when it was last found drained (an
        # instance whose `busy_until` moves is queued first, see `queued`).
        self._by_idle: list[tuple[float, float, str]] = []
        self._idle_key: dict[str, tuple[float, float, str]] = {}
        # Instances whose queue may be non-empty or whose busy_until may be ahead of
        # now: a superset, pruned when a decision finds one drained.
        self.may_be_queued: dict[str, None] = {}
        # Decode instances that may have requests assigned, KV or requests accounted:
        # a superset likewise.
        self.decode_busy: dict[str, None] = {}
        # The state's dicts this was built from (a restored snapshot replaces them).
        self._instances: object = None
        self._speeds: object = None

    def indexes(self, instances: Mapping[str, object], speeds: Mapping[str, InstanceSpeed]) -> bool:
        """Whether these are the state's dicts this was built from (else `sync`)."""
        return instances is self._instances and speeds is self._speeds

    def sync(
        self,
        instances: Mapping[str, object],
        speeds: Mapping[str, InstanceSpeed],
        prefill_ids: Iterator[tuple[str, bool, float]],
        busy_decode_ids: Iterator[str] = iter(()),
    ) -> None:
        """Rebuild from the state if its dicts are not the ones indexed.

        `prefill_ids`: every prefill instance's id, whether it may be queued, and
        its `busy_until`; `busy_decode_ids`: the decode instances with work.
        """
        if instances is self._instances and speeds is self._speeds:
            return
        self._instances, self._speeds = instances, speeds
        self._by_speed, self._key, self.may_be_queued = [], {}, {}
        self._by_idle, self._idle_key = [], {}
        self.decode_busy = dict.fromkeys(busy_decode_ids)
        for instance_id, queued, busy_until in prefill_ids:
            self.set_speed(instance_id, solo_factor(speeds.get(instance_id)))
            self.set_idle_since(instance_id, busy_until)
            if queued:
                self.may_be_queued[instance_id] = None

    def set_speed(self, instance_id: str, factor: float) -> None:
        """Index a prefill instance (or its new slowdown alone)."""
        _rekey(self._by_speed, self._key, instance_id, (factor, instance_id))
        idle = self._idle_key.get(instance_id)
        since = idle[1] if idle else 0.0
        _rekey(self._by_idle, self._idle_key, instance_id, (factor, since, instance_id))

    def set_idle_since(self, instance_id: str, since: float) -> None:
        """The instance was found drained with this `busy_until`."""
        speed = self._key.get(instance_id)
        factor = speed[0] if speed else 1.0
        _rekey(self._by_idle, self._idle_key, instance_id, (factor, since, instance_id))

    def queued(self, instance_id: str) -> None:
        """The instance may have a queue now (a request was placed or re-timed there)."""
        self.may_be_queued[instance_id] = None

    def by_speed(self) -> Iterator[tuple[float, str]]:
        """Every indexed prefill instance, fastest alone first (then by id)."""
        return iter(self._by_speed)

    def by_idle(self) -> list[tuple[float, float, str]]:
        """Every indexed prefill instance as (slowdown alone, idle since, id), in that
        order (the list itself: read it, do not change it)."""
        return self._by_idle

    def next_factor(self, factor: float) -> float | None:
        """The smallest indexed slowdown above `factor` (None: none is)."""
        # (the next float up,) sorts before every entry of that slowdown or more.
        at = bisect.bisect_left(self._by_speed, (math.nextafter(factor, math.inf),))
        return self._by_speed[at][0] if at < len(self._by_speed) else None
