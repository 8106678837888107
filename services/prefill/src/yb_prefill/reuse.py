"""Loading a request's reused prefix exactly as its decision planned it.

The conductor's `RequestScheduled.reuse` lists runs of prefix blocks and where each
comes from: this engine's own page cache (tier "engine"), this host's kvstore or
another host's (tiers "dram"/"ssd"). `PrefixLoader.load` builds the request's block
table accordingly:

- engine blocks: the cached pages themselves go into the block table (no copy);
- kvstore blocks: fresh pages, into which the kvstores send the blocks over UCX
  (`yb_dataplane.prefix_fetch.BlockFetcher`, shared with a decode instance that
  prefills inside its batch), one fetch per source, all sources at once;
- the rest of the prompt: fresh pages, which the prefill computes.

Only a prefix can be reused: the loaded blocks count up to the first block that is
not loaded (a gap in the plan, a block the engine cache has evicted since the
decision, a fetch that failed). A failed fetch is reported (`TransferFailed`) and its
blocks are recomputed. At least the last prompt token is always computed (its logits
are needed), so a prompt made only of full blocks reuses all but its last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from yb_core import events as ev
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.prefix_fetch import (
    BlockFetcher,
    FetchFailure,
    FetchRun,
    plan_runs,
    reusable_blocks,
)
from yb_dataplane.transport import KVReceiver, KVSender
from yb_engine.kv_cache import PagedKVCache
from yb_prefill.prefix_cache import PrefixCache

# Re-exported: where they were before the decode service needed them too.
__all__ = [
    "FetchFailure",
    "FetchRun",
    "Prefix",
    "PrefixLoader",
    "plan_runs",
    "reusable_blocks",
]


@dataclass
class Prefix:
    """A request's pages, and how much of its prompt they hold before any compute.

    `block_table[i]` is the page of block `i`; the first `reused_blocks` hold their
    KV already. `engine_keys` are referenced in the engine cache until `release`.
    `loaded_from[i]` names the kvstore block `i` came from (for blocks fetched).
    """

    block_table: list[int]
    engine_blocks: int = 0
    reused_blocks: int = 0
    engine_keys: list[int] = field(default_factory=list)
    loaded_from: dict[int, str] = field(default_factory=dict)
    failures: list[FetchFailure] = field(default_factory=list)
    fetched_bytes: int = 0
    fetch_s: float = 0.0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


class PrefixLoader:
    """Builds block tables from reuse plans (see the module docstring)."""

    def __init__(
        self,
        instance_id: str,
        cache: PrefixCache,
        kv: PagedKVCache,
        peers: PeerDirectory,
        receiver: KVReceiver,
        sender: KVSender,
    ) -> None:
        self.instance_id = instance_id
        self.cache = cache
        self.kv = kv
        self.fetcher = BlockFetcher(instance_id, kv, peers, receiver, sender)

    async def load(
        self,
        request_id: str,
        num_tokens: int,
        keys: Sequence[int],
        plans: Sequence[ev.ReusePlan],
        deadline_s: float,
    ) -> Prefix:
        """Pages for the whole prompt with the planned prefix loaded into them.

        Raises OutOfPages if the engine has too few pages even after evicting idle
        cached blocks (nothing is held then).
        """
        limit = reusable_blocks(num_tokens, len(keys), self.kv.block_size)
        planned, runs = plan_runs(plans, self.instance_id, limit)
        prefix = self._engine_prefix(num_tokens, keys, planned)
        if prefix.engine_blocks < planned:
            runs = []  # the engine prefix stops short of where the fetches begin
        if not runs:
            return prefix
        fetched = await self.fetcher.fetch(request_id, runs, keys, prefix.block_table, deadline_s)
        prefix.loaded_from = fetched.loaded_from
        prefix.failures = fetched.failures
        prefix.fetched_bytes = fetched.fetched_bytes
        prefix.fetch_s = fetched.fetch_s
        prefix.reused_blocks = fetched.reaches(prefix.engine_blocks)
        for tier, tokens in self.fetcher.tokens_by_tier(runs, prefix.reused_blocks).items():
            prefix.tokens_by_tier[tier] = prefix.tokens_by_tier.get(tier, 0) + tokens
        return prefix

    def _engine_prefix(self, num_tokens: int, keys: Sequence[int], planned: int) -> Prefix:
        """Pages for the whole prompt: the cached pages of the planned engine blocks
        the cache still holds (it may have evicted some since: the prefix stops at
        the first one gone), then fresh ones. Raises OutOfPages holding nothing."""
        engine = self.cache.prefix_length(keys[:planned])
        engine_keys = list(keys[:engine])
        engine_pages = self.cache.acquire(engine_keys)
        try:
            fresh = self.cache.allocate(self.kv.pages_for(num_tokens) - engine)
        except BaseException:
            self.cache.release(engine_keys)
            raise
        prefix = Prefix(
            block_table=engine_pages + fresh,
            engine_blocks=engine,
            reused_blocks=engine,
            engine_keys=engine_keys,
        )
        if engine:
            prefix.tokens_by_tier["engine"] = engine * self.kv.block_size
        return prefix

    def release(self, prefix: Prefix) -> None:
        """Give back everything the prefix holds (the request failed)."""
        fresh = prefix.block_table[prefix.engine_blocks :]
        self.cache.release(prefix.engine_keys)
        prefix.engine_keys = []
        self.cache.free(fresh)
        prefix.block_table = []
