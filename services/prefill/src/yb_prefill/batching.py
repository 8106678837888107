"""Several queued jobs computed in one forward pass of the engine.

A short prompt's prefill costs the engine little compute and much fixed overhead
(every layer's kernels launched, a hop to the engine thread and back): with many
short prompts queued, one at a time the engine spends nearly all its time on that
overhead while the queue grows. So the queue starts the jobs at its head together
(`take_group`), up to `batch_jobs` of them whose prompts fit one chunk and the
pages free, and their computes meet in a `ComputeBatch`: one call on the engine
thread (`ModelRunner.prefill_batch`) computes them all, each prompt attending only
to its own pages, each job getting what it would have got alone. Everything else
about a job stays its own: its decode reservation, its prefix load, its stream, its
hand-over, its failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeAlias, TypeVar

if TYPE_CHECKING:
    from yb_core import protocol as pr

P = TypeVar("P")
R = TypeVar("R")

#: What the engine returns for each part: its result, or the exception that ended it.
Outcome: TypeAlias = R | BaseException


def take_group(
    queued: Sequence[pr.PrefillJob],
    *,
    max_jobs: int,
    max_tokens: int,
    room_pages: int,
    pages_for: Callable[[int], int],
) -> int:
    """How many jobs from the head of `queued` to start together (at least 1 when
    `queued` is not empty: the head always starts alone if nothing joins it).

    A job joins while the group has fewer than `max_jobs`, every prompt in it fits
    one chunk (`max_tokens`, also the bound of all their tokens together: one forward
    pass of the batch is at most one chunk), and the pages of all their prompts fit
    in `room_pages`: a job of the group must never fail for want of pages another
    member took. A job that asks for its prompt's logprobs starts alone: it needs
    every row's logits, which the batched forward pass does not keep.
    """
    if not queued:
        return 0
    head = len(queued[0].token_ids)
    if max_jobs <= 1 or head > max_tokens or _alone(queued[0]):
        return 1
    tokens, pages, n = head, pages_for(head), 1
    for job in queued[1:max_jobs]:
        t = len(job.token_ids)
        p = pages_for(t)
        if tokens + t > max_tokens or pages + p > room_pages or _alone(job):
            break
        tokens, pages, n = tokens + t, pages + p, n + 1
    return n


def _alone(job: pr.PrefillJob) -> bool:
    return job.sampling.prompt_logprobs is not None


@dataclass(slots=True)
class _Member(Generic[P, R]):
    part: P | None = None
    result: asyncio.Future[R] | None = None
    gone: bool = False


class ComputeBatch(Generic[P, R]):
    """The computes of the jobs one group started, run as one engine call.

    Each member either brings its part (`compute`) or leaves (`leave`: it failed or
    was cancelled before its compute); once every member has done one or the other,
    the parts brought go to `run` together, which returns one outcome per part, in
    order. A member cancelled while it waits for the others is dropped from the
    batch; one cancelled after the call started only stops waiting (the engine
    thread runs the call to its end, as it does a cancelled single compute).
    `run` gets the parts once, never an empty list.
    """

    def __init__(
        self, members: Sequence[object], run: Callable[[list[P]], asyncio.Future[list[Outcome[R]]]]
    ) -> None:
        self._members: dict[int, _Member[P, R]] = {id(m): _Member() for m in members}
        self._run = run
        self._started = False

    @property
    def size(self) -> int:
        """How many jobs the group started."""
        return len(self._members)

    async def compute(self, member: object, part: P) -> R:
        """`member`'s outcome once the batch has run (its exception raised)."""
        m = self._members[id(member)]
        if m.gone or m.result is not None or self._started:
            raise RuntimeError("a member computes once, before the batch runs")
        m.part = part
        m.result = asyncio.get_running_loop().create_future()
        result = m.result
        self._start_if_complete()
        try:
            return await result
        except asyncio.CancelledError:
            if not self._started:
                m.part, m.gone = None, True
                self._start_if_complete()
            raise

    def leave(self, member: object) -> None:
        """`member` will not compute (idempotent; a no-op once it has brought its part)."""
        m = self._members.get(id(member))
        if m is None or m.gone or m.part is not None:
            return
        m.gone = True
        self._start_if_complete()

    def _start_if_complete(self) -> None:
        if self._started or not all(m.gone or m.part is not None for m in self._members.values()):
            return
        self._started = True
        members = [m for m in self._members.values() if m.part is not None and not m.gone]
        if not members:
            return
        parts: list[P] = [m.part for m in members]  # type: ignore[misc]
        call = self._run(parts)
        call.add_done_callback(lambda done: _settle(done, members))


def _settle(done: asyncio.Future[list[Outcome[R]]], members: list[_Member[P, R]]) -> None:
    """Give each member its outcome (the call's exception to all if it failed)."""
    if done.cancelled():
        outcomes: list[Outcome[R]] = [asyncio.CancelledError()] * len(members)
    elif (error := done.exception()) is not None:
        outcomes = [error] * len(members)
    else:
        outcomes = done.result()
    for m, outcome in zip(members, outcomes, strict=True):
        assert m.result is not None
        if m.result.done():
            continue  # it stopped waiting
        if isinstance(outcome, BaseException):
            m.result.set_exception(outcome)
        else:
            m.result.set_result(outcome)
