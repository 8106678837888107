"""The model, its paged KV cache and the one thread that runs it, for an engine service.

Torch work must not run on the event loop (it would stall heartbeats, NATS pings and
UCX progress), and the runner's cache and allocator are not thread-safe, so every
model call and every page allocation goes through `EngineHost.call`, which runs it on
a single dedicated thread in submission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from yb_core.config import EngineConfig, YbConfig
from yb_core.telemetry import get_logger
from yb_engine.models import load_engine_model

if TYPE_CHECKING:
    from yb_engine.kv_cache import PageAllocator, PagedKVCache
    from yb_engine.loader import LoadedModel
    from yb_engine.runner import ModelRunner

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

    def follow(self, allocator: PageAllocator, num_pages: int) -> None:
        """Read the KV gauges from the allocator itself at every scrape.

        Pages are the resource a fault must not leak, so what `/metrics` says about
        them is the allocator's own count, never a copy that some path forgot to
        update.
        """
        self.kv_total.set(num_pages)
        self.kv_used.set_function(lambda: allocator.num_used)


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
        attention_backend: str,
    ) -> None:
        self._executor = executor
        self.model = model
        self.cache = cache
        self.allocator = allocator
        self.runner = runner
        self.attention_backend = attention_backend

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
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the engine thread after the work already submitted."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _load(
    cls: type[EngineHost], executor: ThreadPoolExecutor, cfg: YbConfig, engine: EngineConfig
) -> EngineHost:
    """Engine thread: load the model, allocate its cache, warm it up."""
    import torch

    from yb_engine.attention import attention_backend_name
    from yb_engine.kv_cache import PageAllocator, PagedKVCache
    from yb_engine.runner import ModelRunner

    # 0: torch's own default, which honours OMP_NUM_THREADS (`yb up` sets 1: its
    # engines share the machine, and more threads than cores only contend).
    threads = engine.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    model = load_engine_model(
        cfg.model,
        cfg.model_cache_dir(),
        progress=lambda msg: log.info("model_progress", message=msg),
    )
    cache = PagedKVCache(
        model.config,
        engine.num_kv_pages,
        cfg.model.block_size,
        dtype=model.dtype,
        device=model.device,
    )
    allocator = PageAllocator(engine.num_kv_pages)
    runner = ModelRunner(model, cache)
    backend = attention_backend_name(cache.device, cfg.model.block_size, model.dtype)
    _warm_up(runner, allocator, cache)
    log.info(
        "engine_loaded",
        layers=model.config.num_layers,
        pages=engine.num_kv_pages,
        block_size=cfg.model.block_size,
        attention=backend,
        threads=threads,
    )
    return cls(executor, model, cache, allocator, runner, backend)


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
