"""A tensor-parallel engine instance: rank 0, the engine service's own process, and the
ranks 1..N-1 it starts, one process each (`python -m yb_engine.tp_worker`).

To the rest of the cluster the instance is one instance: rank 0 alone is on the bus
and holds the UCX endpoint, the page allocator and the request state; it announces
once, heartbeats once, keeps one queue. Every model call it makes (`prefill`,
`prefill_batch`, `decode`, `mixed`) is first sent to the other ranks as a typed
message over their stdin (`RankCall`, msgpack; the arguments are token ids and page
numbers, a few hundred bytes), then computed by every rank at once over its share of
the weights (`yb_engine.tensor_parallel`), the ranks meeting in the all-reduces of
each layer (`torch.distributed`, gloo on the CPU). Idle ranks wait on their stdin,
not in a collective, so no collective waits longer than one call's compute, and each
is bounded by `model.collective_timeout_s`.

**The KV pages of every rank are memory rank 0 maps.** Each rank keeps its own heads'
pages (`PagedKVCache` of its heads, head-major), allocated by rank 0 as an anonymous
shared-memory file (`memfd`) handed to the rank at start. So rank 0 sends a rank's
heads straight from that rank's pages and receives them straight into them, with no
staging copy and no round trip through the rank (`ShardedKV.pieces`): a TP=a prefill
streams into a TP=b decode piece by piece, each piece a run of heads that one rank
holds on both sides. Heads held by several ranks (more ranks than KV heads; MLA's
latent, which every rank keeps) travel once, from and into the first of them, and are
copied to the others on arrival (`ShardedKV.replicate`).

**Supervised as one.** A rank that exits (killed, crashed, out of memory) is noticed
by a thread waiting on its process; `TPInstance.lost` resolves, the engine service's
task watching it fails, and the service goes down cleanly (it retires from the log,
so the conductor re-plans its requests). The other ranks exit when rank 0 does: their
stdin closes, and the kernel signals them (`PR_SET_PDEATHSIG`).

CUDA ranks would need their pages shared with rank 0 by CUDA IPC instead of a memfd;
that is not built, so a tensor-parallel instance runs on the CPU (`check_device`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import IO, Literal, TypeVar

import msgspec
import torch

from yb_core.config import ModelConfig
from yb_core.telemetry import get_logger
from yb_engine.architecture import ArchConfig
from yb_engine.kv_cache import PagedKVCache
from yb_engine.kv_quant import storage_dtype
from yb_engine.loader import LoadedModel
from yb_engine.pausing import GO, HOLD, EnginePause, PauseAbandoned
from yb_engine.runner import (
    DecodeSeq,
    LayerHook,
    LayerReady,
    ModelRunner,
    PrefillChunk,
    PrefillSeq,
    RowLogits,
)
from yb_engine.tensor_parallel import Shard, TPGroup, head_cuts, owner_ranks

__all__ = [
    "RankLost",
    "ShardedKV",
    "TPInstance",
    "TensorParallelRunner",
    "check_device",
]

log = get_logger(__name__)
T = TypeVar("T")


class RankLost(RuntimeError):
    """A rank of a tensor-parallel instance is gone; the instance cannot compute."""


def check_device(device: torch.device, size: int) -> str | None:
    """Why an instance of `size` ranks cannot run on `device`; None when it can."""
    if size > 1 and device.type != "cpu":
        return (
            f"tensor parallelism runs on the CPU here (gloo, pages shared by memfd); "
            f"ranks on {device.type} need their pages shared by CUDA IPC, not built yet"
        )
    return None


# -- what rank 0 tells the other ranks -----------------------------------------------


class RankStart(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's first message: what to load, where its pages are and whom to meet."""

    rank: int
    size: int
    model: ModelConfig
    cache_dir: str
    kv_fd: int
    num_pages: int
    block_size: int
    threads: int
    store_host: str
    store_port: int
    timeout_s: float


class BatchSeq(msgspec.Struct, frozen=True):
    """One prompt of a `prefill_batch` (its hook is rank 0's alone)."""

    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int


