"""Pipeline stages joined over the real data plane (UCX): hidden states between stages,
each stage's KV pages to a receiver standing for decode, a per-stage cached prefix that
arrives over UCX, and stages in separate processes: the single node's logits, and a
killed stage ends the request at its neighbours at once, not at a deadline."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from yb_dataplane.activations import (
    ActivationReceiver,
    ActivationSender,
    ReservationTarget,
    UpstreamAborted,
)
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress, PeerUnreachable
from yb_engine import LoadedModel
from yb_engine.loader import tiny_random_model
from yb_engine.stages import (
    HiddenHeader,
    StageRunner,
    prefill_over_stages,
    serve_stage_request,
)

WORKER = Path(__file__).with_name("test_stages_worker.py")


def _sibling(name: str) -> ModuleType:
    # The test directory is not a package: load the single-process tests' helpers
    # from their file.
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_single = _sibling("test_stages")
BLOCK, PROMPT, TOLERANCE = _single.BLOCK, _single.PROMPT, _single.TOLERANCE
group, prompt, rel_err = _single.group, _single.prompt, _single.rel_err
scrambled_table, whole_prefill = _single.scrambled_table, _single.whole_prefill
#: Every wait's deadline: far above what any step here takes, so an error that comes
#: well before it comes from the failure itself.
WAIT_S = 120.0
#: How long a test waits for a failure to show: a small part of WAIT_S.
FAIL_FAST_S = 20.0
#: Chunk size of the requests the process tests cut short.
CUT_CHUNK = 32


@pytest.fixture(scope="module")
def tiny4() -> LoadedModel:
    return tiny_random_model(seed=3, num_layers=4)


async def prefill_in_process(
    stages: Sequence[StageRunner],
    tables: Sequence[Sequence[int]],
    ids: list[int],
    request_id: str,
    *,
    kv_peer: PeerAddress | None = None,
    num_cached_tokens: int = 0,
    chunk_size: int,
) -> torch.Tensor:
    """`stages` as a group in this process, each with its own receiver and sender, the
    hidden states going from one to the next over UCX; with `kv_peer`, each stage
    streams its pages into reservation `request_id` there (the last one commits)."""
    receivers = [KVReceiver() for _ in range(len(stages) + 1)]  # the last: the driver's
    senders = [KVSender() for _ in range(len(stages) + 1)]  # the last: the driver's
    try:
        for receiver in receivers:
            await receiver.start()
        inbound = [ActivationReceiver(r, HiddenHeader) for r in receivers]
        outbound = [
            ActivationSender[HiddenHeader](senders[i], receivers[i + 1].address)
            for i in range(len(stages))
        ]

        async def serve(i: int) -> None:
            rid = await inbound[i].next_request(deadline_s=WAIT_S)
            kv = None if kv_peer is None else ReservationTarget(senders[i], kv_peer, rid)
            await serve_stage_request(
                stages[i],
                rid,
                tables[i],
                inbound[i],
                outbound[i],
                wait_s=WAIT_S,
                kv=kv,
                commit_kv=i == len(stages) - 1,
            )

        driver = ActivationSender[HiddenHeader](senders[-1], receivers[0].address)
        feeding = prefill_over_stages(
            driver,
            inbound[-1],
            request_id,
            ids,
            num_cached_tokens=num_cached_tokens,
            chunk_size=chunk_size,
            wait_s=WAIT_S,
        )
        logits, *_ = await asyncio.gather(feeding, *(serve(i) for i in range(len(stages))))
        assert isinstance(logits, torch.Tensor)
        return logits
    finally:
        for sender in senders:
            await sender.close()
        for receiver in receivers:
            await receiver.close()


@pytest.mark.parametrize("num_stages", [2, 4])
async def test_stages_over_ucx_give_the_logits_and_stream_their_pages(
    tiny4: LoadedModel, num_stages: int
) -> None:
    ids = prompt(tiny4, PROMPT)
    reference, whole = whole_prefill(tiny4, ids)
    num_pages = whole.pages_for(PROMPT)
    num_layers = tiny4.config.num_layers
    decode = KVReceiver()
    await decode.start()
    try:
        # Decode's reservation, as the KV protocol lays it out: layer * num_pages + i.
        landed = [torch.zeros_like(whole.page_view(0, 0)) for _ in range(num_layers * num_pages)]
        reservation = decode.reserve("r1", landed, deadline_s=WAIT_S)
        stages = group(tiny4, num_stages)
        tables = [scrambled_table(i + 1) for i in range(num_stages)]
        # Chunks of 40 tokens over pages of 16: a chunk leaves a page half written,
        # which must move only after the next chunk completes it.
        logits = await prefill_in_process(
            stages, tables, ids, "r1", kv_peer=decode.address, chunk_size=40
        )
        await asyncio.wait_for(reservation.wait_committed(), FAIL_FAST_S)
    finally:
        await decode.close()
    assert rel_err(logits, reference) < TOLERANCE
    used = scrambled_table(0)[:num_pages]
    for layer in range(num_layers):
        ours = torch.stack(landed[layer * num_pages : (layer + 1) * num_pages])
        assert rel_err(ours, whole.kv[layer, used]) < TOLERANCE, f"layer {layer}"


async def test_each_stage_continues_from_its_prefix_received_over_ucx(
    tiny4: LoadedModel,
) -> None:
    """Each stage gets the cached prefix KV of its own layers over UCX (from a holder
    standing for the kvstore, into the stage's pages) and computes the rest."""
    ids = prompt(tiny4, PROMPT, seed=1)
    reference, whole = whole_prefill(tiny4, ids)
    cached = 4 * BLOCK  # whole pages, as the prefix pool holds them
    prefix_pages = scrambled_table(0)[: cached // BLOCK]
    stages = group(tiny4, 2)
    tables = [scrambled_table(i + 1) for i in range(2)]
    holder = KVSender()
    try:
        for n, (stage, table) in enumerate(zip(stages, tables, strict=True)):
            layers = stage.layer_range
            receiver = KVReceiver()
            await receiver.start()
            try:
                targets = [
                    stage.cache.page_view(j, table[i])
                    for j in range(len(layers))
                    for i in range(len(prefix_pages))
                ]
                reservation = receiver.reserve(f"prefix{n}", targets, deadline_s=WAIT_S)
                items = [
                    (j * len(prefix_pages) + i, whole.page_view(layers.start + j, page))
                    for j in range(len(layers))
                    for i, page in enumerate(prefix_pages)
                ]
                await holder.send(
                    receiver.address, f"prefix{n}", items, deadline_s=WAIT_S, commit=True
                )
                await asyncio.wait_for(reservation.wait_committed(), FAIL_FAST_S)
            finally:
                await receiver.close()
    finally:
        await holder.close()
    logits = await prefill_in_process(
        stages, tables, ids, "r2", num_cached_tokens=cached, chunk_size=40
    )
    assert rel_err(logits, reference) < TOLERANCE


class Stage:
    """A stage process (`test_stages_worker.py`) and its stdout lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, layers: tuple[int, int]) -> Stage:
        spec = {
            "seed": 3,
            "num_layers": 4,
            "layers": list(layers),
            "pages": 12,
            "block": BLOCK,
            "wait_s": WAIT_S,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """The next line starting with `prefix`; fails on EOF or timeout."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise AssertionError(f"stage exited before {prefix!r}: {self.lines}")
                line = raw.decode().strip()
                self.lines.append(line)
                if line.startswith(prefix):
                    return line

    async def address(self) -> PeerAddress:
        return PeerAddress.parse((await self.expect("address ")).removeprefix("address "))

    def send_to(self, peer: PeerAddress) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{peer}\n".encode())

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


class ProcessGroup:
    """Two stage processes between the driver's sender and receiver."""

    def __init__(self) -> None:
        self.receiver = KVReceiver()
        self.sender = KVSender(connect_timeout_s=20.0)
        self.stages: list[Stage] = []

    async def __aenter__(self) -> ProcessGroup:
        await self.receiver.start()
        self.inbound = ActivationReceiver(self.receiver, HiddenHeader)
        self.stages = [await Stage.start((0, 2)), await Stage.start((2, 4))]
        first, second = [await stage.address() for stage in self.stages]
        self.stages[0].send_to(second)
        self.stages[1].send_to(self.receiver.address)
        self.first = ActivationSender[HiddenHeader](self.sender, first)
        return self

    async def send_chunk(self, request_id: str, ids: list[int], index: int) -> None:
        """Chunk `index` (of CUT_CHUNK tokens) of prompt `ids` to the first stage."""
        start = index * CUT_CHUNK
        piece = torch.tensor(ids[start : start + CUT_CHUNK])
        header = HiddenHeader.of(
            piece, request_id=request_id, chunk_index=index, start=start, prompt_len=len(ids)
        )
        await self.first.send(request_id, index, header, piece.numpy(), deadline_s=WAIT_S)

    async def start_cut(self, ids: list[int]) -> None:
        """Request "cut" with its first chunk only: returns once the second stage
        computed it and waits for chunk 1, which the caller does not send yet."""
        await self.first.open("cut", deadline_s=WAIT_S)
        await self.send_chunk("cut", ids, 0)
        await self.stages[1].expect("waiting 1")

    async def __aexit__(self, *exc: Any) -> None:
        for stage in self.stages:
            await stage.stop()
        await self.sender.close()
        await self.receiver.close()


async def test_stage_processes_give_the_logits_and_a_killed_one_ends_the_request() -> None:
    model = tiny_random_model(seed=3, num_layers=4)
    ids = prompt(model, 100, seed=7)
    reference, _ = whole_prefill(model, ids)
    async with ProcessGroup() as pg:
        logits = await prefill_over_stages(
            pg.first, pg.inbound, "whole", ids, chunk_size=32, wait_s=WAIT_S
        )
        assert rel_err(logits, reference) < TOLERANCE
        await pg.stages[1].expect("served whole")

        # The next request: chunk 0 goes through both stages, then the first dies
        # while the second waits for chunk 1.
        first, second = pg.stages
        await pg.start_cut(ids)
        await first.stop()
        error = await second.expect("error", timeout=FAIL_FAST_S)
        assert error.startswith("error PeerUnreachable") and "cut" in error, error
        # The second stage closed the request aborted: the driver hears it as such.
        with pytest.raises(UpstreamAborted, match="aborted"):
            await asyncio.wait_for(pg.inbound.receive("cut", 3, deadline_s=WAIT_S), FAIL_FAST_S)


async def test_a_killed_next_stage_fails_the_sending_stage_at_once() -> None:
    model = tiny_random_model(seed=3, num_layers=4)
    ids = prompt(model, 100, seed=8)
    async with ProcessGroup() as pg:
        first, second = pg.stages
        await pg.start_cut(ids)
        await second.stop()
        await pg.send_chunk("cut", ids, 1)
        error = await first.expect("error", timeout=FAIL_FAST_S)
        assert error.startswith("error PeerUnreachable"), error
        # The driver's side of the dead stage fails too, from the broken connection.
        with pytest.raises(PeerUnreachable):
            await asyncio.wait_for(pg.inbound.receive("cut", 3, deadline_s=WAIT_S), FAIL_FAST_S)
