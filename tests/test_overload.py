"""Overload: a burst far past capacity is shed with clean 429s and nothing breaks.

A real `yb up` (tiny model, TTFT SLO of 1 s) gets 150 streamed requests at the same
instant. Each must end as a completion or a 429 in the OpenAI format with
`Retry-After`, never a 5xx, a timeout or a broken stream; every process of the
cluster must survive; and the cluster must serve normally once the burst has passed.
How fast the refusals come back and whether the accepted requests meet their SLOs is
measured by `benchmarks/overload.py` (figures in docs/measurements.md), not asserted here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_testkit.fixtures import LocalCluster, pid_alive
from yb_tools.bench.client import BenchClient, RequestResult
from yb_tools.bench.workloads import Limits, SharedPrefix, shared_prefix_requests

BURST = 150
#: How long the burst may take to drain; a deadline for a loaded machine, not a bound
#: on speed (the wait ends as soon as the log shows the cluster idle).
DRAIN_S = 180.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data_dir: Path = tmp_path_factory.mktemp("overload")
    env = {"YB_GATEWAY__TTFT_SLO_S": "1.0", "YB_CONDUCTOR__ADMISSION": "predicted"}
    c = LocalCluster(data_dir, "--model", "tiny-random", env=env)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _burst(cluster: LocalCluster) -> tuple[list[RequestResult], RequestResult]:
    client = BenchClient(cluster.url, concurrency=BURST, api_key=cluster.api_key)
    try:
        info = await client.server_info()
        limits = Limits(vocab_size=info.vocab_size, max_model_len=info.max_model_len)
        workload = SharedPrefix(
            groups=BURST, prefix_tokens=256, users=1, question_tokens=8, output_tokens=8
        )
        specs = shared_prefix_requests(workload, limits, seed=5)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(client.send(spec, model=info.model, deadline_s=120, t0=t0) for spec in specs)
        )
        await _burst_passed(cluster, [r.request_id for r in results if r.ok])
        after = await client.send(specs[0], model=info.model, deadline_s=120, t0=t0)
    finally:
        await client.close()
    return list(results), after


async def _burst_passed(cluster: LocalCluster, accepted: list[str]) -> None:
    """Wait until the conductor's log shows the burst over: every accepted request
    finished on its decode instance, and after that every engine reported itself
    idle. A request admitted after this is folded after all of it, so it meets an
    idle cluster by construction, not after a pause that is long enough on most
    machines."""
    engines = {name for name in cluster.pids if name.startswith(("prefill-", "decode-"))}
    assert engines, cluster.pids
    waiting = set(accepted)
    idle: set[str] = set()
    bus = await Bus.connect(cluster.nats_config(), "test-overload", timeout_s=60)
    try:
        reader = await bus.read_ordered(
            ["yb.ev.req.request_finished", "yb.ev.instance.load_report.>"]
        )
        try:
            async with asyncio.timeout(DRAIN_S):
                while waiting or idle != engines:
                    item = await reader.next(timeout_s=DRAIN_S)
                    if item is None:
                        continue
                    match item.event:
                        case ev.RequestFinished(request_id=rid, instance_id=where):
                            if where.startswith("decode-"):
                                waiting.discard(rid)
                        case ev.LoadReport() as report if not waiting:
                            if report.running_requests or report.queued_requests:
                                idle.discard(report.instance_id)
                            elif report.instance_id in engines:
                                idle.add(report.instance_id)
                        case _:
                            pass
        except TimeoutError:
            raise AssertionError(
                f"the burst never passed: unfinished {sorted(waiting)[:5]}, "
                f"idle engines {sorted(idle)} of {sorted(engines)}"
            ) from None
        finally:
            await reader.close()
    finally:
        await bus.close()


@pytest.mark.timeout(600, func_only=True)  # the cluster starts in the fixture, on its own deadline
def test_a_burst_past_capacity_is_shed_with_429s_and_nothing_breaks(
    cluster: LocalCluster,
) -> None:
    results, after = asyncio.run(_burst(cluster))
    statuses = {r.status for r in results}
    assert statuses <= {200, 429}, {
        r.error: r.message for r in results if r.status not in (200, 429)
    }
    refused = [r for r in results if r.status == 429]
    accepted = [r for r in results if r.ok]
    assert refused, "the burst was far past capacity: some requests must be refused"
    assert accepted, "the cluster must still serve some of the burst"
    assert len(accepted) + len(refused) == BURST  # no timeout, no broken stream
    for r in refused:
        assert r.error == "http_429" and r.message  # an OpenAI error body with a message
        assert r.retry_after_s is not None and r.retry_after_s >= 1
    assert all(pid_alive(pid) for pid in cluster.pids.values()), "a process died"
    assert after.ok, f"the cluster does not serve after the burst: {after.error} {after.message}"
