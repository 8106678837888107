"""CPP benchmark: time to first token of a long prompt over a group of pipeline stages,
against one instance, in the same run.

    python benchmarks/cpp.py --json PATH [--model default|tiny] [--runs 4096:2,8192:4]
        [--chunk-size 512] [--group-chunk-size N] [--block-size 64] [--repeats 1]

Each `--runs` entry `TOKENS:STAGES` times one prompt of TOKENS random tokens two ways,
alternating, `--repeats` times each:

- one instance: one process holding the whole model (a stage of every layer,
  `LayerRange(0, num_layers)`, which computes what `ModelRunner.prefill` does);
- a group: STAGES processes, stage i holding only its layers (`load_engine_stage`, the
  layers cut as evenly as `LayerRange.split` does).

Both run `serve_stage_request`: chunks of `--chunk-size` tokens (the group's:
`--group-chunk-size`, by default the same; a group's chunk size is its own setting,
and a smaller chunk shortens its pipeline's fill and drain) come in over UCX, each is
computed while the previous one's output moves on, so in a group stage i computes chunk
k while stage i+1 computes chunk k-1. Token ids go from the driver to the first process,
hidden states from stage to stage and the logits back to the driver over the data plane
(`yb_dataplane.activations`: real UCX, one reservation per chunk), as `transport` in the
JSON says. Every process has ONE torch thread (an engine owns its cores; this machine has
few), on the CPU in float32. TTFT is from the driver opening the request to the last
position's logits back in the driver; loading and a warm-up prompt come before. A group
of more processes than the machine has cores cannot run its stages in parallel, so its
speedup is bounded by the core count (`cores` in the JSON).

Figures (DESIGN.md): `ttft_single_{N}_s`, `ttft_cpp{S}_{N}_s`, `cpp{S}_speedup_{N}`
(single over group, medians), `cpp{S}_logits_rel_err_{N}` (the group's logits against
the instance's: max abs difference over max abs logit). On a shared machine the wall
times depend on what else runs (`load_average_1m`), and S busy processes can take a
larger share of contended cores than one, so the CPU seconds are given too:
`cpu_single_{N}_s` (the instance's), `cpu_cpp{S}_{N}_s` (all stages together) and
`cpu_cpp{S}_slowest_stage_{N}_s`; single over slowest stage bounds the speedup a group
could reach on idle cores, pipeline fill aside. A run the model cannot hold (TOKENS
over its context) is skipped and listed in `skipped`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import torch
from figures import emit

from yb_core.config import ModelConfig
from yb_core.model_files import DEFAULT, TINY_RANDOM, default_model_cache_dir
from yb_dataplane.activations import ActivationReceiver, ActivationSender
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress
from yb_engine.architecture import ArchConfig, LayerRange
from yb_engine.models import load_engine_stage
from yb_engine.stages import (
    HiddenHeader,
    StageRunner,
    prefill_over_stages,
    serve_stage_request,
    stage_cache,
)

TRANSPORT = "ucx"
WARMUP_TOKENS = 256
#: Bound on every wait of a stage or the driver: far above a prompt's time here.
WAIT_S = 3600.0


class WorkerSpec(msgspec.Struct, frozen=True):
    """What one worker process runs: the stage of layers `[layers[0], layers[1])`."""

    source: str
    layers: tuple[int, int]
    max_tokens: int
    block_size: int


def worker(spec: WorkerSpec, control: Connection, reports: Any) -> None:
    """A stage process: loads its weights, starts its receiver and reports its address;
    then, given the next hop's address on `control`, serves prompts until terminated,
    reporting after each the CPU seconds it cost."""
    asyncio.run(_serve(spec, control, reports))


async def _serve(spec: WorkerSpec, control: Connection, reports: Any) -> None:
    torch.set_num_threads(1)
    config = ModelConfig(source=spec.source, device="cpu", dtype="float32")
    pages = -(-spec.max_tokens // spec.block_size)
    table = list(range(pages))
    stage = load_engine_stage(config, default_model_cache_dir(), LayerRange(*spec.layers))
    runner = StageRunner(stage, stage_cache(stage, pages, spec.block_size))
    receiver = KVReceiver()
    reports.put(str(await receiver.start()))
    inbound = ActivationReceiver(receiver, HiddenHeader)
    next_hop = PeerAddress.parse(await asyncio.to_thread(control.recv))
    outbound = ActivationSender[HiddenHeader](KVSender(), next_hop)
    while True:
        request_id = await inbound.next_request(deadline_s=WAIT_S)
        cpu = time.process_time()
        await serve_stage_request(runner, request_id, table, inbound, outbound, wait_s=WAIT_S)
        reports.put(time.process_time() - cpu)


class Chain:
    """Stage processes joined over UCX: the driver feeds the first, hears the last."""

    def __init__(self, specs: list[WorkerSpec], chunk_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.chunk_size = chunk_size
        self.reports = ctx.Queue()
        self.processes = []
        self.controls = []
        self.addresses = []
        for spec in specs:
            # One at a time: each report is the address of the process just started.
            receive_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker, args=(spec, receive_end, self.reports), daemon=True)
            proc.start()
            self.processes.append(proc)
            self.controls.append(send_end)
            self.addresses.append(PeerAddress.parse(self.reports.get(timeout=600)))
        self._ids = itertools.count()

    async def __aenter__(self) -> Chain:
        self.receiver = KVReceiver()
        self.sender = KVSender()
        driver_address = await self.receiver.start()
        self.inbound = ActivationReceiver(self.receiver, HiddenHeader)
        self.first = ActivationSender[HiddenHeader](self.sender, self.addresses[0])
        for control, next_hop in zip(
            self.controls, [*self.addresses[1:], driver_address], strict=True
        ):
            control.send(str(next_hop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        await self.receiver.close()
        for proc in self.processes:
            proc.terminate()
            proc.join(timeout=60)

    async def ttft(self, ids: list[int]) -> tuple[float, torch.Tensor, list[float]]:
        """Seconds from the request opened to the logits back, the logits, and the CPU
        seconds each process spent on the prompt."""
        begin = time.perf_counter()
        logits = await prefill_over_stages(
            self.first,
            self.inbound,
            f"p{next(self._ids)}",
            ids,
            chunk_size=self.chunk_size,
            wait_s=WAIT_S,
        )
        elapsed = time.perf_counter() - begin
        cpu = [await asyncio.to_thread(self.reports.get, timeout=60) for _ in self.processes]
        return elapsed, logits, cpu


def model_arch(source: str) -> ArchConfig:
    """The model's architecture (read with a one-layer stage, the cheapest load)."""
    config = ModelConfig(source=source, device="cpu", dtype="float32")
    return load_engine_stage(config, default_model_cache_dir(), LayerRange(0, 1)).config


