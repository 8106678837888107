"""Pulling a request's planned prefix blocks from the kvstores into an engine's pages.

The conductor's `RequestScheduled.reuse` lists runs of prefix blocks and where each
comes from: the engine's own page cache (tier "engine") or a kvstore (tiers
"dram"/"ssd", on this host or another). `plan_runs` reads the plan as the contiguous
prefix it describes; `BlockFetcher.fetch` pulls its kvstore runs over UCX straight
into the pages the caller chose, one fetch per source, all sources at once. Both the
prefill engine (`yb_prefill.reuse`) and a decode engine that prefills inside its
batch (piggybacking, `yb_decode`) load prefixes with it.

Only a prefix can be reused: the loaded blocks count up to the first block that is
not loaded (`Fetched.reaches`). A fetch that fails is recorded (`FetchFailure`, for
the caller's `TransferFailed` event); its pages are left to the caller, who computes
those blocks there. The receives of a failed fetch are cancelled first, so nothing
writes into those pages afterwards. At least the last prompt token is always
computed (its logits are needed), so a prompt made only of full blocks reuses all but
its last block (`reusable_blocks`).

A fetch may also be computed on while it lands (`LayerArrivals`): the kvstores send
layer by layer (every block's first layer, then the next), each buffer is verified as
it lands, and the engine thread waits before each layer only for that layer's pages.
A prefix then costs about the longer of its load and the compute, not their sum.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from yb_core import events as ev
from yb_core.telemetry import get_logger
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import (
    BufferLike,
    KVReceiver,
    KVSender,
    PeerUnreachable,
    TransferError,
)
from yb_dataplane.transport.blocks import fetch_request_id, key_text

log = get_logger(__name__)

#: How long a fetch waits to learn the address of a source it has not seen announced.
ANNOUNCE_WAIT_S = 0.5


class PagedBuffers(Protocol):
    """An engine's paged KV memory as the transport sees it (the engine's
    `PagedKVCache` is one, a tensor-parallel instance's `ShardedKV` another): per
    layer, each page in runs of heads (`head_cuts`; one run when the holder is one
    process), each run one buffer."""

    @property
    def num_layers(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def page_nbytes(self) -> int: ...

    @property
    def head_cuts(self) -> list[int]:
        """The head boundaries this holder cuts a page at."""
        ...

    def pieces(self, layer: int, page: int, cuts: Sequence[int]) -> Sequence[BufferLike]:
        """The buffers of `page` in `layer`, cut at `cuts` (what UCX writes into)."""
        ...

    @property
    def has_replicas(self) -> bool:
        """Whether some heads are kept by more than one rank (`replicate` copies)."""
        ...

    def replicate(self, pages: Iterable[int]) -> None:
        """Copy received pages to the ranks keeping a replica of their heads."""
        ...


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
class Fetched:
    """What a `BlockFetcher.fetch` delivered: where each fetched block came from, the
    fetches that failed, the bytes and the time it took."""

    loaded_from: dict[int, str] = field(default_factory=dict)
    failures: list[FetchFailure] = field(default_factory=list)
    fetched_bytes: int = 0
    fetch_s: float = 0.0

    def reaches(self, start: int) -> int:
        """The prefix end without a gap: blocks before `start` are loaded already,
        then every block fetched in a row."""
        end = start
        while end in self.loaded_from:
            end += 1
        return end


class PrefixLoadFailed(TransferError):
    """A prefix being computed on while it lands did not land (a fetch failed or ran
    past its deadline, or the job was abandoned): what the engine thread raises."""


class LayerArrivals:
    """Which layers of a prefix fetch have landed in the engine's pages, for the
    engine thread to wait on before it computes each layer.

    The fetch's runs (one per kvstore) report their leading complete layers from the
    event loop (`advance`); `wait_layer` blocks the engine thread until every run has
    delivered `layer`, within the fetch's deadline. `fail` ends every wait with
    `PrefixLoadFailed`: a fetch failed, or the job was abandoned, and an engine thread
    must never stay blocked on pages that will not come. `first` resolves (on the
    event loop, where `advance` and `fail` are called) once the first layer has
    landed or the load failed: a load that fails before any layer is computed on
    can still fall back to computing the prefix.
    """

    def __init__(self, layers: range, runs: int, deadline: float) -> None:
        """`layers`: the model layers the pages hold (their index `layers.start + j`
        is page layer `j`); `deadline`: `time.monotonic()` past which a wait fails."""
        self.layers = layers
        self.deadline = deadline
        self._cond = threading.Condition()
        self._per_run = [0] * runs
        self._ready = len(layers) if runs == 0 else 0
        self._failed: str | None = None
        #: Seconds the engine thread spent waiting, in all.
        self.waited_s = 0.0
        self.first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._ready:
            self.first.set_result(None)

    @property
    def ready(self) -> int:
        """Leading page layers every run has delivered."""
        return self._ready

    def advance(self, run: int, layers: int) -> None:
        """Run `run` has delivered its first `layers` page layers."""
        with self._cond:
            self._per_run[run] = layers
            ready = min(self._per_run)
            if ready > self._ready:
                self._ready = ready
                self._cond.notify_all()
        if self._ready and not self.first.done():
            self.first.set_result(None)

    def fail(self, reason: str) -> None:
        """End every wait, now and later, with `reason`."""
        with self._cond:
            if self._failed is None:
                self._failed = reason
                self._cond.notify_all()
        if not self.first.done():
            self.first.set_result(None)

    def wait_layer(self, layer: int) -> None:
        """Engine thread: return once model layer `layer`'s pages have landed."""
        j = layer - self.layers.start
        with self._cond:
            if self._ready > j and self._failed is None:
                return
            started = time.monotonic()
            try:
                while True:
                    if self._failed is not None:
                        raise PrefixLoadFailed(self._failed)
                    if self._ready > j:
                        return
                    remaining = self.deadline - time.monotonic()
                    if remaining <= 0:
                        raise PrefixLoadFailed(
                            f"the prefix's layer {layer} had not landed by the fetch's deadline"
                        )
                    self._cond.wait(remaining)
            finally:
                self.waited_s += time.monotonic() - started


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


