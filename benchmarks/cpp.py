"""CPP benchmark: time to first token of a long prompt over a group of pipeline stages,
against one instance, in the same run.

    python benchmarks/cpp.py --json PATH [--model default|tiny] [--runs 4096:2,8192:4]
        [--chunk-size 512] [--block-size 64] [--repeats 1]

Each `--runs` entry `TOKENS:STAGES` times one prompt of TOKENS random tokens two ways,
alternating, `--repeats` times each:

- one instance: a process holding the whole model, `ModelRunner.prefill` in chunks of
  `--chunk-size` tokens;
- a group: STAGES processes, stage i holding only its layers (`load_engine_stage`, the
  layers cut as evenly as `LayerRange.split` does), chunks of `--chunk-size` tokens
  pipelined: stage i computes chunk k while stage i+1 computes chunk k-1.

Every process has ONE torch thread (an engine owns its cores; this machine has few), on
the CPU in float32. Hidden states go between stage processes as a `HiddenHeader`
(msgpack) and the tensor's raw bytes over a `multiprocessing` pipe (a local socket),
NOT over UCX: the figures include that hand-off, which the JSON names (`transport`).
TTFT is from the first chunk handed to the first process to the last position's logits
back in the driver; loading and a warm-up prompt come before. A group of more processes
than the machine has cores cannot run its stages in parallel, so its speedup is bounded
by the core count (`cores` in the JSON).

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
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import torch
from figures import emit

from yb_core.config import ModelConfig
from yb_core.model_files import DEFAULT, TINY_RANDOM, default_model_cache_dir
from yb_engine import ModelRunner, PagedKVCache
from yb_engine.architecture import ArchConfig, LayerRange
from yb_engine.models import load_engine_model, load_engine_stage
from yb_engine.stages import (
    HiddenHeader,
    StageRunner,
    chunk_spans,
    hidden_bytes,
    hidden_from_buffer,
    stage_cache,
)

TRANSPORT = "multiprocessing-pipe"
WARMUP_TOKENS = 256


class WorkerSpec(msgspec.Struct, frozen=True):
    """What one worker process runs: a stage (`layers`) or the whole model (None)."""

    source: str
    layers: tuple[int, int] | None
    max_tokens: int
    block_size: int
    chunk_size: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(HiddenHeader)


def send_tensor(conn: Connection, tensor: torch.Tensor, header: HiddenHeader) -> None:
    conn.send_bytes(_header_encoder.encode(header))
    conn.send_bytes(hidden_bytes(tensor))


def recv_tensor(conn: Connection) -> tuple[HiddenHeader, torch.Tensor] | None:
    raw = conn.recv_bytes()
    if not raw:
        return None
    header = _header_decoder.decode(raw)
    return header, hidden_from_buffer(header, conn.recv_bytes(), "cpu")


def worker(spec: WorkerSpec, inbox: Connection, outbox: Connection, reports: Any) -> None:
    """A stage or instance process: loads its weights, then serves prompts until an
    empty message. A stage hands each chunk's output to a sending thread as soon as it
    is computed (so it computes the next chunk while the bytes go); the last stage (or
    the instance) sends the logits. On `reports` it says when it is ready, then after
    each prompt the CPU seconds the prompt cost it."""
    torch.set_num_threads(1)
    config = ModelConfig(source=spec.source, device="cpu", dtype="float32")
    pages = -(-spec.max_tokens // spec.block_size)
    table = list(range(pages))
    outgoing: queue.Queue[tuple[torch.Tensor, HiddenHeader] | None] = queue.Queue()

    def send_loop() -> None:
        while (item := outgoing.get()) is not None:
            send_tensor(outbox, item[0], item[1])

    sender = threading.Thread(target=send_loop, daemon=True)
    sender.start()
    if spec.layers is None:
        model = load_engine_model(config, default_model_cache_dir())
        runner = ModelRunner(model, PagedKVCache(model.config, pages, spec.block_size))
        reports.put(0.0)
        while (message := recv_tensor(inbox)) is not None:
            header, ids = message
            cpu = time.process_time()
            logits = runner.prefill(ids.tolist(), table, chunk_size=spec.chunk_size)
            outgoing.put((logits, header.describing(logits)))
            reports.put(time.process_time() - cpu)
    else:
        stage = load_engine_stage(config, default_model_cache_dir(), LayerRange(*spec.layers))
        stage_runner = StageRunner(stage, stage_cache(stage, pages, spec.block_size))
        reports.put(0.0)
        cpu = 0.0
        while (message := recv_tensor(inbox)) is not None:
            header, inputs = message
            if header.chunk_index == 0:
                cpu = time.process_time()
            out = stage_runner.forward(inputs, table, header.start, header.prompt_len)
            if out is not None:  # None: the last stage, before the prompt's last chunk
                outgoing.put((out, header.describing(out)))
            if header.is_last_chunk:
                reports.put(time.process_time() - cpu)
    outgoing.put(None)
    sender.join()
    outbox.send_bytes(b"")  # the next process stops too


class Chain:
    """Worker processes joined by pipes: the driver feeds the first, reads the last."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        ctx = mp.get_context("spawn")
        self.reports = ctx.Queue()
        self.processes = []
        first_recv, self.feed = ctx.Pipe(duplex=False)
        inbox = first_recv
        for spec in specs:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker, args=(spec, inbox, send, self.reports), daemon=True)
            proc.start()
            self.processes.append(proc)
            inbox = recv
        self.result = inbox
        for _ in specs:
            self.reports.get(timeout=600)  # loaded
        self.chunk_size = specs[0].chunk_size

    def ttft(self, ids: list[int], chunked: bool) -> tuple[float, torch.Tensor, list[float]]:
        """Seconds from the first chunk handed over to the logits back, the logits, and
        the CPU seconds each process spent on the prompt.

        `chunked`: the prompt goes in chunks (a group), else whole (an instance, which
        chunks it itself)."""
        n = len(ids)
        tensor = torch.tensor(ids, dtype=torch.int64)
        spans = chunk_spans(n, 0, self.chunk_size) if chunked else [(0, n)]
        begin = time.perf_counter()
        for index, (start, end) in enumerate(spans):
            piece = tensor[start:end]
            send_tensor(
                self.feed,
                piece,
                HiddenHeader.of(piece, chunk_index=index, start=start, prompt_len=n),
            )
        message = recv_tensor(self.result)
        elapsed = time.perf_counter() - begin
        assert message is not None
        cpu = [self.reports.get(timeout=60) for _ in self.processes]
        return elapsed, message[1], cpu

    def close(self) -> None:
        self.feed.send_bytes(b"")
        for proc in self.processes:
            proc.join(timeout=60)


