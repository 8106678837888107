"""Failpoints: the strict parser, and hold / release / cancel / deadline behaviour."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from yb_core.config import ConfigError, load_config
from yb_core.failpoints import DEFAULT_TIMEOUT_S, FailpointError, Failpoints, Hold, parse

# --- parsing ----------------------------------------------------------------------------


def test_parse_reads_points_gate_and_timeout() -> None:
    spec = parse(" gate=/tmp/g ; timeout=30;decode.token=hold(20);prefill.chunk=once:hold(1);")
    assert spec.gate == Path("/tmp/g")
    assert spec.timeout_s == 30
    assert spec.holds == {
        "decode.token": Hold("decode.token", 20, False),
        "prefill.chunk": Hold("prefill.chunk", 1, True),
    }


def test_parse_empty_and_off_arm_nothing() -> None:
    assert parse("").holds == {}
    spec = parse("decode.token=off")
    assert spec.holds == {} and spec.timeout_s == DEFAULT_TIMEOUT_S
    assert parse("gate=/g;prefill.commit=hold").holds["prefill.commit"].count == 0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gate=/g;decode.tokens=hold(2)", "unknown point or option 'decode.tokens'"),
        ("gate=/g;decode.token=pause(2)", "unknown action"),
        ("gate=/g;decode.token=hold", "needs a count"),
        ("gate=/g;decode.token=hold(0)", "at least 1"),
        ("gate=/g;decode.token=hold(-1)", "unknown action"),
        ("gate=/g;prefill.commit=hold(3)", "takes no count"),
        ("decode.token=hold(2)", "no gate=DIR"),
        ("gate=/g;timeout=soon;decode.token=hold(2)", "not a number"),
        ("gate=/g;timeout=0;decode.token=hold(2)", "must be positive"),
        ("gate=/g;decode.token", "not NAME=VALUE"),
        ("gate=/g;decode.token=hold(1);decode.token=hold(2)", "given twice"),
    ],
)
def test_parse_refuses_what_it_does_not_know(text: str, says: str) -> None:
    with pytest.raises(FailpointError, match=re.escape(says)):
        parse(text)


def test_config_refuses_a_bad_failpoint_at_load() -> None:
    with pytest.raises(ConfigError, match="unknown point"):
        load_config(env={"YB_FAILPOINTS": "gate=/g;decode.tokn=hold(2)"})
    cfg = load_config(env={"YB_FAILPOINTS": "gate=/g;decode.token=hold(2)"})
    assert cfg.failpoints.endswith("hold(2)")


def test_unset_failpoints_are_inert() -> None:
    fp = Failpoints.from_text("", "decode-0")
    assert fp.count("decode.token") is None
    assert asyncio.run(fp.hold("decode.token", "r1")) == "not_held"


# --- holding ----------------------------------------------------------------------------


def _reached(gate: Path) -> list[Path]:
    return sorted(gate.glob("decode.token.*.reached"))


async def _until(check: object, timeout_s: float = 30) -> None:
    """Until `check()` is true (a deadline, never a fixed sleep)."""
    assert callable(check)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_hold_parks_until_its_release_and_says_it_was_reached(tmp_path: Path) -> None:
    fp = Failpoints.from_text(f"gate={tmp_path};decode.token=hold(3)", "decode-0")
    assert fp.count("decode.token") == 3
    task = asyncio.create_task(fp.hold("decode.token", "cmpl/1"))
    reached = tmp_path / "decode.token.cmpl_1.reached"
    await _until(reached.exists)
    marker = json.loads(reached.read_text())
    assert marker == {
        "point": "decode.token",
        "request_id": "cmpl/1",
        "instance_id": "decode-0",
        "count": 3,
    }
    # Parked, and the event loop runs on: another hold at another request parks too.
    other = asyncio.create_task(fp.hold("decode.token", "cmpl-2"))
    await _until((tmp_path / "decode.token.cmpl-2.reached").exists)
    assert not task.done() and not other.done()
    (tmp_path / "decode.token.cmpl_1.release").touch()
    assert await asyncio.wait_for(task, 30) == "released"
    assert not other.done()  # a release is per request
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


async def test_release_all_frees_current_and_later_holds(tmp_path: Path) -> None:
    fp = Failpoints.from_text(f"gate={tmp_path};prefill.commit=hold", "prefill-0")
    task = asyncio.create_task(fp.hold("prefill.commit", "a"))
    await _until((tmp_path / "prefill.commit.a.reached").exists)
    (tmp_path / "prefill.commit.release").touch()
    assert await asyncio.wait_for(task, 30) == "released"
    assert await fp.hold("prefill.commit", "b") == "not_held"
    assert not (tmp_path / "prefill.commit.b.reached").exists()


async def test_a_cancelled_request_leaves_its_hold(tmp_path: Path) -> None:
    fp = Failpoints.from_text(f"gate={tmp_path};prefill.chunk=hold(1)", "prefill-0")
    cancelled = asyncio.Event()
    task = asyncio.create_task(fp.hold("prefill.chunk", "r", cancelled=cancelled.is_set))
    await _until((tmp_path / "prefill.chunk.r.reached").exists)
    assert not task.done()
    cancelled.set()
    assert await asyncio.wait_for(task, 30) == "cancelled"


async def test_a_hold_proceeds_at_its_deadline(tmp_path: Path) -> None:
    fp = Failpoints.from_text(f"gate={tmp_path};timeout=0.05;prefill.chunk=hold(0)", "p")
    assert await asyncio.wait_for(fp.hold("prefill.chunk", "r"), 30) == "timed_out"


async def test_once_holds_only_the_request_that_claims_the_arm_file(tmp_path: Path) -> None:
    spec = f"gate={tmp_path};decode.token=once:hold(5)"
    # Two instances share the gate: one arm file parks exactly one request.
    a, b = Failpoints.from_text(spec, "decode-0"), Failpoints.from_text(spec, "decode-1")
    assert await a.hold("decode.token", "before") == "not_held"  # not armed yet
    (tmp_path / "decode.token.arm").touch()
    held = [
        asyncio.create_task(fp.hold("decode.token", rid))
        for fp, rid in ((a, "r0"), (b, "r1"), (a, "r2"), (b, "r3"))
    ]
    await _until(lambda: sum(t.done() for t in held) == 3)
    waiting = [t for t in held if not t.done()]
    assert len(waiting) == 1
    assert all(t.result() == "not_held" for t in held if t.done())
    (reached,) = _reached(tmp_path)
    rid = json.loads(reached.read_text())["request_id"]
    assert not (tmp_path / "decode.token.arm").exists()
    (tmp_path / f"decode.token.{rid}.release").touch()
    assert await asyncio.wait_for(waiting[0], 30) == "released"


# --- the decode batcher's parking (what `decode.token` holds with) ----------------------


def test_a_parked_request_keeps_its_pages_while_the_batch_goes_on() -> None:
    from yb_core.protocol import SamplingParams
    from yb_engine import (
        DecodeBatcher,
        ModelRunner,
        PageAllocator,
        PagedKVCache,
        Sampler,
        new_generator,
        tiny_random_model,
    )

    model = tiny_random_model(0)
    cache = PagedKVCache(model.config, 64, 4)
    alloc = PageAllocator(64)
    runner = ModelRunner(model, cache)
    batcher = DecodeBatcher(runner, alloc, model.tokenizer, 8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid in ("held", "free"):
        ids = [5, 6, 7, 8, 9]
        pages = alloc.allocate(cache.pages_for(len(ids)))
        logits = runner.prefill(ids, pages)
        first = Sampler().sample(logits[None], [params], [new_generator(params)])[0]
        batcher.add(rid, ids, pages, first, params)
    batcher.step()  # first tokens of both, and one decode step
    assert batcher.park("held") and not batcher.park("unknown")
    counts = {"held": 0, "free": 0}
    while batcher.has_work():  # ends: a parked request is no work
        for out in batcher.step():
            counts[out.request_id] += 1
    assert counts == {"held": 0, "free": 4}
    assert batcher.kv_pages_used > 0 and batcher.num_running == 1  # kept, pages and all
    batcher.unpark("held")
    assert batcher.has_work()
    while batcher.has_work():
        for out in batcher.step():
            counts[out.request_id] += 1
    assert counts == {"held": 4, "free": 4}
    assert alloc.num_used == 0
    # An abort ends a parked request too, and frees its pages.
    batcher.add("again", [5, 6], alloc.allocate(1), 7, params)
    batcher.step()
    assert batcher.park("again") and batcher.abort("again")
    assert [o.finish_reason for o in batcher.step()] == ["abort"]
    assert not batcher.has_work() and alloc.num_used == 0
