"""The conductor's picture of the cluster, built only by folding logged events.

Nothing here reads a clock or a socket: `ClusterState.apply(event)` is the only way in,
so the same log always yields the same state, which is what makes replay exact.
Time is the event time (`event.time`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from yb_shared import events as ev


@dataclass(slots=True)
class InstanceState:
    """One instance as the log describes it."""

    instance_id: str
    role: ev.Role
    host: str
    model: str = ""
    ucx_address: str = ""
    block_size: int = 0
    kv_capacity_blocks: int = 0
    max_batch_size: int = 0
    attention_backend: str = ""
    epoch: int = 0
    up_since: float = 0.0
    last_seen: float = 0.0
    alive: bool = True
    last_report: ev.LoadReport | None = None
    # Requests the conductor sent here and that have not finished this stage.
    prefill_tokens_in_flight: int = 0
    prefill_requests_in_flight: int = 0
    decode_requests: int = 0


@dataclass(slots=True)
class Placement:
    """A scheduled request, until it finishes."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    prompt_tokens: int
    computed_tokens: int
    scheduled_at: float
    prefill_done: bool = False


@dataclass(slots=True)
class BlockTracker:
    """Where an instance's block event stream stands, to notice gaps and restarts."""

    epoch: int = -1
    last_event_id: int = 0
    needs_resync: bool = False


