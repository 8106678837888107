"""`EnginePause`: a call held at a layer boundary runs what is submitted meanwhile on
its own thread, then goes on, or ends when abandoned. `EngineThread` is the engine
thread `EngineHost` runs on; each "layer" notes itself, so the order of the work is
read from what ran, not from timing."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from yb_engine.pausing import EnginePause, EngineThread, PauseAbandoned

DEADLINE_S = 30.0


class Thread(EngineThread):
    """The engine thread as `EngineHost` keeps it, whose "forwards" note each layer."""

    def __init__(self) -> None:
        super().__init__(ThreadPoolExecutor(max_workers=1))
        self.ran: list[str] = []
        self.threads: set[int] = set()

    def layers(self, name: str, n: int, pause: EnginePause | None) -> str:
        """A "forward" of `n` layers, each noted, with `pause` as its layer hook."""
        for layer in range(n):
            self.threads.add(threading.get_ident())
            self.ran.append(f"{name}{layer}")
            if pause is not None:
                pause.at_layer(layer, 0, 1)
        return name


async def test_a_held_call_runs_what_is_submitted_then_goes_on() -> None:
    thread = Thread()
    pause = thread.pause_point()
    pause.wanted = True  # before it starts: it holds after its first layer
    line = thread.submit(thread.layers, "line", 3, pause)
    async with asyncio.timeout(DEADLINE_S):
        assert await asyncio.shield(pause.held) == (0, 0, 1)
        assert pause.holding
        urgent = await thread.submit(thread.layers, "urgent", 2, None)
        pause.resume()
        assert await line == "line"
    assert urgent == "urgent"
    assert thread.ran == ["line0", "urgent0", "urgent1", "line1", "line2"]
    assert len(thread.threads) == 1  # the urgent work ran on the held call's thread
    # Taken back: what is submitted now goes to the executor again.
    assert not thread._loans
    assert await asyncio.wait_for(thread.submit(lambda: "after"), DEADLINE_S) == "after"


async def test_an_abandoned_hold_ends_its_call_and_errors_reach_their_waiters() -> None:
    thread = Thread()
    pause = thread.pause_point()
    pause.wanted = True
    line = thread.submit(thread.layers, "line", 3, pause)
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.shield(pause.held)

        def fails() -> None:
            raise ValueError("bad prompt")

        with pytest.raises(ValueError, match="bad prompt"):
            await thread.submit(fails)
        pause.abandon()
        with pytest.raises(PauseAbandoned):
            await line
    assert thread.ran == ["line0"]
    pause.abandon()  # again: nothing left to end


async def test_abandoned_before_it_holds_the_call_ends_at_its_next_layer() -> None:
    thread = Thread()
    pause = thread.pause_point()
    started = threading.Event()
    go = threading.Event()

    def call() -> str:
        started.set()
        go.wait(DEADLINE_S)
        return thread.layers("line", 3, pause)

    line = thread.submit(call)
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.to_thread(started.wait, DEADLINE_S)
        pause.abandon()
        go.set()
        with pytest.raises(PauseAbandoned):
            await line
    assert thread.ran == ["line0"]
    assert not pause.held.done()
