"""`yb profile`: measure the real runner on this machine and fit the cost model.

Prefill is timed over a grid of (new, cached) token counts, decode steps over a
grid of (batch, context) — on the served model, through `ModelRunner` over a
`PagedKVCache`, exactly the code the engines run. KV contents do not change the
time a step takes, so cached prefixes and decode contexts are not computed first:
their pages are simply allocated, which keeps `--quick` well under two minutes.
Each point is the median of a few runs (the machine is shared).

The closed forms of `cost_model` are fitted by non-negative least squares (tiny: at
most three coefficients, so every subset is tried and the best feasible one kept).
Transfer bandwidths: local DRAM is measured as a memcpy of KV-sized buffers; an SSD
read is measured on a file written and dropped from the page cache in the data
directory; the network (remote) bandwidth cannot be measured from one host and is a
flag (`--network-gbps`, default: that of the current default model).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from yb_conductor.cost_model import (
    DEFAULT,
    CostModel,
    DecodeCost,
    FitReport,
    PrefillCost,
    TransferCost,
)
from yb_core.config import YbConfig


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure."""

    prefill: Sequence[tuple[int, int]]
    decode: Sequence[tuple[int, int]]
    repeats: int
    copy_mb: int


QUICK = Grid(
    prefill=[(n, c) for n in (64, 256, 1024) for c in (0, 1024)],
    decode=[(b, ctx) for b in (1, 4, 16) for ctx in (128, 1024)],
    repeats=3,
    copy_mb=64,
)
FULL = Grid(
    prefill=[(n, c) for n in (32, 128, 512, 1024, 2048) for c in (0, 512, 2048)],
    decode=[(b, ctx) for b in (1, 2, 4, 8, 16, 32) for ctx in (128, 512, 2048)],
    repeats=5,
    copy_mb=256,
)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: every support subset."""
    n = a.shape[1]
    best = np.zeros(n)
    best_err = float(np.sum(b**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(n)
                best[list(cols)] = x
    return best


def fit_prefill(samples: Sequence[tuple[int, int, float]]) -> tuple[PrefillCost, float]:
    """Fit base + per_token*N + per_pair*N*(C + N/2), weighting relative error."""
    rows = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in samples])
    t = np.array([s for _, _, s in samples])
    w = 1.0 / t  # relative error: short prefills matter as much as long ones
    x = nnls(rows * w[:, None], t * w)
    model = PrefillCost(base_s=float(x[0]), per_token_s=float(x[1]), per_pair_s=float(x[2]))
    pred = rows @ x
    return model, float(np.mean(np.abs(pred - t) / t))


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> tuple[DecodeCost, float]:
    """Fit base + per_seq*B + per_context_token*(B*ctx), weighting relative error."""
    rows = np.array([[1.0, b, b * ctx] for b, ctx, _ in samples])
    t = np.array([s for _, _, s in samples])
    w = 1.0 / t
    x = nnls(rows * w[:, None], t * w)
    model = DecodeCost(base_s=float(x[0]), per_seq_s=float(x[1]), per_context_token_s=float(x[2]))
    pred = rows @ x
    return model, float(np.mean(np.abs(pred - t) / t))


def _median_time(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median seconds of `fn`; `sync` waits for the device (CUDA runs asynchronously,
    so a call returns before its kernels finish)."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_gbps(mb: int) -> float:
    """Memory bandwidth of one large copy (the local DRAM load path's ceiling)."""
    import torch

    src = torch.empty(mb * 1024 * 1024, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    seconds = _median_time(lambda: dst.copy_(src), 5)
    return mb * 1024 * 1024 / seconds / 1e9


def measure_read_gbps(directory: Path, mb: int) -> float:
    """Sequential read of a file just written and dropped from the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1024 * 1024)
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as f:
        path = Path(f.name)
        for _ in range(mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, 8 * 1024 * 1024):
                pass
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return mb * 1024 * 1024 / seconds / 1e9


def profile_engine(
    cfg: YbConfig,
    *,
    quick: bool = True,
    threads: int = 0,
    network_gbps: float = DEFAULT.transfer.dram_remote_gbps,
    progress: Callable[[str], None] = print,
) -> CostModel:
    """Measure the configured model's runner here and fit a `CostModel`."""
    import torch

    from yb_engine import ModelRunner, PageAllocator, PagedKVCache
    from yb_engine.kv_quant import kv_dtype_for
    from yb_engine.models import load_engine_model
    from yb_engine.runner import DecodeSeq

    grid = QUICK if quick else FULL
    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    started = time.monotonic()
    progress(f"loading model {cfg.model.name} ({cfg.model.source})")
    model = load_engine_model(cfg.model, cfg.model_cache_dir(), progress)
    device = torch.device(model.device)
    dtype_name = str(model.dtype).removeprefix("torch.")
    kv_name = str(kv_dtype_for(cfg.model.kv_dtype, model.dtype)).removeprefix("torch.")
    progress(f"on {device} in {dtype_name} (KV {kv_name}), {cfg.model.block_size}-token pages")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    arch = model.config
    bs = cfg.model.block_size
    max_new = max(n for n, _ in grid.prefill)
    max_tokens = max(max_new + c for n, c in grid.prefill)
    max_decode = max(b * -(-(ctx + 1) // bs) for b, ctx in grid.decode)
    num_pages = max(-(-max_tokens // bs), max_decode) + 4
    kv_dtype = kv_dtype_for(cfg.model.kv_dtype, model.dtype)
    cache = PagedKVCache(arch, num_pages, bs, dtype=kv_dtype, device=model.device)
    alloc = PageAllocator(num_pages)
    runner = ModelRunner(model, cache)
    progress(f"attention: {runner.attention_backend}")
    kv_bytes_per_token = cache.spec.bytes_per_token  # the model's, latent attention included
    rng = random.Random(0)
    vocab = arch.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    # Warm up (first-touch allocations, kernel selection).
    pages = alloc.allocate(cache.pages_for(64))
    runner.prefill(tokens(64), pages)
    alloc.free(pages)

    prefill_samples: list[tuple[int, int, float]] = []
    for new, cached in grid.prefill:
        total = new + cached
        pages = alloc.allocate(cache.pages_for(total))
        ids = tokens(total)

        def run_prefill(
            ids: list[int] = ids, pages: list[int] = pages, cached: int = cached
        ) -> None:
            runner.prefill(ids, pages, num_cached_tokens=cached, chunk_size=cfg.prefill.chunk_size)

        seconds = _median_time(run_prefill, grid.repeats, sync)
        alloc.free(pages)
        prefill_samples.append((new, cached, seconds))
        progress(f"prefill new={new:5d} cached={cached:5d}: {seconds * 1e3:8.1f} ms")

    decode_samples: list[tuple[int, int, float]] = []
    for batch, ctx in grid.decode:
        seqs = []
        held = []
        for _ in range(batch):
            pages = alloc.allocate(cache.pages_for(ctx + 1))
            held.append(pages)
            seqs.append(DecodeSeq(pages, ctx, rng.randrange(1, vocab)))

        def run_decode(seqs: list[DecodeSeq] = seqs) -> None:
            runner.decode(seqs)

        run_decode()
        seconds = _median_time(run_decode, grid.repeats + 2, sync)
        for pages in held:
            alloc.free(pages)
        decode_samples.append((batch, ctx, seconds))
        progress(f"decode batch={batch:3d} context={ctx:5d}: {seconds * 1e3:8.2f} ms/step")

    prefill, prefill_err = fit_prefill(prefill_samples)
    decode, decode_err = fit_decode(decode_samples)
    copy_gbps = measure_copy_gbps(grid.copy_mb)
    progress(f"memcpy: {copy_gbps:.1f} GB/s")
    ssd_dir = cfg.resolved_data_dir() / "profile"
    try:
        ssd_gbps = measure_read_gbps(ssd_dir, grid.copy_mb)
        progress(f"file read (page cache dropped): {ssd_gbps:.2f} GB/s")
    except OSError as exc:
        ssd_gbps = DEFAULT.transfer.ssd_local_gbps
        progress(f"file read not measured ({exc}); using {ssd_gbps} GB/s")
    # A local load goes through the kvstore's UCX endpoint: a copy, at best.
    transfer = TransferCost(
        setup_s=DEFAULT.transfer.setup_s,
        dram_local_gbps=round(copy_gbps, 3),
        dram_remote_gbps=network_gbps,
        ssd_local_gbps=round(ssd_gbps, 3),
        ssd_remote_gbps=round(min(ssd_gbps, network_gbps), 3),
    )
    elapsed = time.monotonic() - started
    return CostModel(
        name=f"profile-{cfg.model.name}",
        model=cfg.model.name,
        device=f"{model.device} x{torch.get_num_threads()} threads, {dtype_name}",
        source=f"yb profile {'--quick ' if quick else ''}({elapsed:.0f}s)",
        kv_bytes_per_token=int(kv_bytes_per_token),
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        fit=FitReport(
            prefill_samples=len(prefill_samples),
            prefill_mean_rel_error=round(prefill_err, 4),
            decode_samples=len(decode_samples),
            decode_mean_rel_error=round(decode_err, 4),
            memcpy_gbps=round(copy_gbps, 3),
        ),
    )