async def measure(
    figures: dict[str, Any],
    source: str,
    arch: ArchConfig,
    tokens: int,
    num_stages: int,
    chunk_size: int,
    group_chunk_size: int,
    block_size: int,
    repeats: int,
) -> None:
    """Time one `TOKENS:STAGES` run, one instance against the group, into `figures`."""

    def spec(start: int, end: int) -> WorkerSpec:
        return WorkerSpec(
            layers=(start, end), source=source, max_tokens=tokens, block_size=block_size
        )

    single_chain = Chain([spec(0, arch.num_layers)], chunk_size)
    group_chain = Chain(
        [spec(r.start, r.end) for r in LayerRange.split(arch.num_layers, num_stages)],
        group_chunk_size,
    )
    gen = torch.Generator().manual_seed(tokens)
    ids = [int(t) for t in torch.randint(0, arch.vocab, (tokens,), generator=gen)]
    single_s, group_s, single_cpu, group_cpu = [], [], [], []
    async with single_chain as single, group_chain as group:
        await single.ttft(ids[:WARMUP_TOKENS])
        await group.ttft(ids[:WARMUP_TOKENS])
        for _ in range(repeats):
            elapsed, reference, cpu = await single.ttft(ids)
            single_s.append(elapsed)
            single_cpu.append(cpu[0])
            elapsed, logits, cpu = await group.ttft(ids)
            group_s.append(elapsed)
            group_cpu.append(cpu)
    tag = f"cpp{num_stages}"
    median = statistics.median
    figures[f"ttft_single_{tokens}_s"] = median(single_s)
    figures[f"ttft_{tag}_{tokens}_s"] = median(group_s)
    figures[f"{tag}_speedup_{tokens}"] = median(single_s) / median(group_s)
    figures[f"{tag}_logits_rel_err_{tokens}"] = float(
        (logits - reference).abs().max() / reference.abs().max()
    )
    figures[f"cpu_single_{tokens}_s"] = median(single_cpu)
    figures[f"cpu_{tag}_{tokens}_s"] = median(sum(c) for c in group_cpu)
    figures[f"cpu_{tag}_slowest_stage_{tokens}_s"] = median(max(c) for c in group_cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", choices=["default", "tiny"])
    parser.add_argument("--runs", default="4096:2,8192:4", help="TOKENS:STAGES, comma-separated")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument(
        "--group-chunk-size", type=int, help="the group's chunk size (default: --chunk-size)"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    if args.group_chunk_size is None:
        args.group_chunk_size = args.chunk_size
    if (
        args.chunk_size <= 0
        or args.group_chunk_size <= 0
        or args.block_size <= 0
        or args.repeats <= 0
    ):
        parser.error("chunk sizes, --block-size and --repeats must be positive")
    runs = []
    for item in args.runs.split(","):
        tokens, _, stages = item.partition(":")
        if not stages:
            parser.error(f"--runs entry {item!r} is not TOKENS:STAGES")
        runs.append((int(tokens), int(stages)))

    source = {"default": DEFAULT, "tiny": TINY_RANDOM}[args.model]
    arch = model_arch(source)
    figures: dict[str, Any] = {
        "model": arch.model_id,
        "chunk_size": args.chunk_size,
        "group_chunk_size": args.group_chunk_size,
        "block_size": args.block_size,
        "threads_per_process": 1,
        "cores": os.cpu_count(),
        "transport": TRANSPORT,
        "dtype": "float32",
        "repeats": args.repeats,
    }
    skipped = []
    for tokens, num_stages in runs:
        if tokens > arch.max_position or num_stages > arch.num_layers:
            skipped.append(f"{tokens}:{num_stages}")
            continue
        asyncio.run(
            measure(
                figures,
                source,
                arch,
                tokens,
                num_stages,
                args.chunk_size,
                args.group_chunk_size,
                args.block_size,
                args.repeats,
            )
        )
    figures["skipped"] = ",".join(skipped)
    figures["load_average_1m"] = os.getloadavg()[0]

    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
