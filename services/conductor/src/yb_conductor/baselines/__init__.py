"""The baselines `yb sim` compares the conductor with, one module per router, each a
conductor `Policy` (so `yb replay --policy NAME` can ask "what if" of them too).

`least-loaded` balances load alone; the others (`common.BaselinePolicy`) reuse only
what the chosen prefill instance's host holds.
"""

from __future__ import annotations

from yb_conductor.baselines.dynamo_kv import DynamoKvPolicy
from yb_conductor.baselines.least_loaded import LeastLoadedPolicy
from yb_conductor.baselines.local_prefix import LocalPrefixPolicy
from yb_conductor.baselines.random_policy import RandomPolicy
from yb_conductor.baselines.round_robin import RoundRobinPolicy
from yb_conductor.baselines.sglang_cache_aware import SglangCacheAwarePolicy
from yb_conductor.policy_base import PolicyFactory

BASELINES: dict[str, PolicyFactory] = {
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    RandomPolicy.name: RandomPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LocalPrefixPolicy.name: LocalPrefixPolicy,
    SglangCacheAwarePolicy.name: SglangCacheAwarePolicy,
    DynamoKvPolicy.name: DynamoKvPolicy,
}

__all__ = [
    "BASELINES",
    "DynamoKvPolicy",
    "LeastLoadedPolicy",
    "LocalPrefixPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SglangCacheAwarePolicy",
]
