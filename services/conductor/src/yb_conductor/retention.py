"""Retention: which blocks the pool keeps, decided where every prefix is seen.

Each kvstore alone can only order its blocks by its own recency (LRU). The conductor
sees every request's chain, so for every block it knows how many requests used its
prefix, when last and how long apart, and what share of the blocks that appear for
the first time are ever asked for again. From that it predicts, for each block of a
placed request, the time between its uses, from:

- its class: how many requests used it (up to 8) and how many used the head of its
  chain (up to 8). For each class the log teaches the share of its uses that were
  followed by another, and the mean time to it. The head's count tells a chain's
  story: a conversation's blocks all follow its head, and the more turns it has
  had, the likelier it is over; the unique questions after a shared system prompt
  follow a head used hundreds of times, and are rarely asked again;
- the time between its uses `g`: once it was reused, its own mean gap (a shared
  system prompt asked every few seconds is worth more than one asked every few
  minutes), shrunk towards the mean gap of all blocks while it has few gaps to its
  name; a new block, its class's mean time to a reuse;
- its interval is `g` times the log-odds against another use plus a half, and
  never below zero: a block of a class used again more than 62% of the time keeps
  its own age, which is plain LRU among them, and the rarer its class is reused,
  the older it counts. A new block of a class reused less often than
  `retention_drop_below` is **dropped** first instead;
- a block is worth at least any block after it in its chain (a block without its
  prefix is worthless): the intervals are a running minimum from the tail, so only
  a tail is ever dropped;
- a block the request pulls from another host's kvstore, whose prefix is not hot
  (wanted about `hot_demand` times in `hot_window_s`), is **demoted** first on this
  host: the copy saves a transfer, the original a recompute.

The blocks the request will read, by its reuse plan, are **needed**: each kvstore
they are read from keeps them over every other block until they are read (or for
twice the predicted TTFT and `_NEEDED_SLACK_S` more). A request that waits in a queue
then finds the prefix it was placed for; on Mooncake's trace, whose prefills queue
for seconds, this is much of what separates LRU from Belady's bound.

The advice goes, with the decision, to the kvstore on the host where the request's
blocks will be stored, and a `needed` list to every other kvstore the request reads
from (`RetentionPlanned`). The store evicts marked blocks first
(drop, then demote), then by recency where a block predicted to be reused every `g`
seconds counts as `g` seconds older than it is: an unmarked block keeps its age,
which is plain LRU. It is advice, not an order: a store evicts only when it must make
room.

Everything here is a pure function of the log in event time: integer counts and
float means folded in log order, insertion-ordered dicts, no wall clock. The
statistics are bounded (`_MAX_TRACKED` blocks, the least recently used forgotten);
a forgotten block counts as new when it comes back.
"""

from __future__ import annotations

import math

import msgspec

from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

_MAX_TRACKED = 500_000
# The share of reused first-seen blocks is learnt over about this many first sightings
# (both counts are halved when the first passes twice this), so it follows a workload
# that changes.
_SHARE_WINDOW = 50_000
# How quickly a block's mean gap between uses follows its latest gap.
_GAP_ALPHA = 0.3
# How quickly the mean time to a new block's first reuse follows each one (over many
# blocks: a slow average).
_LOG_ALPHA = 0.01
# A class counts its blocks' uses up to this many, and its chain head's.
_CLASS_USES = 8
# A class's share of uses followed by another is learnt over about this many of its
# uses (both counts are halved when the first passes twice this).
_CLASS_WINDOW = 10_000
# The log-odds against another use at which a block starts to count older than it
# is (a share of 1 / (1 + e^-0.5), 0.62): blocks reused more often than that are
# ordered by recency alone. Chosen on `benchmarks/sim_retention.py` over four jitter
# and workload seeds; 0 and 1 were within a few points of it on every workload.
_ODDS_OFFSET = 0.5
# A block's own mean gap counts against every block's as this many gaps: a block
# used a few times has a noisy mean (a conversation's think times are all alike,
# however different the few seen), one used often has its own.
_PRIOR_GAPS = 3.0
# Blocks a placed request will read are kept until read or for twice its predicted
# TTFT and this much more (a request that never reads them, re-planned or failed,
# must not hold them for long).
_NEEDED_SLACK_S = 5.0


