"""`sglang-cache-aware`: SGLang router's cache-aware policy (sgl-router, `cache_aware`).

Its algorithm, as the router implements it:

- load is each worker's count of requests in flight; the pool is *imbalanced* when
  `max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`, and
  then the request goes to the least loaded worker;
- otherwise the router looks the prompt up in an *approximate* radix tree of what it
  has routed to each worker (it never hears about evictions): if the longest match
  covers more than `cache_threshold` of the prompt, that worker gets it, else the
  worker with the smallest tree (the most free cache, as far as the router knows);
- either way the prompt is inserted into the chosen worker's tree; trees are trimmed
  least-recently-used first to `max_tree_tokens` per worker;
- in prefill/decode mode the decode worker is simply the least loaded one.

Here the tree holds block keys instead of characters (the match rate is matched
blocks over the prompt's blocks), the trimming happens at insertion rather than on
a timer, and ties go to the first worker by id. The engines still reuse whatever
their host really holds, so the tree only steers. Defaults: the thresholds of the
comparison (0.3, 64, 1.5); `max_tree_tokens` is the router's 2**26 characters at
about four characters a token.
"""

from __future__ import annotations

from collections import OrderedDict

from yb_conductor.baselines.common import BaselinePolicy, local_view, scheduled
from yb_conductor.block_index import BlockIndex
from yb_conductor.cost_model import CostModel
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_TOKENS = 2**26 // 4


class ApproximateTree:
    """What the router believes each worker caches: the prompts it routed there.

    A `BlockIndex` answers "longest match, per worker" in one walk of the chain; a
    recency order per worker trims it. Keys are touched tail first, so a prompt's
    first blocks are the most recent and a trim takes chain tails before their
    prefixes, as evicting a radix tree's leaves does.
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.index = BlockIndex()
        self.recency: dict[str, OrderedDict[int, None]] = {}

    def insert(self, keys: list[int], worker: str) -> None:
        """The router sent `keys` to `worker`."""
        order = self.recency.setdefault(worker, OrderedDict())
        self.index.store(worker, keys, "dram")
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)
        excess = len(order) - self.max_blocks
        if excess > 0:
            victims = [order.popitem(last=False)[0] for _ in range(excess)]
            self.index.evict(worker, victims)

    def size(self, worker: str) -> int:
        """How many blocks the router believes `worker` holds."""
        order = self.recency.get(worker)
        return len(order) if order is not None else 0


class SglangCacheAwarePolicy(BaselinePolicy):
    """Cache affinity while the pool is balanced, shortest queue when it is not."""

    name = "sglang-cache-aware"

    def __init__(
        self,
        cfg: ConductorConfig | None = None,
        cost: CostModel | None = None,
        *,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        max_tree_tokens: int = MAX_TREE_TOKENS,
    ) -> None:
        super().__init__(cfg, cost)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.tree: ApproximateTree | None = None

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Route as the SGLang router would; reuse what the chosen host really holds."""
        prefills, decodes, missing = self.live_pools(state, request, seq)
        if missing is not None:
            return missing
        bs = max(1, request.block_size)
        if self.tree is None:
            self.tree = ApproximateTree(max(1, self.max_tree_tokens // bs))
        tree = self.tree
        keys = request.block_hashes
        loads = [p.prefill_requests_in_flight for p in prefills]
        most, least = max(loads), min(loads)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            i = loads.index(least)
            reason = f"imbalanced (in flight {least}..{most}): shortest queue"
        else:
            i, matched = self._best_match(tree, keys, [p.instance_id for p in prefills])
            rate = matched / len(keys) if keys else 0.0
            if matched and rate > self.cache_threshold:
                reason = f"cache match {rate:.0%} > {self.cache_threshold:.0%}"
            else:
                i = min(range(len(prefills)), key=lambda j: tree.size(prefills[j].instance_id))
                reason = f"cache match {rate:.0%}: smallest tree"
        tree.insert(keys, prefills[i].instance_id)
        decode = min(decodes, key=lambda d: d.decode_requests)
        view = local_view(state, request, prefills)
        return Decided(
            scheduled(self.name, self.costs, state, request, seq, view, i, decode, reason), []
        )

    @staticmethod
    def _best_match(tree: ApproximateTree, keys: list[int], ids: list[str]) -> tuple[int, int]:
        """(index in `ids`, matched blocks) of the longest match; first by id on ties."""
        if not keys or not len(tree.index):
            return 0, 0
        lengths = tree.index.match(keys).lengths
        position = {w: j for j, w in enumerate(ids)}
        best, best_len = 0, 0
        for slot, n in lengths.items():
            j = position.get(tree.index.instance(slot))
            if j is not None and (n > best_len or (n == best_len and j < best)):
                best, best_len = j, n
        return best, best_len