class PrefillCall(msgspec.Struct, frozen=True, tag="prefill"):
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int
    chunk_size: int
    #: Which logits rank 0 asked for: each kind computes (and gathers) a different
    #: number of times, and every rank must meet in every gather.
    logits: Literal["last", "all", "rows"]
    #: Whether the call may hold between two layers (`yb_engine.pausing`): then every
    #: rank meets rank 0's decision after each layer (`TPGroup.agree`); held, it
    #: computes the calls that come meanwhile, until `ResumeCall` or `AbandonCall`.
    holdable: bool = False


class PrefillBatchCall(msgspec.Struct, frozen=True, tag="prefill_batch"):
    seqs: list[BatchSeq]


class DecodeCall(msgspec.Struct, frozen=True, tag="decode"):
    batch: list[DecodeSeq]


class MixedCall(msgspec.Struct, frozen=True, tag="mixed"):
    batch: list[DecodeSeq]
    chunk: PrefillChunk


class StopCall(msgspec.Struct, frozen=True, tag="stop"):
    pass


class ResumeCall(msgspec.Struct, frozen=True, tag="resume"):
    """The innermost held call goes on from the next layer."""


class AbandonCall(msgspec.Struct, frozen=True, tag="abandon"):
    """The innermost held call ends where it is held."""


RankCall = (
    PrefillCall | PrefillBatchCall | DecodeCall | MixedCall | StopCall | ResumeCall | AbandonCall
)

_HEADER = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(RankCall)
_start_decoder = msgspec.msgpack.Decoder(RankStart)


def write_frame(stream: IO[bytes], message: msgspec.Struct) -> None:
    """One length-prefixed msgpack message."""
    payload = _encoder.encode(message)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes | None:
    """The next message's bytes, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    payload = stream.read(n)
    return payload if len(payload) == n else None


def decode_call(payload: bytes) -> RankCall:
    call: RankCall = _call_decoder.decode(payload)
    return call


def decode_start(payload: bytes) -> RankStart:
    return _start_decoder.decode(payload)


# -- the instance's pages --------------------------------------------------------------


def _shared_pages(numel: int, dtype: torch.dtype, name: str) -> tuple[int, torch.Tensor]:
    """A zeroed anonymous shared-memory file of `numel` numbers and rank 0's map of it."""
    fd = os.memfd_create(name, 0)
    try:
        os.ftruncate(fd, numel * torch.empty(0, dtype=dtype).element_size())
        return fd, torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    except BaseException:
        os.close(fd)
        raise