class BlockUses(msgspec.Struct, array_like=True, gc=False):
    """What the log showed of one block: requests that used it, the event time of
    the latest, the mean time between uses (0 until used twice), and its class at
    the latest use (`_class`; -1 in statistics a version-3 conductor kept)."""

    uses: int
    last: float
    gap: float = 0.0
    cls: int = -1


class Retention(msgspec.Struct, kw_only=True):
    """Per-block use statistics; what the log taught of new blocks: how many
    appeared, how many of those were used a second time, and the mean time to it;
    the mean gap between uses of blocks used before; and per class (`_class`), its
    blocks' uses, how many of them were followed by another, and the mean time to it."""

    blocks: dict[int, BlockUses] = msgspec.field(default_factory=dict)
    first_seen: int = 0
    first_reused: int = 0
    first_gap: float = 0.0
    reuse_gap: float = 0.0
    reuse_gaps: int = 0
    class_uses: dict[int, int] = msgspec.field(default_factory=dict)
    class_reused: dict[int, int] = msgspec.field(default_factory=dict)
    class_gap: dict[int, float] = msgspec.field(default_factory=dict)

    def reuse_share(self) -> float:
        """The share of new blocks used again (a prior of one half)."""
        return (self.first_reused + 1) / (self.first_seen + 2)

    def own_gap(self, seen: BlockUses) -> float:
        """A reused block's mean gap between uses, shrunk towards every block's as if
        that were `_PRIOR_GAPS` more gaps."""
        gaps = seen.uses - 1
        prior = _PRIOR_GAPS if self.reuse_gaps else 0.0
        return (gaps * seen.gap + prior * self.reuse_gap) / (gaps + prior)

    def interval(self, seen: BlockUses) -> float:
        """Version 3's predicted time between the block's uses: once it was reused,
        its own mean gap; for a new block, the mean time to a first reuse over the
        share of new blocks that get one."""
        if seen.uses > 1:
            return self.own_gap(seen)
        return self.first_gap / self.reuse_share()

    def class_share(self, seen: BlockUses) -> float:
        """The share of its class's uses followed by another (a prior of one half),
        below 1: a use counted before the counts were halved may be followed after."""
        uses = self.class_uses.get(seen.cls, 0)
        return (min(self.class_reused.get(seen.cls, 0), uses) + 1) / (uses + 2)

    def class_interval(self, seen: BlockUses) -> float:
        """How much older than it is the block counts: the time between its uses (its
        own once reused, else its class's) times the log-odds against another use
        plus `_ODDS_OFFSET`, at least 0."""
        share = self.class_share(seen)
        if seen.uses > 1:
            gap = self.own_gap(seen)
        else:
            gap = self.class_gap.get(seen.cls, self.reuse_gap or self.first_gap)
        return gap * max(0.0, _ODDS_OFFSET + math.log((1.0 - share) / share))

    def observe(
        self,
        cfg: ConductorConfig,
        state: ClusterState,
        request: ev.RequestAdmitted,
        decision: ev.Decision,
    ) -> list[ev.RetentionPlanned]:
        """Count one placed request's blocks; advise the kvstore that will hold them,
        and every kvstore the request will read its prefix from."""
        if not cfg.retention or not isinstance(decision, ev.RequestScheduled):
            return []
        keys = _stored_keys(request)
        if not keys:
            return []
        share = self.reuse_share()  # as it stood before this request
        uses = self._count(keys, state.now)
        intervals = self._intervals(cfg, share, uses)
        needed = _needed(state, request, decision)
        wait = 2.0 * decision.estimates.ttft_s + _NEEDED_SLACK_S
        needed_s = round(min(cfg.request_timeout_s, wait), 3)
        target = _kvstore_of(state, decision)
        out = [
            ev.RetentionPlanned(
                time=state.now,
                instance_id=source,
                request_id=decision.request_id,
                needed=blocks,
                needed_s=needed_s,
                reason=f"{len(blocks)} block(s) to be read by a placed request",
            )
            for source, blocks in needed.items()
            if source != target
        ]
        if target is None:
            return out
        pulled = self._pulled(cfg, state, decision, target, keys)
        reuse: list[int] = []
        reuse_s: list[float] = []
        demote: list[int] = []
        drop: list[int] = []
        for i, (key, interval) in enumerate(zip(keys, intervals, strict=True)):
            if i < pulled:
                demote.append(key)
            elif interval == math.inf:
                drop.append(key)
            else:
                reuse.append(key)
                reuse_s.append(round(interval, 3))
        mine = needed.get(target, [])
        if not (reuse or demote or drop or mine):
            return out
        out.insert(
            0,
            ev.RetentionPlanned(
                time=state.now,
                instance_id=target,
                request_id=decision.request_id,
                reuse=reuse,
                reuse_s=reuse_s,
                demote=demote,
                drop=drop,
                reason=_reason(reuse_s, demote, drop, uses, mine),
                needed=mine,
                needed_s=needed_s if mine else 0.0,
            ),
        )
        return out

    def _count(self, keys: list[int], now: float) -> list[BlockUses]:
        """Fold one use of each key; their statistics after it, in chain order."""
        blocks = self.blocks
        out: list[BlockUses] = []
        head = blocks.get(keys[0])
        head_uses = 1 if head is None else head.uses + 1
        here: set[int] = set()  # a key twice in one chain is not a reuse of its class
        for key in keys:
            seen = blocks.pop(key, None)
            if seen is not None and seen.cls >= 0 and key not in here:
                self._class_reused(seen.cls, now - seen.last)
            here.add(key)
            if seen is None:
                seen = BlockUses(1, now)
                self.first_seen += 1
            else:
                gap = now - seen.last
                if seen.uses == 1:
                    seen.gap = gap
                    self.first_reused += 1
                    self.first_gap += _LOG_ALPHA * (gap - self.first_gap)
                else:
                    seen.gap += _GAP_ALPHA * (gap - seen.gap)
                    # A plain mean at first, then a slow moving one.
                    self.reuse_gaps += 1
                    alpha = max(_LOG_ALPHA, 1.0 / self.reuse_gaps)
                    self.reuse_gap += alpha * (gap - self.reuse_gap)
                seen.uses += 1
                seen.last = now
            seen.cls = _class(seen.uses, head_uses)
            blocks[key] = seen  # most recent last: the oldest is forgotten first
            out.append(seen)
        while len(blocks) > _MAX_TRACKED:
            del blocks[next(iter(blocks))]
        if self.first_seen > 2 * _SHARE_WINDOW:
            self.first_seen //= 2
            self.first_reused //= 2
        return out

    def _intervals(self, cfg: ConductorConfig, share: float, uses: list[BlockUses]) -> list[float]:
        """Each block's advised interval in chain order (inf: drop first), from the
        statistics as they stood before this request; then counts its uses by class.

        A block is worth at least what any block after it in the chain is worth (a
        block without its prefix is worthless): intervals are a running minimum from
        the tail, and only a tail is dropped."""
        new_kept = share >= cfg.retention_drop_below
        by_class = cfg.retention_by_class
        intervals: list[float] = []
        soonest = math.inf
        for seen in reversed(uses):
            if by_class:
                if seen.uses > 1 or self.class_share(seen) >= cfg.retention_drop_below:
                    soonest = min(soonest, self.class_interval(seen))
            elif seen.uses > 1 or new_kept:
                soonest = min(soonest, self.interval(seen))
            intervals.append(soonest)
        intervals.reverse()
        for seen in uses:
            self._class_used(seen.cls)
        return intervals

    def _class_used(self, cls: int) -> None:
        uses = self.class_uses[cls] = self.class_uses.get(cls, 0) + 1
        if uses > 2 * _CLASS_WINDOW:
            self.class_uses[cls] //= 2
            self.class_reused[cls] = self.class_reused.get(cls, 0) // 2

    def _class_reused(self, cls: int, gap: float) -> None:
        """A use of class `cls` was followed by another, `gap` seconds later (the mean
        gap: a plain mean at first, then a slow moving one)."""
        reused = self.class_reused[cls] = self.class_reused.get(cls, 0) + 1
        mean = self.class_gap.get(cls)
        if mean is None:
            self.class_gap[cls] = gap
        else:
            self.class_gap[cls] = mean + max(_LOG_ALPHA, 1.0 / reused) * (gap - mean)

    def _pulled(
        self,
        cfg: ConductorConfig,
        state: ClusterState,
        decision: ev.RequestScheduled,
        target: str,
        keys: list[int],
    ) -> int:
        """How many leading blocks the request copies from another kvstore that keeps
        holding them (0 when the prefix is hot: its copies are wanted)."""
        end = 0
        for plan in decision.reuse:
            if plan.source_instance == target or plan.tier == "engine":
                continue
            source = state.instances.get(plan.source_instance)
            if source is None or source.role != "kvstore":
                continue
            end = max(end, min(plan.first_block + plan.num_blocks, len(keys)))
        if end <= 0 or _hot(cfg, self.blocks.get(keys[end - 1])):
            return 0
        return end


