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

With `overlap`, `load` returns once the prefix's first layer has landed (the compute
could not start sooner): the prefix counts as loaded (every planned block), and the
compute waits before each later layer for that layer's pages (`Prefix.arrivals`,
`yb_dataplane.prefix_fetch.LayerArrivals`). A fetch that fails before then falls back
as above; one that fails later fails the job (layers may be computed on already),
which is re-planned. `landed` awaits the fetches once the compute is done, and
`settle` ends them when the job ends early.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from yb_core import events as ev
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.prefix_fetch import (
    BlockFetcher,
    Fetched,
    FetchFailure,
    FetchRun,
    LayerArrivals,
    PrefixLoadFailed,
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
    While `fetching` (an overlapped load), the blocks from `engine_blocks` to
    `reused_blocks` are still landing, layer by layer (`arrivals`).
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
    arrivals: LayerArrivals | None = None
    fetching: asyncio.Task[Fetched] | None = None
    runs: list[FetchRun] = field(default_factory=list)


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
        *,
        overlap: bool = False,
    ) -> Prefix:
        """Pages for the whole prompt with the planned prefix loaded into them (with
        `overlap`: loading into them; see the module docstring).

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
        if overlap:
            arrivals = LayerArrivals(
                range(self.kv.num_layers), len(runs), time.monotonic() + deadline_s
            )
            fetching = asyncio.ensure_future(
                self.fetcher.fetch(request_id, runs, keys, prefix.block_table, deadline_s, arrivals)
            )
            try:
                waits: set[asyncio.Future[Any]] = {fetching, arrivals.first}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                arrivals.fail("the job ended")
                fetching.cancel()
                await asyncio.gather(fetching, return_exceptions=True)
                self.release(prefix)
                raise
            if arrivals.ready and not fetching.done():
                prefix.arrivals = arrivals
                prefix.runs = list(runs)
                prefix.fetching = fetching
                prefix.reused_blocks = runs[-1].first + runs[-1].count
                return prefix
            fetched = await fetching  # whole already, or failed before any layer landed
        else:
            fetched = await self.fetcher.fetch(
                request_id, runs, keys, prefix.block_table, deadline_s
            )
        self._note_fetched(prefix, fetched)
        prefix.reused_blocks = fetched.reaches(prefix.engine_blocks)
        self._count_tiers(prefix, runs)
        return prefix

    async def landed(self, prefix: Prefix) -> None:
        """The end of an overlapped load, once the compute is done: what it fetched,
        from where; raises PrefixLoadFailed if a fetch failed (the compute read pages
        that were not all there, so the job cannot stand)."""
        fetching, prefix.fetching = prefix.fetching, None
        if fetching is None:
            return
        fetched = await fetching
        self._note_fetched(prefix, fetched)
        if fetched.failures or fetched.reaches(prefix.engine_blocks) < prefix.reused_blocks:
            reasons = "; ".join(f"{f.source}: {f.reason}" for f in fetched.failures)
            raise PrefixLoadFailed(f"the prefix did not land whole: {reasons or 'a gap'}")
        self._count_tiers(prefix, prefix.runs)

    async def settle(self, prefix: Prefix, reason: str) -> None:
        """End an overlapped load the job no longer wants: every wait of the engine
        thread fails with `reason`, and the fetches are cancelled (their receives
        with them, so nothing writes into the pages once they are given back)."""
        if prefix.arrivals is not None:
            prefix.arrivals.fail(reason)
        fetching, prefix.fetching = prefix.fetching, None
        if fetching is not None:
            fetching.cancel()
            await asyncio.gather(fetching, return_exceptions=True)

    @staticmethod
    def _note_fetched(prefix: Prefix, fetched: Fetched) -> None:
        prefix.loaded_from = fetched.loaded_from
        prefix.failures = fetched.failures
        prefix.fetched_bytes = fetched.fetched_bytes
        prefix.fetch_s = fetched.fetch_s

    def _count_tiers(self, prefix: Prefix, runs: Sequence[FetchRun]) -> None:
        for tier, tokens in self.fetcher.tokens_by_tier(runs, prefix.reused_blocks).items():
            prefix.tokens_by_tier[tier] = prefix.tokens_by_tier.get(tier, 0) + tokens

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
        """Give back everything the prefix holds (the request failed; an overlapped
        load `settle`d first)."""
        assert prefix.fetching is None, "an overlapped load still lands in these pages"
        fresh = prefix.block_table[prefix.engine_blocks :]
        self.cache.release(prefix.engine_keys)
        prefix.engine_keys = []
        self.cache.free(fresh)
        prefix.block_table = []
