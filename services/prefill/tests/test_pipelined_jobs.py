"""A job past its compute does not hold the engine: the next one runs meanwhile.

One `yb up` cluster with one prefill instance. A first request is parked at the
failpoint `prefill.commit` (its prompt computed, its KV not yet committed on decode);
a second request sent then must complete while the first is still parked, which it
could not if the prefill instance waited for each job's commit and hand-over before
starting the next. Released, the first completes too.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from yb_testkit.faults import Gate, SseClient
from yb_testkit.fixtures import LocalCluster

MODEL = "tiny"
ACT_S = 60.0  # a request to reach the gate, a stream to end (an upper bound)

pytestmark = [pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Gate]]:
    root = tmp_path_factory.mktemp("pipelined")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", MODEL, "--prefill", "1", "--decode", "1"),
        env={"YB_FAILPOINTS": gate.spec("prefill.commit=hold")},
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster, gate
    finally:
        gate.release_everything()
        cluster.stop()


def test_the_next_job_completes_while_one_waits_for_its_commit(
    gated: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = gated
    gate.arm("prefill.commit")
    parked = SseClient(
        cluster,
        {"model": MODEL, "prompt": "parked", "max_tokens": 1, "stream": True},
        timeout_s=ACT_S * 2,
    )
    try:
        held = gate.wait_held("prefill.commit", ACT_S)
        r = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": MODEL, "prompt": "next", "max_tokens": 1, "temperature": 0},
            headers=cluster.headers,
            timeout=ACT_S,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert not parked.done.is_set(), "the parked request ended before its release"
        gate.release(held)
        parked.wait_done(ACT_S)
    finally:
        gate.release_everything()
    assert parked.status == 200 and parked.failure is None, parked.describe()
    assert parked.frames[-1] == "[DONE]" and not parked.errors, parked.describe()
