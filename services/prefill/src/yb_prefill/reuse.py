"""Loading a request's reused prefix exactly as its decision planned it.

The conductor's `RequestScheduled.reuse` lists runs of prefix blocks and where each
comes from: this engine's own page cache (tier "engine"), this host's kvstore or
another host's (tiers "dram"/"ssd"). `PrefixLoader.load` builds the request's block
table accordingly:

- engine blocks: the cached pages themselves go into the block table (no copy);
- kvstore blocks: fresh pages are reserved on this instance's UCX receiver and the
  kvstore is asked to send the blocks straight into them (`request_fetch`), one
  fetch per source, all sources at once;
- the rest of the prompt: fresh pages, which the prefill computes.

Only a prefix can be reused: the loaded blocks count up to the first block that is
not loaded (a gap in the plan, a block the engine cache has evicted since the
decision, a fetch that failed). A failed fetch is reported (`TransferFailed`) and its
blocks are recomputed. At least the last prompt token is always computed (its logits
are needed), so a prompt made only of full blocks reuses all but its last block.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from yb_core import events as ev
from yb_core.telemetry import get_logger
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import (
    KVReceiver,
    KVSender,
    PeerUnreachable,
    TransferError,
)
from yb_dataplane.transport.blocks import fetch_request_id, key_text
from yb_engine.kv_cache import PagedKVCache
from yb_prefill.prefix_cache import PrefixCache

log = get_logger(__name__)

#: How long a fetch waits to learn the address of a source it has not seen announced.
_ANNOUNCE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class FetchRun:
    """Blocks `[first, first + count)` pulled from one kvstore in one fetch."""

    source: str
    first: int
    count: int
    tiers: tuple[ev.Tier, ...]


@dataclass(frozen=True, slots=True)
class FetchFailure:
    """A planned fetch that did not deliver."""

    source: str
    first: int
    count: int
    reason: str


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


def reusable_blocks(num_tokens: int, num_keys: int, block_size: int) -> int:
    """Most leading blocks a prompt may reuse: full blocks, the last token computed."""
    return max(0, min(num_keys, (num_tokens - 1) // block_size))


def plan_runs(
    plans: Sequence[ev.ReusePlan], instance_id: str, limit: int
) -> tuple[int, list[FetchRun]]:
    """The contiguous planned prefix: (engine blocks, kvstore runs), at most `limit`.

    Engine blocks must come first and be this instance's own (engines do not serve
    each other). Adjacent kvstore runs of one source merge into one fetch (a source's
    prefix may be cut into DRAM and SSD runs).
    """
    engine = 0
    runs: list[FetchRun] = []
    covered = 0
    for plan in sorted(plans, key=lambda p: p.first_block):
        if plan.first_block != covered or plan.num_blocks <= 0 or covered >= limit:
            break
        count = min(plan.num_blocks, limit - covered)
        if plan.tier == "engine":
            if plan.source_instance != instance_id or runs:
                break
            engine += count
        elif runs and runs[-1].source == plan.source_instance:
            last = runs[-1]
            tiers = last.tiers if plan.tier in last.tiers else (*last.tiers, plan.tier)
            runs[-1] = FetchRun(last.source, last.first, last.count + count, tiers)
        else:
            runs.append(FetchRun(plan.source_instance, covered, count, (plan.tier,)))
        covered += count
    return engine, runs


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
        self.peers = peers
        self.receiver = receiver
        self.sender = sender

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
        started = time.monotonic()
        results = await asyncio.gather(
            *(self._fetch(request_id, run, keys, prefix.block_table, deadline_s) for run in runs),
            return_exceptions=True,
        )
        prefix.fetch_s = time.monotonic() - started
        self._record_fetches(prefix, runs, results)
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

    def _record_fetches(
        self, prefix: Prefix, runs: list[FetchRun], results: Sequence[object]
    ) -> None:
        """Fold the fetches' outcomes into `prefix`: where each block came from, the
        failures, and how far the prefix now reaches without a gap. A failure other
        than a transfer's is re-raised."""
        for run, result in zip(runs, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, TransferError | OSError):
                    raise result
                prefix.failures.append(FetchFailure(run.source, run.first, run.count, str(result)))
                continue
            for i in range(run.first, run.first + run.count):
                prefix.loaded_from[i] = run.source
            prefix.fetched_bytes += run.count * self.kv.num_layers * self.kv.page_nbytes
        reused = prefix.engine_blocks
        while reused in prefix.loaded_from:
            reused += 1
        prefix.reused_blocks = reused
        for run in runs:
            loaded = max(0, min(run.first + run.count, reused) - run.first)
            if loaded:
                tier = "ssd" if run.tiers == ("ssd",) else run.tiers[0]
                name = tier if self._is_local(run.source) else f"remote_{tier}"
                prefix.tokens_by_tier[name] = (
                    prefix.tokens_by_tier.get(name, 0) + loaded * self.kv.block_size
                )

    def _is_local(self, source: str) -> bool:
        up = self.peers.get(source)
        me = self.peers.get(self.instance_id)
        return up is not None and me is not None and up.host == me.host

    async def _fetch(
        self,
        request_id: str,
        run: FetchRun,
        keys: Sequence[int],
        block_table: Sequence[int],
        deadline_s: float,
    ) -> None:
        """Pull one run of blocks from its kvstore straight into their pages."""
        address = self.peers.address(run.source)
        if address is None:
            # The decision may be newer than what this instance has read of the log.
            await self.peers.wait_for(run.source, min(deadline_s, _ANNOUNCE_WAIT_S))
            address = self.peers.address(run.source)
        if address is None:
            raise PeerUnreachable(f"kvstore {run.source} is not up (or has no UCX address)")
        layers = self.kv.num_layers
        pages = block_table[run.first : run.first + run.count]
        buffers = [self.kv.page_view(layer, page) for page in pages for layer in range(layers)]
        rid = fetch_request_id(f"fetch.{request_id}.{run.first}.{uuid.uuid4().hex[:6]}", layers)
        reservation = self.receiver.reserve(rid, buffers, deadline_s=deadline_s)
        try:
            await self.sender.request_fetch(
                address,
                rid,
                [key_text(k) for k in keys[run.first : run.first + run.count]],
                reply_to=self.receiver.address,
                deadline_s=deadline_s,
                breaks=reservation.breaks(),
            )
            await reservation.wait_committed()
        except BaseException as exc:
            # Closes the connection if receives are still posted into these pages, so
            # nothing writes into them once we recompute there.
            self.receiver.cancel(rid)
            log.warning(
                "prefix_fetch_failed",
                source=run.source,
                first_block=run.first,
                blocks=run.count,
                error=str(exc),
            )
            raise

    def release(self, prefix: Prefix) -> None:
        """Give back everything the prefix holds (the request failed)."""
        fresh = prefix.block_table[prefix.engine_blocks :]
        self.cache.release(prefix.engine_keys)
        prefix.engine_keys = []
        self.cache.free(fresh)
        prefix.block_table = []
