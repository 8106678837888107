"""Which queued jobs start together, and how their computes meet in one engine call."""

from __future__ import annotations

import asyncio

import pytest

from yb_core import events as ev
from yb_core import protocol as pr
from yb_prefill.batching import ComputeBatch, Outcome, take_group

BLOCK = 16


def job(tokens: int) -> pr.PrefillJob:
    return pr.PrefillJob(
        request_id=f"r{tokens}",
        token_ids=list(range(tokens)),
        block_hashes=[],
        sampling=pr.SamplingParams(),
        decision=ev.RequestScheduled(
            request_id=f"r{tokens}", gateway_id="gw", prefill_instance="p", decode_instance="d"
        ),
        token_subject="t",
        deadline=0.0,
    )


def pages_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def group(sizes: list[int], *, max_jobs: int = 8, max_tokens: int = 64, room: int = 100) -> int:
    return take_group(
        [job(n) for n in sizes],
        max_jobs=max_jobs,
        max_tokens=max_tokens,
        room_pages=room,
        pages_for=pages_for,
    )


def test_a_group_is_the_head_and_the_short_prompts_behind_it() -> None:
    assert group([]) == 0
    assert group([10, 10, 10]) == 3
    assert group([10, 10, 10], max_jobs=2) == 2
    assert group([10, 10, 10], max_jobs=1) == 1
    # Together at most one chunk of tokens: the third would make 66.
    assert group([30, 30, 6, 1]) == 2
    # A head longer than a chunk computes alone, in chunks; so does whatever follows.
    assert group([65, 1, 1]) == 1
    # The pages of all must fit in the room left: 2 + 2 + 1 > 4.
    assert group([20, 20, 1], room=4) == 2
    # The head starts even when its pages are short (it waits for them before, or fails).
    assert group([20, 1], room=0) == 1


async def test_the_computes_of_a_group_run_as_one_call() -> None:
    calls: list[list[str]] = []

    def run(parts: list[str]) -> asyncio.Future[list[Outcome[str]]]:
        calls.append(parts)
        done: asyncio.Future[list[Outcome[str]]] = asyncio.get_running_loop().create_future()
        done.set_result([p.upper() if p != "bad" else ValueError(p) for p in parts])
        return done

    a, b, c, d = object(), object(), object(), object()
    batch: ComputeBatch[str, str] = ComputeBatch([a, b, c, d], run)
    assert batch.size == 4
    first = asyncio.ensure_future(batch.compute(a, "x"))
    second = asyncio.ensure_future(batch.compute(b, "bad"))
    await asyncio.sleep(0)
    assert not calls  # c and d have not come yet
    batch.leave(c)  # failed before its compute
    batch.leave(c)  # idempotent
    last = asyncio.ensure_future(batch.compute(d, "z"))
    assert await first == "X" and await last == "Z"
    with pytest.raises(ValueError, match="bad"):
        await second
    assert calls == [["x", "bad", "z"]]
    batch.leave(a)  # after its compute: nothing happens
    with pytest.raises(RuntimeError):
        await batch.compute(c, "again")


async def test_a_member_cancelled_while_waiting_is_dropped_and_the_call_fails_for_all() -> None:
    calls: list[list[str]] = []

    def run(parts: list[str]) -> asyncio.Future[list[Outcome[str]]]:
        calls.append(parts)
        done: asyncio.Future[list[Outcome[str]]] = asyncio.get_running_loop().create_future()
        done.set_exception(RuntimeError("engine down"))
        return done

    a, b, c = object(), object(), object()
    batch: ComputeBatch[str, str] = ComputeBatch([a, b, c], run)
    waiting = asyncio.ensure_future(batch.compute(a, "x"))
    cancelled = asyncio.ensure_future(batch.compute(b, "y"))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not calls
    with pytest.raises(RuntimeError, match="engine down"):
        await batch.compute(c, "z")
    with pytest.raises(RuntimeError, match="engine down"):
        await waiting
    assert calls == [["x", "z"]]


async def test_no_call_when_every_member_left() -> None:
    def run(parts: list[str]) -> asyncio.Future[list[Outcome[str]]]:
        raise AssertionError("called with nothing to compute")

    a, b = object(), object()
    batch: ComputeBatch[str, str] = ComputeBatch([a, b], run)
    batch.leave(a)
    batch.leave(b)
