"""A call held at a layer boundary lends the engine thread to other work.

The engine runs one call at a time on its thread (`EngineHost`). A prefill of a
batch line should give way to an interactive prompt at once, not at the end of its
chunk: a chunk of a large model takes tens of milliseconds, a layer of it a fraction
of one. So the call's layer hook may hold it between two layers (`EnginePause`):

- The event loop asks for a hold (`EnginePause.wanted`).
- The hook, on the engine thread, sees it after the layer it just finished. It lends
  the thread (`Loan`: `EngineHost.submit` now queues there), tells the event loop
  (`EnginePause.held`, the layer it holds after), and runs what is submitted, in
  order, on the same thread, while the held call's frame keeps its hidden states.
- `resume` ends the loan: the hook returns and the call goes on from the next layer,
  computing exactly what it would have computed unpaused (what ran meanwhile wrote
  only its own pages). `abandon` ends it too, but the hook raises `PauseAbandoned`,
  so the call ends there (a cancel, a deadline, a shutdown).

A hold ends only by `resume` or `abandon` from the event loop, so the owner of a
pause must end it on every path (`abandon` in a `finally`), and `EngineHost.close`
abandons whatever is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["ABANDON", "GO", "HOLD", "EnginePause", "EngineThread", "Loan", "PauseAbandoned"]

#: What a held call does at a layer boundary (`EnginePause.decide`): the values every
#: rank of a tensor-parallel instance agrees on.
GO, HOLD, ABANDON = 0, 1, 2


class PauseAbandoned(Exception):
    """A held call was abandoned: raised from its layer hook, so the call ends there."""


_RESUME = "resume"
_ABANDON = "abandon"
_Work = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(
    future: asyncio.Future[Any], result: Any, error: BaseException | None
) -> None:  # event loop
    if future.done():
        return  # its waiter gave up (cancelled): nothing to hand over
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Loan:
    """The engine thread lent by a held call: what is submitted meanwhile, run in
    order, then how the hold ends."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[_Work | str] = queue.SimpleQueue()

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> asyncio.Future[Any]:
        """Event loop: run `fn(*args)` in this loan; the future of its result."""
        future: asyncio.Future[Any] = loop.create_future()
        self._items.put((loop, future, fn, args))
        return future

    def end(self, *, abandon: bool) -> None:
        """The hold ends once what was submitted before has run."""
        self._items.put(_ABANDON if abandon else _RESUME)

    def serve(self) -> bool:
        """Engine thread: run what is submitted until the loan ends; True when the held
        call resumes, False when it is abandoned."""
        while True:
            item = self._items.get()
            if item == _RESUME:
                return True
            if item == _ABANDON:
                return False
            assert not isinstance(item, str)
            loop, future, fn, args = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to its waiter, as an executor does
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, result, error)


class EnginePause:
    """One call's pause at a layer boundary (module docstring).

    Event loop: set `wanted`, await `held` (its result: where the call holds, as the
    runner's layer hook says it: the layer, and the chunk's prompt positions `[start,
    end)`), then `resume` or `abandon`; after a resume, `held` is a fresh future.
    Engine thread: the call's layer hook calls `at_layer` after each layer.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        lend: Callable[[Loan], None],
        take_back: Callable[[Loan], None],
    ) -> None:
        self._loop = loop
        self._lend = lend
        self._take_back = take_back
        #: Whether the call should hold at its next layer boundary (set by the event
        #: loop, read by the engine thread: a plain flag is enough under the GIL).
        self.wanted = False
        self.held: asyncio.Future[tuple[int, int, int]] = loop.create_future()
        self._loan: Loan | None = None
        self._abandoned = False

    @property
    def holding(self) -> bool:
        """Whether the call is held now (as the event loop knows it)."""
        return self._loan is not None

    def resume(self) -> None:
        """Event loop: the held call goes on once what was submitted to it has run."""
        loan = self._loan
        if loan is None:
            raise RuntimeError("resume: the call is not held")
        self._loan = None
        self.wanted = False
        self.held = self._loop.create_future()
        self._take_back(loan)
        loan.end(abandon=False)

    def abandon(self) -> None:
        """Event loop: end the call at its next layer boundary, or now where it is
        held (its hook raises `PauseAbandoned`). Safe to call more than once, and
        after the call ended."""
        self._abandoned = True
        self.wanted = False
        loan, self._loan = self._loan, None
        if loan is not None:
            self._take_back(loan)
            loan.end(abandon=True)

    def at_layer(self, layer: int, start: int, end: int) -> None:
        """Engine thread, after `layer` of the call wrote the KV of positions `[start,
        end)`: hold here when asked, until resumed (return) or abandoned (raise
        `PauseAbandoned`). A `LayerHook`."""
        step = self.decide()
        if step == ABANDON or (step == HOLD and not self.hold(layer, start, end)):
            raise PauseAbandoned(f"abandoned after layer {layer}")

    def decide(self) -> int:
        """Engine thread: what the call does at this layer boundary: `GO` on, `HOLD`
        here, or `ABANDON` (end). A tensor-parallel instance's rank 0 decides for
        every rank (`TPGroup.agree`), then holds with `hold`."""
        if self._abandoned:
            return ABANDON
        return HOLD if self.wanted else GO

    def hold(self, layer: int, start: int, end: int) -> bool:
        """Engine thread: lend the thread here until the event loop resumes the call
        (True) or abandons it (False)."""
        loan = Loan()
        self._lend(loan)
        self._loop.call_soon_threadsafe(self._on_held, loan, (layer, start, end))
        return loan.serve()

    def _on_held(self, loan: Loan, where: tuple[int, int, int]) -> None:  # event loop
        if self._abandoned:  # abandoned before it knew of the hold
            self._take_back(loan)
            loan.end(abandon=True)
            return
        self._loan = loan
        self.held.set_result(where)


class EngineThread:
    """One engine thread (`executor`, a single worker) that a held call may lend: while
    any call holds (`EnginePause`), what is submitted runs in the innermost hold."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor = executor
        self._loans: list[Loan] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Event loop: run `fn(*args)` on the thread; the future of its result."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loans:
                return self._loans[-1].submit(loop, fn, args)
        return loop.run_in_executor(self.executor, fn, *args)

    def pause_point(self) -> EnginePause:
        """Event loop: a pause for one call's layer hook."""
        return EnginePause(asyncio.get_running_loop(), self._lend, self._take_back)

    def _lend(self, loan: Loan) -> None:  # the engine thread, holding
        with self._lock:
            self._loans.append(loan)

    def _take_back(self, loan: Loan) -> None:  # event loop: the hold ends
        with self._lock:
            if loan in self._loans:
                self._loans.remove(loan)

    def close(self) -> None:
        """Abandon every hold (its hook raises, so the thread is not left waiting),
        then stop the thread after the work already submitted."""
        with self._lock:
            loans, self._loans = self._loans, []
        for loan in loans:
            loan.end(abandon=True)
        self.executor.shutdown(wait=False, cancel_futures=True)
