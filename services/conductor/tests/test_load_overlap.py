"""A prefix load the prefill computes on as it lands, priced as it runs.

A one-process prefill instance computes each layer of a prompt as soon as that
layer's prefix pages have landed, so a load of `t` seconds and a compute of `p` take
about max(t, p) + min(t, p) / L on an L-layer model, not t + p. The conductor prices
that once the engines have announced the model's layers (`InstanceUp.kv_spec`): an
estimate's `transfer_s` is what the load adds to the compute. Logs recorded before
the setting replay with loads and compute added up.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from yb_conductor.replay import replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev
from yb_core.kv_spec import KVCacheSpec

# Two layers of 32 KiB a token: the crafted cost model's 64 KiB a token, two layers.
SPEC = KVCacheSpec(parts=("k", "v"), heads=8, dim=512, dtype="float32", num_layers=2)


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def _transfer(c: Any) -> ev.RequestScheduled:
    """The crafted placement test's cluster: 2 blocks on p-0's host, 9 on the other's,
    the other host busy: a request of 10 blocks pulls 7 over to p-0 (8 ms of load,
    2 of them local) and computes one block and a token (17 ms)."""
    c.hosts(2)
    c.feed(
        ev.InstanceUp(instance_id="p-0", role="prefill", host="h0", max_batch_size=1, kv_spec=SPEC)
    )
    c.store("kv-0", keys(2))
    c.store("kv-1", keys(9))
    c.admit("busy", keys(30, base=9000))
    c.admit("busy2", keys(30, base=7000))
    c.progress("busy", "p-0", "prefill_done")
    d = c.admit("r", keys(10))
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert d.prefill_instance == "p-0" and d.explain.branch == "transfer"
    assert d.reused_blocks == 9
    return d


def test_a_load_the_prefill_computes_on_costs_what_it_adds(crafted: Any) -> None:
    c = crafted()
    d = _transfer(c)
    load, compute = 0.008, d.estimates.prefill_s
    assert compute == pytest.approx(0.017)
    # max(8, 17) + min(8, 17) / 2 layers = 21 ms in all: the load adds 4 ms.
    assert d.estimates.transfer_s == pytest.approx(max(load, compute) + load / 2 - compute)
    assert replay(c.records).divergences == []


def test_without_overlap_a_load_and_the_compute_add_up(crafted: Any) -> None:
    d = _transfer(crafted(prefix_load_overlap=False))
    assert d.estimates.transfer_s == pytest.approx(0.008)


def test_before_the_engines_announce_their_layers_nothing_is_hidden(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    c.store("kv-0", keys(2))
    c.store("kv-1", keys(9))
    c.admit("busy", keys(30, base=9000))
    c.admit("busy2", keys(30, base=7000))
    c.progress("busy", "p-0", "prefill_done")
    d = c.admit("r", keys(10))
    assert isinstance(d, ev.RequestScheduled)
    assert d.estimates.transfer_s == pytest.approx(0.008)


def test_logs_recorded_before_the_setting_replay_without_overlap(crafted: Any) -> None:
    c = crafted()
    raw = msgspec.json.decode(msgspec.json.encode(c.cfg))
    del raw["prefix_load_overlap"]
    assert recorded_settings(msgspec.json.encode(raw).decode()).prefix_load_overlap is False
