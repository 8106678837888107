"""The model, its paged KV cache and the one thread that runs it, for an engine service.

Torch work must not run on the event loop (it would stall heartbeats, NATS pings and
UCX progress), and the runner's cache and allocator are not thread-safe, so every
model call and every page allocation goes through `EngineHost.call`, which runs it on
a single dedicated thread in submission order.

A call may lend that thread out from inside itself (`EnginePause`, `yb_engine.pausing`):
held at a layer boundary, it runs what is submitted meanwhile, then goes on with its
own state where it stopped. That is how a prefill pauses a batch line's forward pass
for an interactive prompt without waiting for the end of its chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from yb_core.config import EngineConfig, YbConfig
from yb_core.telemetry import get_logger
from yb_engine.models import load_engine_model, load_engine_stage
from yb_engine.pausing import EnginePause, EngineThread

if TYPE_CHECKING:
    import torch

    from yb_engine.architecture import ArchConfig
    from yb_engine.kv_cache import PageAllocator, PagedKVCache
    from yb_engine.kv_sizing import KVSizing
    from yb_engine.loader import LoadedModel, LoadedStage
    from yb_engine.runner import ModelRunner
    from yb_engine.stages import StageRunner
    from yb_engine.tp_instance import TPInstance

log = get_logger(__name__)
T = TypeVar("T")


class EngineGauges:
    """The load gauges every engine exports, named alike so dashboards fit both roles."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue = Gauge(
            "yb_engine_queue_requests",
            "Requests waiting for the engine (prefill: queued jobs; decode: holding KV, "
            "waiting for a batch slot)",
            registry=registry,
        )
        self.batch = Gauge(
            "yb_engine_batch_size", "Requests the engine is running now", registry=registry
        )
        self.kv_used = Gauge("yb_engine_kv_pages_used", "KV pages in use", registry=registry)
        self.kv_total = Gauge(
            "yb_engine_kv_pages_total", "KV pages in the cache", registry=registry
        )
        self.attention = Gauge(
            "yb_engine_attention_backend",
            "1 for the attention path the engine runs (backend), on its device and dtype",
            ["backend", "device", "dtype"],
            registry=registry,
        )

    def follow(self, engine: EngineHost) -> None:
        """Read the KV gauges from `engine`'s allocator itself at every scrape, and
        export its attention backend, device and dtype as a labelled 1.

        Pages are the resource a fault must not leak, so what `/metrics` says about
        them is the allocator's own count, never a copy that some path forgot to
        update.
        """
        allocator = engine.allocator
        self.kv_total.set(engine.cache.num_pages)
        self.kv_used.set_function(lambda: allocator.num_used)
        self.attention.labels(
            backend=engine.attention_backend,
            device=str(engine.cache.device),
            dtype=str(engine.model.dtype).removeprefix("torch."),
        ).set(1)


