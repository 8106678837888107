"""KV memory sized for what an engine can use: the rule's arithmetic on made-up
machines, and an engine that sizes, allocates and says what it chose."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from yb_core.config import (
    DecodeEngineConfig,
    EngineConfig,
    PrefillEngineConfig,
    load_config,
)
from yb_core.kv_spec import KVCacheSpec
from yb_engine import kv_sizing as ks
from yb_engine.host import EngineGauges, EngineHost
from yb_engine.models import DeviceUnavailable, resolve_device

GiB = 2**30
# SmolLM2-135M: 30 layers, 3 KV heads of 64; a 64-token fp32 page of every layer.
SMOLLM2_KV = KVCacheSpec(parts=("k", "v"), heads=3, dim=64, dtype="float32", num_layers=30)
SMOLLM2_PAGE = SMOLLM2_KV.block_nbytes(64)
MEMINFO = """MemTotal:       16384000 kB
MemFree:         2000000 kB
MemAvailable:   10485760 kB
Buffers:          100000 kB
"""


def test_page_bytes_of_the_default_model() -> None:
    # keys and values of 64 tokens x 3 heads x 64 dims x 4 bytes, in 30 layers
    assert SMOLLM2_PAGE == 30 * 2 * 64 * 3 * 64 * 4 == 2_949_120
    bf16 = KVCacheSpec(parts=("k", "v"), heads=3, dim=64, dtype="bfloat16", num_layers=30)
    assert bf16.block_nbytes(256) == 2 * SMOLLM2_PAGE  # bf16, 256 tokens
    assert (ks.pages_for(8192, 64), ks.pages_for(8193, 64), ks.pages_for(1, 256)) == (
        128,
        129,
        1,
    )


def test_host_memory_is_mem_available_or_what_the_cgroup_leaves() -> None:
    assert ks.host_memory_available(MEMINFO) == 10 * GiB
    assert ks.host_memory_available(MEMINFO, "max\n", "123\n") == 10 * GiB
    limit, used = 4 * GiB, GiB
    assert ks.host_memory_available(MEMINFO, f"{limit}\n", f"{used}\n") == 3 * GiB
    assert ks.host_memory_available(MEMINFO, f"{GiB}\n", f"{2 * GiB}\n") == 0
    with pytest.raises(ValueError, match="MemAvailable"):
        ks.host_memory_available("MemTotal: 1 kB\n")


def test_reading_the_machine(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(MEMINFO)
    assert ks.read_host_memory_available(tmp_path) == 10 * GiB  # no cgroup files
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text(f"{2 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{GiB // 2}\n")
    assert ks.read_host_memory_available(tmp_path) == GiB + GiB // 2
    assert ks.read_host_memory_available() > 0  # this machine's own figure parses


def test_yb_up_on_a_laptop_takes_what_each_engine_can_use() -> None:
    """The default model on the CPU, with the default settings: a prefill holds one
    8,192-token prompt, its prefix cache in those pages while they are idle; the
    decode batch shares one such room."""
    prefill_cfg, decode_cfg = PrefillEngineConfig(), DecodeEngineConfig()

    def sized(engine: PrefillEngineConfig | DecodeEngineConfig) -> ks.KVSizing:
        return ks.sequences_kv(
            sequences=engine.kv_sequences,
            page_nbytes=SMOLLM2_PAGE,
            seq_pages=128,
            max_batch_size=engine.max_batch_size,
            prefix_cache_pages=getattr(engine, "prefix_cache_pages", 0),
            max_len=8192,
        )

    prefill, decode = sized(prefill_cfg), sized(decode_cfg)
    assert (prefill.pages, prefill.prefix_cache_pages, prefill.bound) == (128, 64, "")
    assert "the prefix cache keeps up to 64 of those pages while idle" in prefill.reason
    assert (decode.pages, decode.prefix_cache_pages, decode.bound) == (128, 0, "")
    assert prefill.source == decode.source == "kv_sequences"
    assert "1 sequence(s) of 8192 tokens" in decode.reason
    # `yb up`'s two prefill engines and one decode engine: 1.1 GiB of KV in all,
    # whatever else the machine holds
    assert 2 * prefill.nbytes + decode.nbytes == 384 * SMOLLM2_PAGE < 1.1 * GiB
    # A prefill computes one prompt at a time: more sequences than that is the ceiling.
    more = ks.sequences_kv(
        sequences=4,
        page_nbytes=SMOLLM2_PAGE,
        seq_pages=128,
        max_batch_size=1,
        prefix_cache_pages=0,
        max_len=8192,
    )
    assert (more.pages, more.bound) == (128, "ceiling")
    assert "(max_batch_size 1)" in more.reason


def test_a_budget_sizes_each_engine_between_floor_and_ceiling() -> None:
    budget = GiB
    decode = ks.size_kv(
        budget_bytes=budget,
        page_nbytes=SMOLLM2_PAGE,
        seq_pages=128,
        max_batch_size=32,
        prefix_cache_pages=256,
        source="kv_memory_bytes",
        reason="",
    )
    assert decode.pages == budget // SMOLLM2_PAGE == 364
    assert decode.bound == ""
    assert decode.nbytes <= budget
    # the prefix cache gets what is left beside one 8,192-token request
    assert decode.prefix_cache_pages == min(256, 364 - 128)
    prefill = ks.size_kv(
        budget_bytes=budget,
        page_nbytes=SMOLLM2_PAGE,
        seq_pages=128,
        max_batch_size=1,
        prefix_cache_pages=256,
        source="kv_memory_bytes",
        reason="",
    )
    # one job at a time: one longest request plus the whole prefix cache is all it uses
    assert (prefill.pages, prefill.bound, prefill.prefix_cache_pages) == (364, "", 236)
    big = ks.size_kv(
        budget_bytes=64 * GiB,
        page_nbytes=SMOLLM2_PAGE,
        seq_pages=128,
        max_batch_size=1,
        prefix_cache_pages=256,
        source="kv_memory_bytes",
        reason="",
    )
    assert (big.pages, big.bound, big.prefix_cache_pages) == (128 + 256, "ceiling", 256)


def test_a_budget_below_one_request_gets_the_floor_and_no_prefix_cache() -> None:
    small = ks.size_kv(
        budget_bytes=10 * SMOLLM2_PAGE,
        page_nbytes=SMOLLM2_PAGE,
        seq_pages=128,
        max_batch_size=32,
        prefix_cache_pages=256,
        source="kv_memory_bytes",
        reason="",
    )
    assert (small.pages, small.bound, small.prefix_cache_pages) == (128, "floor", 0)
    assert small.log_fields()["bound"] == "floor"
    with pytest.raises(ValueError):
        ks.size_kv(
            budget_bytes=GiB,
            page_nbytes=0,
            seq_pages=1,
            max_batch_size=1,
            prefix_cache_pages=0,
            source="kv_memory_bytes",
            reason="",
        )


def test_explicit_pages_are_kept_and_bound_the_prefix_cache() -> None:
    kv = ks.explicit_kv(64, SMOLLM2_PAGE, 256)
    assert (kv.pages, kv.prefix_cache_pages, kv.source) == (64, 64, "num_kv_pages")
    assert ks.explicit_kv(1024, SMOLLM2_PAGE, 256).prefix_cache_pages == 256
    with pytest.raises(ValueError):
        ks.explicit_kv(0, SMOLLM2_PAGE, 0)


def test_cuda_budget_is_the_engines_share_less_weights_and_activations() -> None:
    total = 80 * GiB
    # alone on an H100: 0.9 of 80 GiB, less 1 GiB of weights and 2 GiB of activations
    alone = ks.cuda_budget(
        total=total, free=79 * GiB, reserved=GiB, activation_peak=2 * GiB, utilization=0.9
    )
    assert alone == int(total * 0.9) - 3 * GiB
    # three engines share it (`yb up` gives each 0.3): each stays within its share
    share = ks.cuda_budget(
        total=total, free=79 * GiB, reserved=GiB, activation_peak=2 * GiB, utilization=0.3
    )
    assert share == int(total * 0.3) - 3 * GiB
    # another process holds most of the device: never more than is free
    crowded = ks.cuda_budget(
        total=total, free=10 * GiB, reserved=GiB, activation_peak=2 * GiB, utilization=0.9
    )
    assert crowded == 8 * GiB
    full = ks.cuda_budget(
        total=total, free=GiB, reserved=GiB, activation_peak=2 * GiB, utilization=0.9
    )
    assert full == 0


def test_activation_peak_grows_with_context_batch_and_chunk() -> None:
    shape = dict(
        hidden=576,
        q_size=576,
        kv_size=192,
        intermediate=1536,
        num_heads=9,
        head_dim=64,
        vocab=49152,
        element_size=2,
    )
    base = ks.activation_peak_estimate(**shape, chunk_size=512, max_batch_size=32, max_len=8192)
    assert base > 0
    assert (
        ks.activation_peak_estimate(**shape, chunk_size=512, max_batch_size=64, max_len=8192) > base
    )
    assert (
        ks.activation_peak_estimate(**shape, chunk_size=512, max_batch_size=32, max_len=16384)
        > base
    )
    # decode at batch 32 over 8,192 tokens: its gathered keys and values alone
    assert base >= 32 * 2 * 8192 * 9 * 64 * 2


# --- the engine host --------------------------------------------------------------------


def load_host(tmp_path: Path, engine: EngineConfig, **model: str) -> EngineHost:
    cfg = load_config(
        env={"YB_DATA_DIR": str(tmp_path)},
        overrides={"model": {"source": "tiny-random", **model}},
    )

    async def load() -> EngineHost:
        return await EngineHost.load(cfg, engine, "test")

    return asyncio.run(load())


@pytest.fixture
def info_logs() -> Iterator[list[dict[str, Any]]]:
    """Every log event at info and above (the suite logs warnings only)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)


