"""`yb sim` on a four-request trace whose every figure is worked out by hand.

The cost model is chosen for round numbers (block = 512 tokens, as in the trace):

- prefill: 1 ms per computed token, nothing else (no base, no attention term);
- loading one block: 10 ms from the host's own pool (512 tokens x 1000 bytes at
  0.0512 GB/s), 20 ms from another host's (0.0256 GB/s);
- decode: 10 ms per step whatever the batch.

Two hosts (prefill-i + kvstore-i) and one decode instance, the conductor with
admission `none`. The trace and what must happen:

- r0 at t=0: blocks [1, 2, 3], 1124 tokens, 3 output tokens. Nothing cached; all idle,
  so prefill-0 (first by id) computes all 1124 tokens: TTFT = 1.124 s. Its two full
  blocks [1, 2] go into kvstore-0. Decode: 2 steps of 10 ms from 1.124 -> ends 1.144,
  TBT 0.010.
- r1 at t=2.0: [1, 2, 4], 1124 tokens, 2 out. prefill-0 holds [1, 2] locally:
  load 2 x 10 ms + compute 100 tokens = 0.020 + 0.100 = 0.120 s. On prefill-1 it
  would pull them: 2 x 20 ms + 0.100 = 0.140 s. The conductor picks prefill-0;
  TTFT = 0.120 s (busy until 2.120).
- r2 at t=2.05: [1, 2, 5], same lengths. prefill-0: queue 0.070 + 0.120 = 0.190;
  prefill-1: pull 2 blocks from kvstore-0, 0.140. prefill-1 wins and pulls
  2 blocks = 2 x 512 x 1000 = 1,024,000 bytes; TTFT = 0.140 s.
- r3 at t=3.0: [9], 100 tokens, 1 output token: nothing reusable (the only block
  holds the last token), prefill-0 (first by id, idle): TTFT = 0.100 s; it ends with
  its first token.

Reused: r1 1024 tokens locally, r2 1024 remotely, of 3 x 1124 + 100 = 3472 prefilled:
hit ratio 2048 / 3472.
"""

from __future__ import annotations

import pytest

from yb_conductor.replay import replay
from yb_core import events as ev
from yb_testkit.cost_models import BLOCK_BYTES, ROUND_512
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import workload_from
from yb_tools.traces import TraceRecord

ROUND = ROUND_512

TRACE = [
    TraceRecord(timestamp=0, input_length=1124, output_length=3, hash_ids=[1, 2, 3]),
    TraceRecord(timestamp=2000, input_length=1124, output_length=2, hash_ids=[1, 2, 4]),
    TraceRecord(timestamp=2050, input_length=1124, output_length=2, hash_ids=[1, 2, 5]),
    TraceRecord(timestamp=3000, input_length=100, output_length=1, hash_ids=[9]),
]


def _run(record_log: bool = False) -> tuple[Simulation, PolicyResult]:
    params = SimParams(prefill=2, decode=1, block_size=512, max_tokens=0)
    items = workload_from(TRACE, block_size=512)
    sim = Simulation(
        items, params, ROUND, policy="mooncake", admission="none", record_log=record_log
    )
    return sim, sim.run()


def test_every_request_takes_the_hand_computed_path() -> None:
    sim, _ = _run()
    jobs = {j.item.request_id: j for j in sim.jobs}
    assert [jobs[f"req-{i}"].prefill for i in range(4)] == [0, 0, 1, 0]
    ttfts = [jobs[f"req-{i}"].ttft_s for i in range(4)]
    assert ttfts == pytest.approx([1.124, 0.120, 0.140, 0.100])
    assert [jobs[f"req-{i}"].reused_local for i in range(4)] == [0, 2, 0, 0]
    assert [jobs[f"req-{i}"].reused_remote for i in range(4)] == [0, 0, 2, 0]
    assert [jobs[f"req-{i}"].finish_time for i in range(4)] == pytest.approx(
        [1.144, 2.130, 2.200, 3.100]
    )
    assert [jobs[f"req-{i}"].tbt_s for i in range(3)] == pytest.approx([0.010] * 3)
    assert all(j.fate == "completed" for j in sim.jobs)


def test_figures_of_the_hand_computed_run() -> None:
    _, r = _run()
    assert (r.requests, r.completed, r.rejected, r.timed_out) == (4, 4, 0, 0)
    assert r.ttft_mean_s == pytest.approx((1.124 + 0.120 + 0.140 + 0.100) / 4)
    assert r.ttft_p50_s == pytest.approx((0.120 + 0.140) / 2)
    assert r.tbt_mean_s == pytest.approx(0.010)
    assert r.transfer_bytes == 2 * BLOCK_BYTES
    assert (r.local_reused_tokens, r.remote_reused_tokens) == (1024, 1024)
    assert r.cache_hit_ratio == pytest.approx(2048 / 3472)
    assert r.slo_attainment == 1.0
    assert r.wasted_prefill_s == 0.0
    assert r.simulated_s == pytest.approx(3.1)


def test_the_conductor_estimated_what_the_engines_then_took() -> None:
    sim, _ = _run(record_log=True)
    assert sim.records is not None
    decisions = {
        r.event.request_id: r.event for r in sim.records if isinstance(r.event, ev.RequestScheduled)
    }
    r2 = decisions["req-2"]
    assert r2.estimates.transfer_s == pytest.approx(0.040)
    assert r2.estimates.ttft_s == pytest.approx(0.140)
    assert [p.source_instance for p in r2.reuse] == ["kvstore-0"]
    # The simulator's log is a production log: a fresh conductor reproduces it.
    result = replay(sim.records)
    assert result.divergences == []
    assert result.decisions == 4
