"""A job past its compute does not hold the engine: the next one runs meanwhile.

One `yb up` cluster with one prefill instance. A first request is parked at the
failpoint `prefill.commit` (its prompt computed, its KV not yet committed on decode);
the job of a second request sent then must start while the first is still parked,
which it could not if the prefill instance waited for each job's commit and hand-over
before starting the next. Released, both complete (the second's KV goes to the same
decode instance after the first's).

The prefill engine has `PAGES` pages, no prefix cache and no upload: a job whose prompt does not
fit beside the parked one's pages waits in the queue for them (the engine's queue
gauge shows it there) instead of failing for want of pages, and completes once the
parked one is released.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from yb_testkit.faults import Gate, Scraper, SseClient, assert_completed, wait_until
from yb_testkit.fixtures import LocalCluster

MODEL = "tiny"
ACT_S = 60.0  # a request to reach the gate, a stream to end (an upper bound)
BLOCK = 64  # tokens per page (the CPU default)
PAGES = 10  # the prefill engine's pages
# 7 pages (two do not fit in PAGES), of ids within the tiny model's vocabulary.
LONG_PROMPT = [10 + i % 200 for i in range(6 * BLOCK + 1)]

pytestmark = [pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Gate]]:
    root = tmp_path_factory.mktemp("pipelined")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", MODEL, "--prefill", "1", "--decode", "1"),
        env={
            "YB_FAILPOINTS": gate.spec("prefill.commit=hold"),
            "YB_MODEL__BLOCK_SIZE": str(BLOCK),
            "YB_PREFILL__NUM_KV_PAGES": str(PAGES),
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            # A finished job's blocks are held while they are uploaded to the
            # kvstore, in a task of their own: no upload, so that a job's pages come
            # back when the job ends.
            "YB_PREFILL__STORE_BLOCKS": "false",
        },
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster, gate
    finally:
        gate.release_everything()
        cluster.stop()


def test_the_next_job_starts_while_one_waits_for_its_commit(
    gated: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = gated
    gate.arm("prefill.commit")
    body = {"model": MODEL, "prompt": "parked", "max_tokens": 1, "stream": True}
    parked = SseClient(cluster, body, timeout_s=ACT_S * 2)
    try:
        held = gate.wait_held("prefill.commit", ACT_S)
        following = SseClient(cluster, {**body, "prompt": "next"}, timeout_s=ACT_S * 2)
        following.started.wait(ACT_S)
        assert following.request_id, following.describe()
        (prefill,) = [i for i in cluster.pids if i.startswith("prefill")]
        wait_until(
            lambda: _started(cluster.instance_log(prefill), following.request_id),
            ACT_S,
            "the next job to start while the first is parked",
        )
        # Its KV waits for the parked one's transfer to the same decode instance.
        assert not parked.done.is_set(), parked.describe()
        gate.release(held)
        parked.wait_done(ACT_S)
        following.wait_done(ACT_S)
    finally:
        gate.release_everything()
    assert_completed(parked, following)


def _started(log: str, request_id: str) -> bool:
    """Whether the prefill instance's log says it started `request_id`'s job."""
    return any('"prefill_started"' in line and request_id in line for line in log.splitlines())


def test_a_job_that_needs_the_pages_of_one_finishing_waits_for_them(
    gated: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = gated
    (prefill,) = [i for i in cluster.pids if i.startswith("prefill")]
    scraper = Scraper(cluster)
    gate.arm("prefill.commit")
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "stream": True}
    parked = SseClient(cluster, body, timeout_s=ACT_S * 2)
    try:
        held = gate.wait_held("prefill.commit", ACT_S)
        waiting = SseClient(cluster, body, timeout_s=ACT_S * 2)
        queued = "yb_engine_queue_requests"
        wait_until(
            lambda: scraper.value(prefill, queued) == 1 or waiting.done.is_set(),
            ACT_S,
            "the second long prompt to wait in the prefill queue",
        )
        assert not waiting.done.is_set(), waiting.describe()
        gate.release(held)
        parked.wait_done(ACT_S)
        waiting.wait_done(ACT_S)
    finally:
        gate.release_everything()
    assert_completed(parked, waiting)