class EngineHost:
    """A loaded model, its paged KV cache and page allocator, and the one thread that
    runs every model and page operation on them.

    Built only by `load`, so every part is there from the start: an engine service
    never sees a half-loaded host.
    """

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        model: LoadedModel,
        cache: PagedKVCache,
        allocator: PageAllocator,
        runner: ModelRunner,
        kv: KVSizing,
        ranks: TPInstance | None = None,
    ) -> None:
        self._thread = EngineThread(executor)
        self.model = model
        self.cache = cache
        self.allocator = allocator
        self.runner = runner
        self.kv = kv
        self.ranks = ranks

    @property
    def tensor_parallel(self) -> int:
        """The ranks (devices) this instance spans."""
        return self.ranks.size if self.ranks is not None else 1

    async def watch_ranks(self) -> None:
        """Raise `RankLost` when a rank of this tensor-parallel instance exits; return
        at once for an instance of one rank. An engine service runs it as a
        supervised task, so a lost rank takes the whole instance down."""
        if self.ranks is None:
            return
        from yb_engine.tp_instance import RankLost

        raise RankLost(await self.ranks.lost())

    @property
    def attention_backend(self) -> str:
        """The attention path the runner uses ("torch-sdpa", "flash-attn", ...)."""
        return self.runner.attention_backend

    @property
    def prefix_cache_pages(self) -> int:
        """Pages the prefill engine's prefix cache may keep (`KVSizing`): at most
        `prefix_cache_pages`; from a byte budget, only what is left beside one longest
        request, on the CPU idle pages of the engine's own."""
        return self.kv.prefix_cache_pages

    @classmethod
    async def load(cls, cfg: YbConfig, engine: EngineConfig, name: str) -> EngineHost:
        """Start the engine thread, load weights and allocate the KV cache on it.

        If loading fails or is cancelled, the thread is told to stop (a load already
        running on it finishes there and is dropped).
        """
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, _load, cls, executor, cfg, engine)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread and await its result."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue `fn(*args)` on the engine thread; the future of its result (no task
        of its own: cancelling the future does not stop a call already running).
        While a call is held at a layer boundary, the thread runs it there."""
        return self._thread.submit(fn, *args)

    def pause_point(self) -> EnginePause:
        """A pause for one prefill call (`ModelRunner.prefill`'s `hold`): event loop
        only. On a tensor-parallel instance every rank holds with rank 0
        (`TensorParallelRunner.holding_hook`)."""
        return self._thread.pause_point()

    def close(self) -> None:
        """Stop the engine thread after the work already submitted, and the other
        ranks of a tensor-parallel instance. A call held at a layer boundary is
        abandoned (its hook raises), so the thread is not left waiting."""
        self._thread.close()
        if self.ranks is not None:
            self.ranks.close()


def _load(
    cls: type[EngineHost], executor: ThreadPoolExecutor, cfg: YbConfig, engine: EngineConfig
) -> EngineHost:
    """Engine thread: load the model, size and allocate its cache, warm it up."""
    import torch

    from yb_engine.kv_cache import PageAllocator, PagedKVCache
    from yb_engine.kv_quant import kv_dtype_for
    from yb_engine.runner import ModelRunner

    # 0: torch's own default, which honours OMP_NUM_THREADS (`yb up` sets 1: its
    # engines share the machine, and more threads than cores only contend).
    threads = engine.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    size = cfg.tensor_parallel_of(engine)
    if size > 1:
        return _load_tensor_parallel(cls, executor, cfg, engine, size, threads)
    model = load_engine_model(
        cfg.model,
        cfg.model_cache_dir(),
        progress=lambda msg: log.info("model_progress", message=msg),
    )
    device = torch.device(model.device)
    kv = size_kv_cache(cfg, engine, model.config, model.dtype, device)
    cache = PagedKVCache(
        model.config,
        kv.pages,
        cfg.model.block_size,
        dtype=kv_dtype_for(cfg.model.kv_dtype, model.dtype),
        device=device,
    )
    spec = cache.spec
    log.info(
        "kv_cache_sized",
        device=str(device),
        family=model.config.family,
        kv_layout=spec.layout_id,
        kv_bytes_per_token=spec.bytes_per_token,
        **kv.log_fields(),
    )
    if kv.bound == "floor":
        log.warning(
            "kv_cache_below_budget_floor",
            pages=kv.pages,
            budget_bytes=kv.budget_bytes,
            consequence="allocating one longest request's pages anyway; lower "
            "model.max_model_len or give the engine more memory",
        )
    allocator = PageAllocator(kv.pages)
    runner = ModelRunner(model, cache)
    _warm_up(runner, allocator, cache)
    log.info(
        "engine_loaded",
        layers=model.config.num_layers,
        pages=kv.pages,
        block_size=cfg.model.block_size,
        device=str(device),
        dtype=str(model.dtype).removeprefix("torch."),
        attention=runner.attention_backend,
        threads=threads,
    )
    return cls(executor, model, cache, allocator, runner, kv)


def _load_tensor_parallel(
    cls: type[EngineHost],
    executor: ThreadPoolExecutor,
    cfg: YbConfig,
    engine: EngineConfig,
    size: int,
    threads: int,
) -> EngineHost:
    """Engine thread: start a tensor-parallel instance of `size` ranks
    (`yb_engine.tp_instance`): its pages sized for the whole instance, every rank
    loading its share at once."""
    from yb_engine.kv_cache import PageAllocator
    from yb_engine.kv_quant import kv_dtype_for
    from yb_engine.models import engine_arch, resolve_device, resolve_dtype
    from yb_engine.tensor_parallel import check_degree
    from yb_engine.tp_instance import check_device, start_instance

    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model, device)
    arch = engine_arch(cfg.model, cfg.model_cache_dir())
    why = check_degree(arch, size) or check_device(device, size)
    if why is not None:
        raise ValueError(f"{arch.model_id} cannot run on {size} tensor-parallel ranks: {why}")
    kv = size_kv_cache(cfg, engine, arch, dtype, device)
    runner, sharded, ranks, model = start_instance(
        cfg.model,
        cfg.model_cache_dir(),
        size=size,
        arch=arch,
        num_pages=kv.pages,
        block_size=cfg.model.block_size,
        kv_dtype=kv_dtype_for(cfg.model.kv_dtype, dtype),
        threads=threads,
        timeout_s=cfg.model.collective_timeout_s,
        load_timeout_s=max(600.0, cfg.model.collective_timeout_s),
        load_own=lambda shard: load_engine_model(
            cfg.model,
            cfg.model_cache_dir(),
            progress=lambda msg: log.info("model_progress", message=msg),
            shard=shard,
        ),
    )
    try:
        allocator = PageAllocator(kv.pages)
        _warm_up(runner, allocator, sharded)
    except BaseException:
        ranks.close()
        raise
    spec = sharded.spec
    log.info(
        "kv_cache_sized",
        device=str(device),
        family=arch.family,
        kv_layout=spec.layout_id,
        kv_bytes_per_token=spec.bytes_per_token,
        tensor_parallel=size,
        **kv.log_fields(),
    )
    log.info(
        "engine_loaded",
        layers=arch.num_layers,
        pages=kv.pages,
        block_size=cfg.model.block_size,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attention=runner.attention_backend,
        threads=threads,
        tensor_parallel=size,
        head_cuts=sharded.head_cuts,
    )
    return cls(executor, model, sharded, allocator, runner, kv, ranks)


class StageHost:
    """One pipeline stage of the model (its layers' weights), its paged KV cache of
    those layers and its page allocator, for a stage of a prefill group.

    Every chunk is computed on the stage's one thread (`call`), in submission order
    (`yb_engine.stages.serve_stage_request`'s `compute`). Pages are taken and given
    back on the event loop; pages a compute may still be writing (its request failed
    while the thread ran) are given back only after `call` of anything, which runs
    once the thread has finished what was queued before.
    """

    def __init__(
        self, stage: LoadedStage, cache: PagedKVCache, allocator: PageAllocator, kv: KVSizing
    ) -> None:
        from yb_engine.stages import StageRunner

        self.stage = stage
        self.cache = cache
        self.allocator = allocator
        self.kv = kv
        self.runner: StageRunner = StageRunner(stage, cache)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the stage's thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the stage's thread after the work already submitted."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    @classmethod
    async def load(cls, cfg: YbConfig, engine: EngineConfig, stage: int, stages: int) -> StageHost:
        """Load stage `stage` of `stages` (the layers cut by `LayerRange.split`) and
        allocate its KV pages, off the event loop."""
        return await asyncio.to_thread(_load_stage, cls, cfg, engine, stage, stages)


def _load_stage(
    cls: type[StageHost], cfg: YbConfig, engine: EngineConfig, index: int, stages: int
) -> StageHost:
    """Worker thread: read the model's shape, load the stage's layers, size its pages."""
    import torch

    from yb_engine.architecture import LayerRange
    from yb_engine.kv_cache import PageAllocator
    from yb_engine.kv_quant import kv_dtype_for
    from yb_engine.stages import stage_cache

    torch.set_num_threads(engine.threads or torch.get_num_threads())

    def share(arch: ArchConfig) -> LayerRange:
        return LayerRange.split(arch.num_layers, stages)[index]

    stage = load_engine_stage(
        cfg.model,
        cfg.model_cache_dir(),
        share,
        progress=lambda msg: log.info("model_progress", message=msg),
    )
    layer_range = stage.layer_range
    arch = stage.config
    device = torch.device(stage.device)
    kv = size_kv_cache(cfg, engine, arch, stage.dtype, device, num_layers=len(layer_range))
    cache = stage_cache(
        stage, kv.pages, cfg.model.block_size, dtype=kv_dtype_for(cfg.model.kv_dtype, stage.dtype)
    )
    log.info(
        "stage_loaded",
        layers=f"[{layer_range.start}, {layer_range.end}) of {arch.num_layers}",
        block_size=cfg.model.block_size,
        device=str(device),
        dtype=str(stage.dtype).removeprefix("torch."),
        **kv.log_fields(),
    )
    return cls(stage, cache, PageAllocator(kv.pages), kv)


def size_kv_cache(
    cfg: YbConfig,
    engine: EngineConfig,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int | None = None,
) -> KVSizing:
    """How many KV pages this engine allocates (`yb_engine.kv_sizing`'s rule), from
    its settings and the memory of the machine (and device) it runs on; a pipeline
    stage's pages hold its `num_layers` layers only. A page is counted whole (every
    head): a tensor-parallel instance's ranks hold it between them. `dtype` is the
    model's; the pages hold `model.kv_dtype`."""
    import torch

    from yb_engine import kv_sizing as ks
    from yb_engine.kv_quant import kv_dtype_for

    element_size = torch.empty(0, dtype=dtype).element_size()
    block_size = cfg.model.block_size
    layers = arch.num_layers if num_layers is None else num_layers
    # What a page holds is the model's (its KV cache spec), of every layer it keeps.
    kv_dtype = kv_dtype_for(cfg.model.kv_dtype, dtype)
    spec = arch.kv_spec(str(kv_dtype).removeprefix("torch."), 0, layers)
    page = spec.block_nbytes(block_size)
    # Only a prefill engine keeps a prefix cache.
    prefix_cache_pages = getattr(engine, "prefix_cache_pages", 0)
    if engine.num_kv_pages:
        return ks.explicit_kv(engine.num_kv_pages, page, prefix_cache_pages)
    max_len = min(cfg.model.max_model_len, arch.max_position or cfg.model.max_model_len)
    seq_pages = ks.pages_for(max_len, block_size)
    source: ks.Source
    if engine.kv_memory_bytes:
        source, budget = "kv_memory_bytes", engine.kv_memory_bytes
        reason = f"engine.kv_memory_bytes = {budget}"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        peak = ks.activation_peak_estimate(
            hidden=arch.hidden,
            q_size=arch.q_size,
            kv_size=arch.kv_size,
            intermediate=arch.intermediate,
            num_heads=arch.num_heads,
            head_dim=arch.head_dim,
            vocab=arch.vocab,
            chunk_size=engine.chunk_size,
            max_batch_size=engine.max_batch_size,
            max_len=max_len,
            element_size=element_size,
        )
        source = "cuda"
        budget = ks.cuda_budget(
            total=total,
            free=free,
            reserved=reserved,
            activation_peak=peak,
            utilization=engine.gpu_memory_utilization,
        )
        reason = (
            f"{engine.gpu_memory_utilization:g} of {device}'s {total} bytes, less "
            f"{reserved} held (weights) and an activation peak of {peak}; {free} free"
        )
    else:
        return ks.sequences_kv(
            sequences=engine.kv_sequences,
            page_nbytes=page,
            seq_pages=seq_pages,
            max_batch_size=engine.max_batch_size,
            prefix_cache_pages=prefix_cache_pages,
            max_len=max_len,
        )
    return ks.size_kv(
        budget_bytes=budget,
        page_nbytes=page,
        seq_pages=seq_pages,
        max_batch_size=engine.max_batch_size,
        prefix_cache_pages=prefix_cache_pages,
        source=source,
        reason=reason,
    )


def _warm_up(runner: ModelRunner, allocator: PageAllocator, cache: PagedKVCache) -> None:
    """Run one small prefill and decode step so the first request is not the one
    that pays for first-touch allocations and kernel selection."""
    from yb_engine.runner import DecodeSeq

    tokens = list(range(1, min(cache.block_size, 16) + 1))
    pages = allocator.allocate(cache.pages_for(len(tokens) + 1))
    try:
        runner.prefill(tokens, pages)
        runner.decode([DecodeSeq(pages, len(tokens), tokens[-1])])
    finally:
        allocator.free(pages)