@dataclass
class ClusterState:
    """Instances, their loads, scheduled requests and the global block index."""

    heartbeat_timeout_s: float = 15.0
    now: float = 0.0
    instances: dict[str, InstanceState] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    # Global block index: key -> {instance_id: tier}.
    blocks: dict[int, dict[str, ev.Tier]] = field(default_factory=dict)
    block_trackers: dict[str, BlockTracker] = field(default_factory=dict)
    # Instances whose block stream broke; the service asks them for an inventory.
    resync_wanted: set[str] = field(default_factory=set)

    # --- the fold ---------------------------------------------------------------------

    def apply(self, event: ev.AnyEvent) -> None:
        """Fold one event into the state."""
        if event.time > self.now:
            self.now = event.time
        match event:
            case ev.InstanceUp():
                self._instance_up(event)
            case ev.InstanceDown():
                self._instance_down(event.instance_id)
            case ev.LoadReport():
                inst = self.instances.get(event.instance_id)
                if inst is not None:
                    inst.last_report = event
                    inst.last_seen = max(inst.last_seen, event.time)
                    inst.alive = True
            case ev.RequestScheduled():
                self.place(event)
            case ev.RequestProgress():
                self._progress(event)
            case ev.RequestFinished() | ev.RequestCancelled():
                self._finish(event.request_id)
            case ev.TransferFailed():
                pass  # the request's own failure event releases it
            case ev.BlockInventory():
                self._inventory(event)
            case ev.BlockStored() | ev.BlockEvicted() | ev.BlockMoved() | ev.BlocksCleared():
                self._block_event(event)
            case _:
                pass
        self._expire_silent_instances()

    def place(self, decision: ev.RequestScheduled) -> None:
        """Account a decision's load; idempotent per request id."""
        if decision.request_id in self.placements:
            return
        prefill = self.instances.get(decision.prefill_instance)
        decode = self.instances.get(decision.decode_instance)
        computed = decision.computed_tokens
        self.placements[decision.request_id] = Placement(
            request_id=decision.request_id,
            prefill_instance=decision.prefill_instance,
            decode_instance=decision.decode_instance,
            prompt_tokens=decision.prompt_tokens,
            computed_tokens=computed,
            scheduled_at=decision.time,
        )
        if prefill is not None:
            prefill.prefill_tokens_in_flight += computed
            prefill.prefill_requests_in_flight += 1
        if decode is not None:
            decode.decode_requests += 1

    def unplace(self, request_id: str) -> None:
        """Undo `place` (a recomputed decision that the log overruled)."""
        self._finish(request_id)

    def _instance_up(self, event: ev.InstanceUp) -> None:
        old = self.instances.get(event.instance_id)
        inst = InstanceState(
            instance_id=event.instance_id,
            role=event.role,
            host=event.host,
            model=event.model,
            ucx_address=event.ucx_address,
            block_size=event.block_size,
            kv_capacity_blocks=event.kv_capacity_blocks,
            max_batch_size=event.max_batch_size,
            attention_backend=event.attention_backend,
            epoch=event.epoch,
            up_since=event.time,
            last_seen=event.time,
        )
        if old is not None and old.epoch == event.epoch:
            # A repeated announcement: keep the load we have been accounting.
            inst.prefill_tokens_in_flight = old.prefill_tokens_in_flight
            inst.prefill_requests_in_flight = old.prefill_requests_in_flight
            inst.decode_requests = old.decode_requests
            inst.last_report = old.last_report
        self.instances[event.instance_id] = inst

    def _instance_down(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        inst.alive = False
        self._drop_blocks_of(instance_id)

    def _expire_silent_instances(self) -> None:
        limit = self.now - self.heartbeat_timeout_s
        for inst in self.instances.values():
            if inst.alive and inst.last_seen < limit:
                inst.alive = False
                self._drop_blocks_of(inst.instance_id)

    def _progress(self, event: ev.RequestProgress) -> None:
        placement = self.placements.get(event.request_id)
        if placement is None or placement.prefill_done:
            return
        if event.stage in ("prefill_done", "kv_committed", "first_token"):
            placement.prefill_done = True
            inst = self.instances.get(placement.prefill_instance)
            if inst is not None:
                inst.prefill_tokens_in_flight -= placement.computed_tokens
                inst.prefill_requests_in_flight -= 1

    def _finish(self, request_id: str) -> None:
        placement = self.placements.pop(request_id, None)
        if placement is None:
            return
        if not placement.prefill_done:
            inst = self.instances.get(placement.prefill_instance)
            if inst is not None:
                inst.prefill_tokens_in_flight -= placement.computed_tokens
                inst.prefill_requests_in_flight -= 1
        decode = self.instances.get(placement.decode_instance)
        if decode is not None:
            decode.decode_requests -= 1

    # --- block index --------------------------------------------------------------------

    def _block_event(self, event: ev.BlockEvent) -> None:
        tracker = self.block_trackers.setdefault(event.instance_id, BlockTracker())
        if event.epoch != tracker.epoch:
            # A restart: what we knew of the instance is void until it tells us again.
            self._drop_blocks_of(event.instance_id)
            tracker.epoch = event.epoch
            tracker.last_event_id = 0
            if event.event_id != 1 and not isinstance(event, ev.BlocksCleared):
                tracker.needs_resync = True
                self.resync_wanted.add(event.instance_id)
        elif event.event_id <= tracker.last_event_id:
            return  # a redelivery
        elif event.event_id != tracker.last_event_id + 1:
            tracker.needs_resync = True
            self.resync_wanted.add(event.instance_id)
        tracker.last_event_id = event.event_id
        match event:
            case ev.BlockStored():
                for key in event.block_hashes:
                    self.blocks.setdefault(key, {})[event.instance_id] = event.tier
            case ev.BlockMoved():
                for key in event.block_hashes:
                    holders = self.blocks.get(key)
                    if holders is not None and event.instance_id in holders:
                        holders[event.instance_id] = event.to_tier
            case ev.BlockEvicted():
                self._remove_blocks(event.instance_id, event.block_hashes)
            case ev.BlocksCleared():
                self._drop_blocks_of(event.instance_id)

    def _inventory(self, event: ev.BlockInventory) -> None:
        self._drop_blocks_of(event.instance_id)
        tracker = self.block_trackers.setdefault(event.instance_id, BlockTracker())
        tracker.epoch = event.epoch
        tracker.last_event_id = event.event_id
        tracker.needs_resync = False
        self.resync_wanted.discard(event.instance_id)
        for tier, keys in (("engine", event.engine), ("ssd", event.ssd), ("dram", event.dram)):
            for key in keys:
                self.blocks.setdefault(key, {})[event.instance_id] = tier  # type: ignore[assignment]

    def _remove_blocks(self, instance_id: str, keys: Iterable[int]) -> None:
        for key in keys:
            holders = self.blocks.get(key)
            if holders is not None:
                holders.pop(instance_id, None)
                if not holders:
                    del self.blocks[key]

    def _drop_blocks_of(self, instance_id: str) -> None:
        empty = []
        for key, holders in self.blocks.items():
            if holders.pop(instance_id, None) is not None and not holders:
                empty.append(key)
        for key in empty:
            del self.blocks[key]

    # --- queries ------------------------------------------------------------------------

    def live(self, role: ev.Role, model: str = "") -> list[InstanceState]:
        """Live instances of a role (serving `model`, when given), by id for determinism."""
        found = [
            i
            for i in self.instances.values()
            if i.alive and i.role == role and (not model or not i.model or i.model == model)
        ]
        return sorted(found, key=lambda i: i.instance_id)

    def prefix_blocks(self, keys: list[int], instance_id: str) -> int:
        """How many leading blocks of `keys` the instance holds (any tier)."""
        n = 0
        for key in keys:
            holders = self.blocks.get(key)
            if holders is None or instance_id not in holders:
                break
            n += 1
        return n