def test_engine_sizes_its_cache_from_the_budget_and_logs_why(
    tmp_path: Path, info_logs: list[dict[str, Any]]
) -> None:
    engine = PrefillEngineConfig(
        threads=1, kv_memory_bytes=200 * 32768 + 1000, prefix_cache_pages=50, max_batch_size=4
    )
    host = load_host(tmp_path, engine, device="cpu")
    logs = info_logs
    try:
        # the tiny model: 2 layers x 2 KV heads x 16 dims x 64 tokens x K,V x fp32
        page = host.cache.spec.block_nbytes(64)
        assert page == 32768 == host.cache.page_nbytes * host.cache.num_layers
        assert host.cache.num_pages == host.allocator.num_pages == 200
        assert host.kv.source == "kv_memory_bytes"
        assert host.prefix_cache_pages == 50
        assert host.cache.kv.numel() * host.cache.kv.element_size() == host.kv.nbytes
        sized = [e for e in logs if e["event"] == "kv_cache_sized"]
        assert len(sized) == 1
        assert sized[0]["pages"] == 200 and sized[0]["bytes"] == 200 * page
        assert sized[0]["source"] == "kv_memory_bytes"
        assert "kv_memory_bytes" in sized[0]["reason"]
        loaded = next(e for e in logs if e["event"] == "engine_loaded")
        assert (loaded["pages"], loaded["device"], loaded["dtype"]) == (200, "cpu", "float32")
        assert loaded["attention"] == host.attention_backend == host.runner.attention_backend
    finally:
        host.close()


