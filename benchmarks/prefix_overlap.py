"""A prefix computed on while it lands, against loading it first, in one run.

    python benchmarks/prefix_overlap.py --json PATH [--rounds 5] [--prompt-tokens 4096]
                                        [--cached-tokens 3584] [--no-cluster]

The default model (SmolLM2-135M-Instruct, float32 on the CPU) and a real kvstore
(its own service, a nats-server, UCX between the two): a 4,096-token prompt whose
first 3,584 tokens are in the kvstore, put there from another engine's pages. Four
ways, alternating round by round, each timed from the first byte asked for to the
prompt's next-token logits:

- `load_s`: the prefix alone, fetched into the pages (`BlockFetcher`);
- `compute_s`: the 512 new tokens alone, the prefix already in the pages;
- `load_then_compute_s`: the fetch, then the compute (`overlap_prefix_load` off);
- `overlapped_s`: the fetch and the compute together, each layer of the compute
  waiting for that layer's pages only (`LayerArrivals`, as the prefill runs it).

`overlapped_over_max` is `overlapped_s / max(load_s, compute_s)`; the goal is 1.15 or
less. Figures are medians over `--rounds`. The logits of the two ways that load must
be the same as each other's (checked every round).

Then, unless `--no-cluster`, the whole path as a client sees it: `benchmarks/
e2e_reuse.py` (a `yb up` cluster, the prefix fetched from the other host's kvstore)
with prompts of the same length, once with the prefill overlapping and once without:
`ttft_reuse_s_overlap`, `ttft_reuse_s_load_first`. It sends each prompt twice, so
the second time every full block is in the pool (`reused_tokens_*`: 4,032 of 4,096),
not only the first 3,584 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from e2e_reuse import run_with

from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_core.model_files import default_model_cache_dir
from yb_dataplane.block_upload import BlockUploader
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.prefix_fetch import BlockFetcher, FetchRun, LayerArrivals
from yb_dataplane.transport import KVReceiver, KVSender
from yb_engine import LoadedModel, ModelRunner, PagedKVCache
from yb_engine.loader import ensure_default_model, load_model
from yb_testkit.pool import HeldPages, running_kvstore
from yb_tools.natsserver import NatsServer

HERE = Path(__file__).resolve().parent
BLOCK = 64
STORE = "kvstore-bench"
CHUNK = 512


class Bench:
    def __init__(
        self, runner: ModelRunner, fetcher: BlockFetcher, prompt: list[int], keys: list[int]
    ) -> None:
        self.runner = runner
        self.fetcher = fetcher
        self.prompt = prompt
        self.keys = keys
        self.cached = len(keys) * BLOCK
        self.table = list(range(runner.cache.pages_for(len(prompt))))
        self.run = FetchRun(STORE, 0, len(keys), ("dram",))
        self.seq = 0

    def _compute(self, ready: Any = None) -> torch.Tensor:
        return self.runner.prefill(
            self.prompt,
            self.table,
            num_cached_tokens=self.cached,
            chunk_size=CHUNK,
            layer_ready=ready,
        )

    async def _fetch(self, arrivals: LayerArrivals | None = None) -> None:
        self.seq += 1
        fetched = await self.fetcher.fetch(
            f"bench-{self.seq}", [self.run], self.keys, self.table, 60.0, arrivals
        )
        if fetched.failures:
            raise SystemExit(f"the fetch failed: {fetched.failures}")

    async def load(self) -> float:
        t0 = time.perf_counter()
        await self._fetch()
        return time.perf_counter() - t0

    async def compute(self) -> float:
        t0 = time.perf_counter()
        await asyncio.to_thread(self._compute)
        return time.perf_counter() - t0

    async def load_then_compute(self) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        await self._fetch()
        logits = await asyncio.to_thread(self._compute)
        return time.perf_counter() - t0, logits

    async def overlapped(self) -> tuple[float, torch.Tensor]:
        layers = self.runner.cache.num_layers
        t0 = time.perf_counter()
        arrivals = LayerArrivals(range(layers), 1, time.monotonic() + 60.0)
        fetching = asyncio.ensure_future(self._fetch(arrivals))
        logits = await asyncio.to_thread(self._compute, arrivals.wait_layer)
        await fetching
        return time.perf_counter() - t0, logits

    def wipe(self) -> None:
        """Zero the prefix pages, so that a compute that read them before they landed
        would show in the logits."""
        for page in self.table[: len(self.keys)]:
            self.runner.cache.kv[:, page].zero_()


async def rounds_of(
    peers: PeerDirectory,
    sender: KVSender,
    receiver: KVReceiver,
    model: LoadedModel,
    prompt: list[int],
    keys: list[int],
    rounds: int,
) -> dict[str, list[float]]:
    """Put the prefix into the store from a writer's pages, then time the four ways
    `rounds` times, alternating."""
    address = peers.address(STORE)
    assert address is not None
    blocks, pages = len(keys), -(-len(prompt) // BLOCK)
    writer = ModelRunner(model, PagedKVCache(model.config, pages, BLOCK))
    writer.prefill(prompt[: blocks * BLOCK], list(range(blocks)))
    put = await BlockUploader(writer.cache, sender, deadline_s=60.0).upload(
        address, keys, HeldPages({key: i for i, key in enumerate(keys)})
    )
    if put.stored != blocks:
        raise SystemExit(f"only {put.stored} of {blocks} blocks reached the store")
    del writer
    runner = ModelRunner(model, PagedKVCache(model.config, pages, BLOCK))
    fetcher = BlockFetcher("bench-engine", runner.cache, peers, receiver, sender)
    bench = Bench(runner, fetcher, prompt, keys)
    # Warm-up: every path once (UCX connection, kernels, pages touched).
    await bench.load()
    await bench.compute()
    await bench.overlapped()
    times: dict[str, list[float]] = {k: [] for k in ("load", "compute", "sequential", "overlapped")}
    for r in range(rounds):
        times["load"].append(await bench.load())
        times["compute"].append(await bench.compute())
        bench.wipe()
        t_seq, first = await bench.load_then_compute()
        times["sequential"].append(t_seq)
        bench.wipe()
        t_ovl, second = await bench.overlapped()
        times["overlapped"].append(t_ovl)
        if not torch.equal(first, second):
            raise SystemExit("the overlapped prefill's logits differ from loading first")
        print(
            f"round {r + 1}: load {times['load'][-1]:.3f}s, compute "
            f"{times['compute'][-1]:.3f}s, load then compute {t_seq:.3f}s, "
            f"overlapped {t_ovl:.3f}s",
            flush=True,
        )
    return times


async def measure(rounds: int, prompt_tokens: int, cached_tokens: int) -> dict[str, float]:
    model = load_model(ensure_default_model(default_model_cache_dir()))
    gen = torch.Generator().manual_seed(7)
    prompt: list[int] = torch.randint(
        100, model.config.vocab - 100, (prompt_tokens,), generator=gen
    ).tolist()
    blocks = cached_tokens // BLOCK
    keys = [0x5EED0000 + i for i in range(blocks)]
    with tempfile.TemporaryDirectory(prefix="yb-overlap-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats", log_file=Path(tmp) / "nats.log")
        server.start()
        nats = NatsConfig(url=server.url)
        try:
            bus = await Bus.connect(nats, "bench-overlap", timeout_s=10)
            await bus.ensure_stream()
            sender, receiver = KVSender(), KVReceiver()
            await receiver.start()
            try:
                async with running_kvstore(bus, nats, STORE, 2 * blocks + 8) as peers:
                    times = await rounds_of(peers, sender, receiver, model, prompt, keys, rounds)
            finally:
                await sender.close()
                await receiver.close()
                await bus.close()
        finally:
            server.stop()
    load, compute = (statistics.median(times[k]) for k in ("load", "compute"))
    sequential, overlapped = (statistics.median(times[k]) for k in ("sequential", "overlapped"))
    page_nbytes = model.config.kv_spec("float32").page_nbytes(BLOCK)
    return {
        "prompt_tokens": float(prompt_tokens),
        "cached_tokens": float(cached_tokens),
        "prefix_mb": round(blocks * model.config.num_layers * page_nbytes / 1e6, 1),
        "load_s": round(load, 4),
        "compute_s": round(compute, 4),
        "load_then_compute_s": round(sequential, 4),
        "overlapped_s": round(overlapped, 4),
        "overlapped_over_max": round(overlapped / max(load, compute), 3),
        "load_then_compute_over_max": round(sequential / max(load, compute), 3),
        "overlap_speedup": round(sequential / overlapped, 3),
        "rounds": float(rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--cached-tokens", type=int, default=3584)
    parser.add_argument("--no-cluster", action="store_true", help="skip the e2e TTFT runs")
    args = parser.parse_args()
    if args.cached_tokens % BLOCK or not 0 < args.cached_tokens < args.prompt_tokens:
        parser.error(f"--cached-tokens: a multiple of {BLOCK} below --prompt-tokens")
    results: dict[str, Any] = asyncio.run(
        measure(args.rounds, args.prompt_tokens, args.cached_tokens)
    )
    if not args.no_cluster:
        for name, overlap in (("overlap", True), ("load_first", False)):
            print(f"TTFT through a cluster, overlap {'on' if overlap else 'off'}", flush=True)
            flag = "true" if overlap else "false"
            figures = run_with(
                {
                    "YB_PREFILL__OVERLAP_PREFIX_LOAD": flag,
                    "YB_CONDUCTOR__PREFIX_LOAD_OVERLAP": flag,
                },
                prefix_tokens=args.cached_tokens,
                question_tokens=args.prompt_tokens - args.cached_tokens,
            )
            results[f"ttft_reuse_s_{name}"] = figures["ttft_reuse_s"]
            results[f"ttft_recompute_s_{name}"] = figures["ttft_recompute_s"]
            results[f"reused_tokens_{name}"] = figures["reused_tokens"]
    print()
    print(f"{'':<28} {'seconds':>9}")
    for label, key in (
        ("load alone", "load_s"),
        ("compute alone", "compute_s"),
        ("load, then compute", "load_then_compute_s"),
        ("overlapped", "overlapped_s"),
    ):
        print(f"{label:<28} {results[key]:>9.3f}")
    print(
        f"\noverlapped / max(load, compute) = {results['overlapped_over_max']:.3f} "
        f"(goal <= 1.15); load then compute / max = {results['load_then_compute_over_max']:.3f}"
    )
    for name in ("overlap", "load_first"):
        if f"ttft_reuse_s_{name}" in results:
            print(f"TTFT through a cluster, {name}: {results[f'ttft_reuse_s_{name}']:.3f}s")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