def _class(uses: int, head_uses: int) -> int:
    """A block's class: its uses and its chain head's, each counted up to `_CLASS_USES`."""
    return min(uses, _CLASS_USES) * (_CLASS_USES + 1) + min(head_uses, _CLASS_USES)


def _hot(cfg: ConductorConfig, seen: BlockUses | None) -> bool:
    """Whether a prefix is wanted as often as a hot one (`hot_demand` in `hot_window_s`)."""
    if seen is None or seen.uses < 2 or seen.gap <= 0.0:
        return seen is not None and seen.uses >= cfg.hot_demand
    return cfg.hot_window_s / seen.gap >= cfg.hot_demand


def _stored_keys(request: ev.RequestAdmitted) -> list[int]:
    """The request's full blocks: what its prefill stores in the pool."""
    keys = request.block_hashes
    if request.block_size > 0 and request.prompt_tokens > 0:
        return list(keys[: request.prompt_tokens // request.block_size])
    return list(keys)


def _kvstore_of(state: ClusterState, decision: ev.RequestScheduled) -> str | None:
    """The live kvstore on the host whose engine computes the request (its pool gets
    the blocks), the lowest id if there are several."""
    engine = state.instances.get(decision.prefill_instance)
    if engine is None:
        return None
    for inst in state.live_by_host().get(engine.host, ()):
        if inst.role == "kvstore":
            return inst.instance_id  # by id: the lowest
    return None


def _needed(
    state: ClusterState, request: ev.RequestAdmitted, decision: ev.RequestScheduled
) -> dict[str, list[int]]:
    """The blocks the request will read from each kvstore, by its reuse plan."""
    out: dict[str, list[int]] = {}
    keys = request.block_hashes
    for plan in decision.reuse:
        source = state.instances.get(plan.source_instance)
        if plan.tier == "engine" or source is None or source.role != "kvstore":
            continue
        blocks = keys[plan.first_block : plan.first_block + plan.num_blocks]
        if blocks:
            out.setdefault(plan.source_instance, []).extend(blocks)
    return out


def _reason(
    reuse_s: list[float],
    demote: list[int],
    drop: list[int],
    uses: list[BlockUses],
    needed: list[int],
) -> str:
    parts = []
    if needed:
        parts.append(f"keep {len(needed)} block(s) the request will read")
    if reuse_s:
        most = max(u.uses for u in uses)
        parts.append(
            f"{len(reuse_s)} block(s) used by up to {most} requests, next use predicted in "
            f"{min(reuse_s):.3g}-{max(reuse_s):.3g}s"
        )
    if demote:
        parts.append(f"demote {len(demote)} block(s) copied from a kvstore that keeps them")
    if drop:
        parts.append(f"drop {len(drop)} block(s) first: blocks used as often are rarely used again")
    return "; ".join(parts)