def map_pages(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's map of the pages rank 0 made for it (`RankStart.kv_fd`)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)


class ShardedKV(PagedKVCache):
    """The KV pages of a whole tensor-parallel instance, as rank 0 sees them: every
    rank's pages (its heads of each page), addressed by page number as one cache.

    `spec` is the instance's (every head: what a block of the pool holds); `kv` is rank
    0's own pages, which its forward pass reads. A page is not one region here, so
    transfers address it by runs of heads (`pieces`), never by `page_view`.
    """

    def __init__(
        self,
        arch: ArchConfig,
        size: int,
        num_pages: int,
        block_size: int,
        dtype: torch.dtype,
        rank_pages: Sequence[torch.Tensor],
    ) -> None:
        # No allocation of its own: the pages are the ranks' (`rank_pages`).
        self.arch = arch
        self.num_pages = num_pages
        self.block_size = block_size
        self.dtype = dtype
        self.device = rank_pages[0].device
        self.spec = arch.kv_spec(str(dtype).removeprefix("torch."))
        self.kv = rank_pages[0]
        self.size = size
        self._ranks = list(rank_pages)
        self._cuts = head_cuts(arch, size)
        self._owners = owner_ranks(arch, size)
        self._held = [Shard(r, size).kv_heads(arch) for r in range(size)]

    def page_view(self, layer: int, page: int) -> torch.Tensor:
        raise ValueError(
            f"a page of a tensor-parallel instance ({self.size} ranks) is cut across "
            "ranks: address it by runs of heads (pieces)"
        )

    @property
    def head_cuts(self) -> list[int]:
        """One run of heads per owning rank (`tensor_parallel.head_cuts`)."""
        return list(self._cuts)

    def pieces(self, layer: int, page: int, cuts: Sequence[int]) -> list[torch.Tensor]:
        """Heads `[cuts[i], cuts[i + 1])` of (layer, page), each a view into the pages
        of the rank that owns them; `cuts` must include `head_cuts`."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        out = []
        run = 0
        for a, b in itertools.pairwise(cuts):
            while run < len(self._owners) and self._cuts[run + 1] <= a:
                run += 1
            if run == len(self._owners) or b > self._cuts[run + 1] or a < self._cuts[run]:
                raise ValueError(f"cuts {list(cuts)} do not refine this instance's {self._cuts}")
            owner = self._owners[run][0]
            first = self._held[owner].start if self.arch.mla is None else 0
            out.append(self._ranks[owner][layer, page, a - first : b - first])
        return out

    @property
    def has_replicas(self) -> bool:
        """Whether some run of heads is kept by more than one rank."""
        return any(len(ranks) > 1 for ranks in self._owners)

    def copy_page(self, source: int, target: int) -> None:
        """Copy page `source`'s KV into page `target`, in every layer of every rank."""
        for kv in self._ranks:
            kv[:, target].copy_(kv[:, source])

    def replicate(self, pages: Iterable[int]) -> None:
        """Copy `pages`, received into their owners' pages, to every other rank that
        keeps those heads (each such rank keeps exactly one run: one KV head, or the
        latent)."""
        index = torch.tensor(list(pages), dtype=torch.int64)
        if not index.numel():
            return
        for ranks in self._owners:
            owner, *replicas = ranks
            for r in replicas:
                self._ranks[r][:, index] = self._ranks[owner][:, index]


# -- rank 0 -----------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In a rank's process before it runs: be sent SIGTERM when rank 0 dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class TPInstance:
    """Ranks 1..N-1 of a tensor-parallel instance, as rank 0 runs them: their
    processes, the messages sent to them, and the watch on their lives."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closing = False
        self._lost: str | None = None
        self._lost_event = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]] = []
        self._lock = threading.Lock()
        self.store: object | None = None

    # -- start ----------------------------------------------------------------------

    def spawn(
        self,
        rank: int,
        start: RankStart,
        fd: int,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start rank `rank` and send it `start`."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "yb_engine.tp_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,),
            preexec_fn=_die_with_parent,  # only sets a signal: safe beside threads
            env={**os.environ, **(env or {})},
        )
        self._procs.append(proc)
        assert proc.stdin is not None
        write_frame(proc.stdin, start)
        threading.Thread(
            target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True
        ).start()

    def wait_ready(self, deadline: float) -> None:
        """Wait until every rank has loaded its share and mapped its pages (each writes
        one line), or raise `RankLost` for one that exits or misses `deadline`."""
        for rank, proc in enumerate(self._procs, start=1):
            assert proc.stdout is not None
            line = _read_line(proc.stdout, deadline)
            if line != b"ready\n":
                code = proc.poll()
                raise RankLost(
                    f"rank {rank} did not start (exit code {code}, said {line!r}); its log is above"
                )

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing:
            return
        log.error("tp_rank_lost", rank=rank, pid=proc.pid, code=code)
        self.fail(f"rank {rank} of {self.size} (pid {proc.pid}) exited with code {code}")

    def fail(self, why: str) -> None:
        """The instance cannot compute any more (a rank exited, or a collective failed
        or ran past its deadline: the ranks no longer agree on where they are): every
        call from now on raises `RankLost`, and `lost` resolves."""
        with self._lock:
            if self._lost is None:
                self._lost = why
            waiters, self._waiters = self._waiters, []
        self._lost_event.set()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future, why)

    async def lost(self) -> str:
        """Wait until a rank is lost; why."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        with self._lock:
            if self._lost is not None:
                return self._lost
            self._waiters.append((loop, future))
        return await future

    # -- calls ------------------------------------------------------------------------

    def send(self, call: RankCall) -> None:
        """Send `call` to every other rank; `RankLost` if one is gone."""
        if self._lost is not None:
            raise RankLost(self._lost)
        for rank, proc in enumerate(self._procs, start=1):
            assert proc.stdin is not None
            try:
                write_frame(proc.stdin, call)
            except (BrokenPipeError, OSError) as exc:
                raise RankLost(f"rank {rank} is gone: {exc}") from exc

    def close(self, timeout_s: float = 5.0) -> None:
        """Tell every rank to stop, wait for them (`timeout_s`), kill what is left."""
        self._closing = True
        for proc in self._procs:
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                write_frame(proc.stdin, StopCall())
                proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _resolve(future: asyncio.Future[str], why: str) -> None:
    if not future.done():
        future.set_result(why)


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    """One line from a pipe, or b'' at its end or at `deadline`."""
    import select

    line = b""
    fd = stream.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return line
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return line
        chunk = os.read(fd, 1)
        if not chunk:
            return line
        line += chunk
    return line


class TensorParallelRunner(ModelRunner):
    """Rank 0's `ModelRunner` of a tensor-parallel instance: each call is checked,
    sent to the other ranks, then computed here over rank 0's share, the ranks meeting
    in each layer's all-reduces. `cache` is the instance's pages (`ShardedKV`); the
    forward pass reads rank 0's own."""

    def __init__(
        self,
        model: LoadedModel,
        local_cache: PagedKVCache,
        sharded: ShardedKV,
        tp: TPGroup,
        ranks: TPInstance,
    ) -> None:
        super().__init__(model, local_cache, tp=tp)
        self.cache = sharded
        self.ranks = ranks

    def prefill(
        self,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_cached_tokens: int = 0,
        chunk_size: int = 512,
        layer_hook: LayerHook | None = None,
        all_logits: bool = False,
        row_logits: RowLogits | None = None,
        layer_ready: LayerReady | None = None,
        hold: EnginePause | None = None,
    ) -> torch.Tensor:
        if layer_ready is not None:
            # The other ranks read their pages without waiting on rank 0's arrivals.
            raise ValueError("a tensor-parallel instance loads a prefix before computing on it")
        self.check_prefill(
            token_ids, block_table, num_cached_tokens, chunk_size, all_logits, row_logits
        )
        kind: Literal["last", "all", "rows"] = (
            "all" if all_logits else "rows" if row_logits is not None else "last"
        )
        self.ranks.send(
            PrefillCall(
                list(token_ids),
                list(block_table),
                num_cached_tokens,
                chunk_size,
                kind,
                holdable=hold is not None,
            )
        )
        return self._together(
            lambda: super(TensorParallelRunner, self).prefill(
                token_ids,
                block_table,
                num_cached_tokens,
                chunk_size,
                layer_hook,
                all_logits=all_logits,
                row_logits=row_logits,
                hold=hold,
            )
        )

    def holding_hook(self, hook: LayerHook | None, hold: EnginePause | None) -> LayerHook | None:
        """After each layer (and `hook`), every rank meets rank 0's decision
        (`TPGroup.agree`): all go on, all hold, or all end the call. Held, rank 0
        lends its engine thread; the calls it makes meanwhile reach the other ranks,
        which compute them inside their own held call, and its `ResumeCall` or
        `AbandonCall` ends their hold where it ends rank 0's."""
        if hold is None:
            return hook
        tp = self.decoder.tp
        assert tp is not None

        def at_layer(layer: int, start: int, end: int) -> None:
            if hook is not None:
                hook(layer, start, end)
            step = tp.agree(hold.decide())
            if step == HOLD:
                resumed = hold.hold(layer, start, end)
                self.ranks.send(ResumeCall() if resumed else AbandonCall())
                if resumed:
                    return
            if step != GO:
                raise PauseAbandoned(f"abandoned after layer {layer}")

        return at_layer

    def prefill_batch(self, seqs: Sequence[PrefillSeq]) -> torch.Tensor:
        if not seqs:
            return super().prefill_batch(seqs)
        for seq in seqs:
            self.check_prefill(seq.token_ids, seq.block_table, seq.num_cached_tokens)
        self.ranks.send(
            PrefillBatchCall(
                [
                    BatchSeq(list(s.token_ids), list(s.block_table), s.num_cached_tokens)
                    for s in seqs
                ]
            )
        )
        return self._together(lambda: super(TensorParallelRunner, self).prefill_batch(seqs))

    def decode(self, batch: Sequence[DecodeSeq]) -> torch.Tensor:
        if not batch:
            return super().decode(batch)
        self.check_positions(batch)
        self.ranks.send(DecodeCall(list(batch)))
        return self._together(lambda: super(TensorParallelRunner, self).decode(batch))

    def mixed(
        self, batch: Sequence[DecodeSeq], chunk: PrefillChunk
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.check_mixed(batch, chunk)
        self.ranks.send(MixedCall(list(batch), chunk))
        return self._together(lambda: super(TensorParallelRunner, self).mixed(batch, chunk))

    def _together(self, compute: Callable[[], T]) -> T:
        """`compute()`, this rank's part of a call every rank runs. Its failure (a
        collective whose peer is gone or missed its deadline, or any error here) leaves
        the ranks out of step for good: the instance is failed (`TPInstance.fail`)."""
        try:
            return compute()
        except RankLost:
            raise
        except RuntimeError as exc:
            why = f"a call the ranks compute together failed: {exc}"
            log.error("tp_call_failed", error=str(exc))
            self.ranks.fail(why)
            raise RankLost(why) from exc


def start_instance(
    model_cfg: ModelConfig,
    cache_dir: Path,
    *,
    size: int,
    arch: ArchConfig,
    num_pages: int,
    block_size: int,
    kv_dtype: torch.dtype,
    threads: int,
    timeout_s: float,
    load_timeout_s: float,
    load_own: Callable[[Shard], LoadedModel],
) -> tuple[TensorParallelRunner, ShardedKV, TPInstance, LoadedModel]:
    """Start ranks 1..size-1, load rank 0's share (`load_own(shard)`, while they load
    theirs), meet them, and return rank 0's runner, the instance's pages, the ranks
    and rank 0's model."""
    from torch.distributed import TCPStore

    dtype_name = str(kv_dtype).removeprefix("torch.")
    ranks = TPInstance(size)
    fds: list[int] = []
    rank_pages: list[torch.Tensor] = []
    store = TCPStore(
        "127.0.0.1", 0, size, True, timedelta(seconds=load_timeout_s), wait_for_workers=False
    )
    ranks.store = store
    try:
        for rank in range(1, size):
            local = Shard(rank, size).local_arch(arch)
            numel = PagedKVCache.numel(local.kv_spec(dtype_name), num_pages, block_size)
            fd, pages = _shared_pages(numel, storage_dtype(kv_dtype), f"yb-kv-rank{rank}")
            fds.append(fd)
            rank_pages.append(pages)
            ranks.spawn(
                rank,
                RankStart(
                    rank=rank,
                    size=size,
                    model=model_cfg,
                    cache_dir=str(cache_dir),
                    kv_fd=fd,
                    num_pages=num_pages,
                    block_size=block_size,
                    threads=threads,
                    store_host="127.0.0.1",
                    store_port=store.port,
                    timeout_s=timeout_s,
                ),
                fd,
            )
        for fd in fds:  # each rank holds its own descriptor now; the maps stay
            os.close(fd)
        fds.clear()
        shard = Shard(0, size)
        model: LoadedModel = load_own(shard)
        local_arch = shard.local_arch(arch)
        cache0 = PagedKVCache(local_arch, num_pages, block_size, dtype=kv_dtype, device="cpu")
        ranks.wait_ready(time.monotonic() + load_timeout_s)
        group = TPGroup(shard, arch, store, timeout_s)
        sharded = ShardedKV(
            arch,
            size,
            num_pages,
            block_size,
            kv_dtype,
            [
                cache0.kv,
                *(
                    pages.view(
                        PagedKVCache.shape_of(
                            Shard(r, size).local_arch(arch).kv_spec(dtype_name),
                            num_pages,
                            block_size,
                        )
                    )
                    for r, pages in enumerate(rank_pages, start=1)
                ),
            ],
        )
        runner = TensorParallelRunner(model, cache0, sharded, group, ranks)
        return runner, sharded, ranks, model
    except BaseException:
        for fd in fds:
            os.close(fd)
        ranks.close(timeout_s=2.0)
        raise
