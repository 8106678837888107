"""The routers `yb sim` compares the conductor with, one module per idea, each a
conductor `Policy` (so `yb replay --policy NAME` can ask "what if" of them too)."""

from __future__ import annotations

from yb_conductor.peer_policies.dynamo_kv import DynamoKvPolicy
from yb_conductor.peer_policies.local_prefix import LocalPrefixPolicy
from yb_conductor.peer_policies.random_policy import RandomPolicy
from yb_conductor.peer_policies.round_robin import RoundRobinPolicy
from yb_conductor.peer_policies.sglang_cache_aware import SglangCacheAwarePolicy
from yb_conductor.policy_base import PolicyFactory

PEER_POLICIES: dict[str, PolicyFactory] = {
    RandomPolicy.name: RandomPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LocalPrefixPolicy.name: LocalPrefixPolicy,
    SglangCacheAwarePolicy.name: SglangCacheAwarePolicy,
    DynamoKvPolicy.name: DynamoKvPolicy,
}

__all__ = [
    "PEER_POLICIES",
    "DynamoKvPolicy",
    "LocalPrefixPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "SglangCacheAwarePolicy",
]
