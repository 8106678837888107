"""Hot prefixes: replicate what many requests want onto more hosts.

Transfers already replicate a prefix where it is used (the prefill stores what it
pulled into its host's kvstore). Beyond that, a prefix that many requests want in a
short time should not wait for each host to be chosen once: when one is wanted by
`hot_demand` admissions within `hot_window_s` (event time, tumbling windows — integer
counts, no floating decay, so the fold stays exact) and is held in full on fewer
than `hot_replicas` hosts, the conductor plans a copy (`ReplicationPlanned`) from a
kvstore that holds it to the kvstore of the least busy host that does not — at most
once per window per prefix. The target logs `BlockStored` once it has the copy; that,
not the plan, is what the index believes.

A prefix is named by the key of its last block (keys chain, so the last key stands
for the whole prefix).
"""

from __future__ import annotations

import msgspec

from yb_conductor.state import ClusterState, InstanceState
from yb_core import events as ev
from yb_core.config import ConductorConfig

_MAX_TRACKED = 200_000


class HotPrefixes(msgspec.Struct, kw_only=True):
    """Demand per prefix in the current window, and when each was last replicated."""

    windows: dict[int, tuple[float, int]] = msgspec.field(default_factory=dict)
    planned: dict[int, float] = msgspec.field(default_factory=dict)

    def observe(
        self,
        cfg: ConductorConfig,
        state: ClusterState,
        request: ev.RequestAdmitted,
        decision: ev.Decision,
    ) -> ev.ReplicationPlanned | None:
        """Count one admission's demand; plan a replica when its prefix is hot."""
        explain = decision.explain
        if cfg.hot_replicas <= 0 or explain is None or explain.best_blocks <= 0:
            return None
        best = min(explain.best_blocks, len(request.block_hashes))
        if best <= 0:
            return None
        key = request.block_hashes[best - 1]
        now = state.now
        start, count = self.windows.get(key, (now, 0))
        if now - start >= cfg.hot_window_s:
            start, count = now, 0
        count += 1
        self.windows[key] = (start, count)
        if len(self.windows) > _MAX_TRACKED:
            self._forget_old(now, cfg.hot_window_s)
        if count < cfg.hot_demand:
            return None
        last = self.planned.get(key)
        if last is not None and now - last < cfg.hot_window_s:
            return None
        plan = self._plan(cfg, state, request.block_hashes[:best], count)
        if plan is not None:
            self.planned[key] = now
        return plan

    def _plan(
        self, cfg: ConductorConfig, state: ClusterState, prefix: list[int], demand: int
    ) -> ev.ReplicationPlanned | None:
        match = state.index.match(prefix)
        full = len(prefix)
        holders: list[InstanceState] = []
        for slot, n in match.lengths.items():
            inst = state.instances.get(state.index.instance(slot))
            if n == full and inst is not None and inst.alive and inst.role == "kvstore":
                holders.append(inst)
        hosts = {h.host for h in holders}
        if not holders or len(hosts) >= cfg.hot_replicas:
            return None
        source = min(holders, key=lambda i: i.instance_id)
        # The least busy host without a copy: its prefill instances' queued work.
        busy: dict[str, float] = {}
        for inst in state.live("prefill"):
            busy[inst.host] = busy.get(inst.host, 0.0) + state.queue_s(inst)
        targets = [k for k in state.live("kvstore") if k.host not in hosts]
        if not targets:
            return None
        target = min(targets, key=lambda k: (busy.get(k.host, 0.0), k.instance_id))
        return ev.ReplicationPlanned(
            time=state.now,
            source_instance=source.instance_id,
            target_instance=target.instance_id,
            block_hashes=list(prefix),
            demand=demand,
            reason=(
                f"{demand} requests in {cfg.hot_window_s:g}s want this {full}-block prefix; "
                f"held on {len(hosts)} host(s), want {cfg.hot_replicas}"
            ),
        )

    def _forget_old(self, now: float, window_s: float) -> None:
        for key in [k for k, (start, _) in self.windows.items() if now - start >= window_s]:
            del self.windows[key]
        for key in [k for k, t in self.planned.items() if now - t >= window_s]:
            del self.planned[key]