def model_arch(source: str) -> ArchConfig:
    """The model's architecture (read with a one-layer stage, the cheapest load)."""
    config = ModelConfig(source=source, device="cpu", dtype="float32")
    return load_engine_stage(config, default_model_cache_dir(), LayerRange(0, 1)).config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", choices=["default", "tiny"])
    parser.add_argument("--runs", default="4096:2,8192:4", help="TOKENS:STAGES, comma-separated")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    if args.chunk_size <= 0 or args.block_size <= 0 or args.repeats <= 0:
        parser.error("--chunk-size, --block-size and --repeats must be positive")
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
        common = {"source": source, "max_tokens": tokens, "block_size": args.block_size}
        single = Chain([WorkerSpec(layers=None, chunk_size=args.chunk_size, **common)])
        group = Chain(
            [
                WorkerSpec(layers=(r.start, r.end), chunk_size=args.chunk_size, **common)
                for r in LayerRange.split(arch.num_layers, num_stages)
            ]
        )
        gen = torch.Generator().manual_seed(tokens)
        ids = [int(t) for t in torch.randint(0, arch.vocab, (tokens,), generator=gen)]
        single.ttft(ids[:WARMUP_TOKENS], chunked=False)
        group.ttft(ids[:WARMUP_TOKENS], chunked=True)
        single_s, group_s, single_cpu, group_cpu = [], [], [], []
        for _ in range(args.repeats):
            elapsed, reference, cpu = single.ttft(ids, chunked=False)
            single_s.append(elapsed)
            single_cpu.append(cpu[0])
            elapsed, logits, cpu = group.ttft(ids, chunked=True)
            group_s.append(elapsed)
            group_cpu.append(cpu)
        single.close()
        group.close()
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
    figures["skipped"] = ",".join(skipped)
    figures["load_average_1m"] = os.getloadavg()[0]

    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