def test_engine_without_settings_takes_what_it_can_use(tmp_path: Path) -> None:
    engine = PrefillEngineConfig(threads=1, max_batch_size=2, kv_sequences=3, prefix_cache_pages=8)
    host = load_host(tmp_path, engine, device="cpu")
    try:
        assert host.kv.source == "kv_sequences"
        # tiny model: 4,096 positions = 64 pages per sequence; 3 asked, 2 at most at once,
        # the prefix cache within them
        assert (host.kv.pages, host.kv.bound) == (2 * 64, "ceiling")
        assert host.cache.num_pages == 128
        assert host.prefix_cache_pages == 8
    finally:
        host.close()
    decode = load_host(tmp_path, DecodeEngineConfig(threads=1, kv_sequences=2), device="cpu")
    try:
        # two sequences' pages, and no prefix cache: only a prefill keeps one
        assert (decode.kv.pages, decode.kv.bound, decode.prefix_cache_pages) == (128, "", 0)
    finally:
        decode.close()


def test_explicit_page_count_wins(tmp_path: Path) -> None:
    engine = PrefillEngineConfig(
        threads=1, num_kv_pages=48, kv_memory_bytes=10**9, prefix_cache_pages=100
    )
    host = load_host(tmp_path, engine)
    try:
        assert (host.cache.num_pages, host.kv.source) == (48, "num_kv_pages")
        assert host.prefix_cache_pages == 48
    finally:
        host.close()


def test_metrics_name_the_attention_path(tmp_path: Path) -> None:
    host = load_host(tmp_path, EngineConfig(threads=1, num_kv_pages=16))
    try:
        registry = CollectorRegistry()
        gauges = EngineGauges(registry)
        gauges.follow(host)
        labels = {"backend": host.attention_backend, "device": "cpu", "dtype": "float32"}
        assert registry.get_sample_value("yb_engine_attention_backend", labels) == 1.0
        assert registry.get_sample_value("yb_engine_kv_pages_total") == 16
    finally:
        host.close()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7"])
def test_asking_for_cuda_without_it_fails_at_start(tmp_path: Path, device: str) -> None:
    import torch

    if torch.cuda.is_available() and device != "cuda:7":
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceUnavailable, match=r"model\.device is 'cuda"):
        resolve_device(device)
    with pytest.raises(DeviceUnavailable, match="cuda"):
        load_host(tmp_path, EngineConfig(threads=1, num_kv_pages=16), device=device)


def test_auto_device_is_the_cpu_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == torch.device("cpu")
    host = load_host(tmp_path, EngineConfig(threads=1, num_kv_pages=16))
    try:
        assert (host.cache.device.type, host.model.dtype) == ("cpu", torch.float32)
        assert host.cache.block_size == 64
    finally:
        host.close()