class BlockFetcher:
    """Pulls runs of blocks from kvstores into an engine's pages over UCX.

    A pipeline stage's pages hold some of the model's layers only: `layers` says which
    (its page layer j is the model's layer `layers.start + j`) of the `model_layers`
    a pooled block holds, and a fetch asks the kvstore for those layers only. By
    default the engine holds every layer.
    """

    def __init__(
        self,
        instance_id: str,
        kv: PagedBuffers,
        peers: PeerDirectory,
        receiver: KVReceiver,
        sender: KVSender,
        *,
        model_layers: int = 0,
        layers: range | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.kv = kv
        self.peers = peers
        self.receiver = receiver
        self.sender = sender
        self.model_layers = model_layers or kv.num_layers
        self.layers = layers if layers is not None else range(self.model_layers)
        if len(self.layers) != kv.num_layers or self.layers.stop > self.model_layers:
            raise ValueError(
                f"pages of {kv.num_layers} layers cannot hold layers {self.layers} "
                f"of {self.model_layers}"
            )

    async def fetch(
        self,
        request_id: str,
        runs: Sequence[FetchRun],
        keys: Sequence[int],
        block_table: Sequence[int],
        deadline_s: float,
        arrivals: LayerArrivals | None = None,
    ) -> Fetched:
        """Every run at once, each into its blocks' pages of `block_table`, within
        `deadline_s`. A failed transfer is recorded, not raised; any other failure
        (a bug) is re-raised once every fetch has ended. `arrivals` (made for
        `len(runs)` runs) learns of each run's layers as they land."""
        fetched = Fetched()
        if not runs:
            return fetched
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                self._fetch(request_id, run, keys, block_table, deadline_s, arrivals, n)
                for n, run in enumerate(runs)
            ),
            return_exceptions=True,
        )
        fetched.fetch_s = time.monotonic() - started
        page_bytes = self.kv.num_layers * self.kv.page_nbytes
        for run, result in zip(runs, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, TransferError | OSError):
                    raise result
                fetched.failures.append(FetchFailure(run.source, run.first, run.count, str(result)))
                continue
            for i in range(run.first, run.first + run.count):
                fetched.loaded_from[i] = run.source
            fetched.fetched_bytes += run.count * page_bytes
        return fetched

    def tokens_by_tier(self, runs: Sequence[FetchRun], reused: int) -> dict[str, int]:
        """Tokens of the runs loaded within the first `reused` blocks, by where they
        came from: `dram`/`ssd` on this host, `remote_dram`/`remote_ssd` beyond it."""
        out: dict[str, int] = {}
        for run in runs:
            loaded = max(0, min(run.first + run.count, reused) - run.first)
            if loaded:
                tier = "ssd" if run.tiers == ("ssd",) else run.tiers[0]
                name = tier if self._is_local(run.source) else f"remote_{tier}"
                out[name] = out.get(name, 0) + loaded * self.kv.block_size
        return out

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
        arrivals: LayerArrivals | None = None,
        run_index: int = 0,
    ) -> None:
        """Pull one run of blocks from its kvstore straight into their pages,
        telling `arrivals` (as run `run_index`) of its layers as they land."""
        try:
            await self._fetch_run(
                request_id, run, keys, block_table, deadline_s, arrivals, run_index
            )
        except BaseException as exc:
            if arrivals is not None:
                arrivals.fail(f"prefix fetch from {run.source} failed: {exc or type(exc).__name__}")
            raise
        if arrivals is not None:
            arrivals.advance(run_index, self.kv.num_layers)

    async def _fetch_run(
        self,
        request_id: str,
        run: FetchRun,
        keys: Sequence[int],
        block_table: Sequence[int],
        deadline_s: float,
        arrivals: LayerArrivals | None,
        run_index: int,
    ) -> None:
        address = self.peers.address(run.source)
        if address is None:
            # The decision may be newer than what this instance has read of the log.
            await self.peers.wait_for(run.source, min(deadline_s, ANNOUNCE_WAIT_S))
            address = self.peers.address(run.source)
        if address is None:
            raise PeerUnreachable(f"kvstore {run.source} is not up (or has no UCX address)")
        pages = block_table[run.first : run.first + run.count]
        cuts = self.kv.head_cuts
        buffers = [
            piece
            for page in pages
            for layer in range(self.kv.num_layers)
            for piece in self.kv.pieces(layer, page, cuts)
        ]
        rid = fetch_request_id(
            f"fetch.{request_id}.{run.first}.{uuid.uuid4().hex[:6]}",
            self.model_layers,
            self.layers,
            pieces=len(cuts) - 1,
        )
        reservation = self.receiver.reserve(rid, buffers, deadline_s=deadline_s)
        if arrivals is not None and not self.kv.has_replicas:
            # Replicated heads are copied to their other ranks after the commit, so
            # such a run's layers count only then (the advance after this call).
            reservation.on_received = _layer_counter(
                arrivals, run_index, run.count, self.kv.num_layers, len(cuts) - 1
            )
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
            if self.kv.has_replicas:
                # Off the loop: a long prefix is megabytes of copies.
                await asyncio.to_thread(self.kv.replicate, pages)
        except BaseException as exc:
            # Closes the connection if receives are still posted into these pages, so
            # nothing writes into them once they are computed (or freed) instead.
            self.receiver.cancel(rid)
            log.warning(
                "prefix_fetch_failed",
                source=run.source,
                first_block=run.first,
                blocks=run.count,
                error=str(exc),
            )
            raise


def _layer_counter(
    arrivals: LayerArrivals, run: int, blocks: int, layers: int, pieces: int
) -> Callable[[int], None]:
    """`Reservation.on_received` for one run of a fetch: counts each landed index
    against its layer (index `(i * layers + layer) * pieces + j`) and tells `arrivals`
    how many leading layers are whole."""
    per_layer = blocks * pieces
    counts = [0] * layers
    whole = 0

    def landed(index: int) -> None:
        nonlocal whole
        counts[(index // pieces) % layers] += 1
        if whole < layers and counts[whole] == per_layer:
            while whole < layers and counts[whole] == per_layer:
                whole += 1
            arrivals.advance(run, whole)

    return landed
