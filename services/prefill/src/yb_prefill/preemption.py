"""A batch line's prefill yields the engine to more urgent work within a layer.

A job marked `PrefillJob.preemptible` (a line of the OpenAI Batch API) that computes
alone pauses when the queue's head has a higher priority and could start at once
(the engine has the pages for its prompt, and room for one more job). Its engine
call holds after the layer it is computing (`yb_engine.pausing`; on a
tensor-parallel engine every rank holds at that layer): a layer of a chunk, not the
whole chunk, is what the urgent job waits for. Paused, it counts as
having left the engine (`EngineTurn.left`), so the queue loop starts the head's
group; it resumes once the work started ahead of it has left the engine and no job
of a higher priority than its own waits (`Pauses`), and goes on exactly where it
stopped. The last job paused resumes first: it paused for a job of a higher
priority than its own, which is what started after it.

A paused job holds what it held: its pages, its decode reservation (which lasts
until the request's deadline, so decode never gives it up before the job itself
would end) and its stream. Its deadline still runs, and a cancel ends it there
(`Pauses.wake`); the job then fails as any other, giving them back. A job paused
for `MAX_PAUSED_S` in all pauses no more: under a steady stream of more urgent
work it would otherwise hold its pages and its decode reservation until its
deadline, and its gateway would give up waiting for its first token first
(`gateway.first_token_timeout_s`). It resumes when the queue loop next looks
(once the group started ahead of it has left the engine) and computes to its end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from yb_core import protocol as pr
from yb_prefill.job_queue import Liveness

#: A job's pauses, in all, after which it pauses no more.
MAX_PAUSED_S = 30.0


class EngineTurn:
    """A started job's turn on the engine, as the queue loop sees it: `left` resolves
    once the job no longer computes (its compute ended, it paused, or it ended). A
    paused job computes again once `Pauses.resume` gives it a fresh `left`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.left: asyncio.Future[None] = loop.create_future()
        #: Seconds spent in its pauses that ended.
        self.paused_s = 0.0

    def may_pause(self) -> bool:
        """Whether its pauses have left it time to pause again."""
        return self.paused_s < MAX_PAUSED_S

    def leave(self) -> None:
        """The job no longer needs the engine (for now)."""
        if not self.left.done():
            self.left.set_result(None)

    def renew(self) -> asyncio.Future[None]:
        """The job has the engine again: its fresh `left`."""
        self.left = self._loop.create_future()
        return self.left


@dataclass(eq=False, slots=True)
class _Paused:
    job: pr.PrefillJob
    turn: EngineTurn
    # True: resumed on the engine; False: woken to end (a cancel).
    woken: asyncio.Future[bool]
    since: float = field(default_factory=time.monotonic)


class Pauses:
    """The jobs paused, the last paused on top."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._stack: list[_Paused] = []

    def __bool__(self) -> bool:
        return bool(self._stack)

    def __len__(self) -> int:
        return len(self._stack)

    def top_priority(self) -> int:
        """The priority of the job that resumes next (there must be one)."""
        return self._stack[-1].job.priority

    def top_overdue(self) -> bool:
        """Whether the job that resumes next has paused `MAX_PAUSED_S` in all."""
        top = self._stack[-1]
        return top.turn.paused_s + time.monotonic() - top.since >= MAX_PAUSED_S

    async def pause(self, job: pr.PrefillJob, turn: EngineTurn) -> bool:
        """Leave the engine until `resume` gives it back (True), or the job's deadline
        passes or a cancel wakes it (False: the caller's `liveness.check` fails it)."""
        paused = _Paused(job, turn, asyncio.get_running_loop().create_future())
        self._stack.append(paused)
        turn.leave()
        try:
            while not paused.woken.done():
                if self._liveness.over(job):
                    return False
                # Its deadline, which `remaining_s` reads from the wall clock.
                timeout_s = max(0.01, self._liveness.remaining_s(job))
                await asyncio.wait({paused.woken}, timeout=timeout_s)
            return paused.woken.result()
        finally:
            turn.paused_s += time.monotonic() - paused.since
            if paused in self._stack:
                self._stack.remove(paused)

    def resume(self) -> asyncio.Future[None] | None:
        """Give the engine back to the job on top: its turn's fresh `left`, which the
        queue loop awaits; None when it is ending instead (woken by a cancel)."""
        paused = self._stack.pop()
        if paused.woken.done():
            return None
        paused.woken.set_result(True)
        return paused.turn.renew()

    def wake(self, request_id: str) -> None:
        """A request was cancelled: end its pause, if it is paused."""
        for paused in self._stack:
            if paused.job.request_id == request_id and not paused.woken.done():
                paused.woken.set_result(False)
