"""`LayerArrivals`: what an engine thread computing on a landing prefix waits on.

The fetch's runs report their whole leading layers from the event loop; the engine
thread waits before each layer for every run to have delivered it, and never waits
past the fetch's deadline or after a failure. Threads here are the engine thread;
every wait ends by construction (a layer delivered, a failure, or a deadline that
has passed), never by a sleep.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import pytest

from yb_dataplane.prefix_fetch import LayerArrivals, PrefixLoadFailed, _layer_counter


async def test_a_layer_is_ready_once_every_run_has_delivered_it() -> None:
    arrivals = LayerArrivals(range(4), runs=2, deadline=time.monotonic() + 60)
    assert arrivals.ready == 0 and not arrivals.first.done()
    arrivals.advance(0, 3)
    assert arrivals.ready == 0  # run 1 has nothing yet
    arrivals.advance(1, 1)
    assert arrivals.ready == 1 and arrivals.first.done()
    arrivals.wait_layer(0)  # returns at once
    arrivals.advance(1, 4)
    assert arrivals.ready == 3


async def test_the_engine_thread_waits_for_its_layer_only() -> None:
    arrivals = LayerArrivals(range(10, 13), runs=1, deadline=time.monotonic() + 60)
    reached: list[int] = []

    def engine() -> None:
        for layer in range(10, 13):  # model layers 10..12 are page layers 0..2
            arrivals.wait_layer(layer)
            reached.append(layer)

    thread = threading.Thread(target=engine)
    thread.start()
    for delivered in (1, 2, 3):
        arrivals.advance(0, delivered)
        # The thread may pass the delivered layers, never the next one.
        await asyncio.to_thread(_until, _at_least(reached, delivered))
        assert reached == list(range(10, 10 + delivered))
    await asyncio.to_thread(thread.join, 60)
    assert not thread.is_alive()


async def test_a_failure_ends_every_wait_and_every_later_one() -> None:
    arrivals = LayerArrivals(range(3), runs=1, deadline=time.monotonic() + 60)
    errors: list[BaseException] = []

    def engine() -> None:
        try:
            arrivals.wait_layer(1)
        except PrefixLoadFailed as exc:
            errors.append(exc)

    thread = threading.Thread(target=engine)
    thread.start()
    arrivals.advance(0, 1)
    arrivals.fail("kvstore-1 went away")
    await asyncio.to_thread(thread.join, 60)
    assert [str(e) for e in errors] == ["kvstore-1 went away"]
    with pytest.raises(PrefixLoadFailed, match="went away"):
        arrivals.wait_layer(0)  # delivered, but the load as a whole failed
    assert arrivals.first.done()


async def test_no_wait_outlives_the_deadline() -> None:
    arrivals = LayerArrivals(range(2), runs=1, deadline=time.monotonic() - 1)
    with pytest.raises(PrefixLoadFailed, match="deadline"):
        arrivals.wait_layer(0)


async def test_no_runs_means_every_layer_is_there() -> None:
    arrivals = LayerArrivals(range(5), runs=0, deadline=time.monotonic())
    assert arrivals.first.done()
    arrivals.wait_layer(4)


async def test_indices_landing_in_any_order_count_against_their_layers() -> None:
    """Index `(i * layers + layer) * pieces + j` (block i's piece j of `layer`): a
    layer is whole once every block's every piece of it landed, and only whole
    leading layers count."""
    layers, blocks, pieces = 4, 3, 2
    arrivals = LayerArrivals(range(layers), runs=1, deadline=time.monotonic() + 60)
    landed = _layer_counter(arrivals, 0, blocks, layers, pieces)
    by_layer = {
        layer: [(i * layers + layer) * pieces + j for i in range(blocks) for j in range(pieces)]
        for layer in range(layers)
    }
    rng = random.Random(3)
    # Layer 1 lands whole before layer 0 does: nothing is ready until layer 0 is.
    for index in rng.sample(by_layer[1], len(by_layer[1])):
        landed(index)
    assert arrivals.ready == 0
    first_of_0 = rng.sample(by_layer[0], len(by_layer[0]))
    for index in first_of_0[:-1]:
        landed(index)
    assert arrivals.ready == 0
    landed(first_of_0[-1])
    assert arrivals.ready == 2  # layers 0 and 1
    for index in by_layer[3]:
        landed(index)
    assert arrivals.ready == 2
    for index in by_layer[2]:
        landed(index)
    assert arrivals.ready == 4


def _at_least(items: list[int], n: int) -> Callable[[], bool]:
    return lambda: len(items) >= n


def _until(done: Callable[[], bool]) -> None:
    """Spin (briefly yielding) until `done()`: the engine thread is running, not
    waiting, so it gets there on its own."""
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, "the engine thread did not move"
        time.sleep(0.001)
