"""`yb up` with the default model serves and reuses prefixes in 8 GB.

The whole cluster (NATS, conductor, gateway, two prefill engines, a decode engine, two
kvstores, the launcher) runs in a cgroup that may hold at most 8 GiB, as on a laptop
with little else free. Two prompts that share a 40-block prefix are served; the second
reuses the first's blocks; no process is killed for memory or restarted; and what the
engines took is printed by `yb up`. What the cluster costs when nothing limits it is in
the measurements page (`e2e_chat`, `e2e_reuse`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from yb_core import events as ev
from yb_testkit.cgroup import CgroupUnavailable, MemoryCgroup
from yb_testkit.faults import decision_of, events_of, read_log, wait_until
from yb_testkit.fixtures import LocalCluster

LIMIT_BYTES = 8 * 2**30
MODEL = "SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900, func_only=True)]


@pytest.fixture(scope="module")
def limited(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, MemoryCgroup]]:
    try:
        cgroup = MemoryCgroup.create(LIMIT_BYTES)
    except CgroupUnavailable as exc:
        pytest.skip(f"no memory-limited cgroup here: {exc}")
    cluster = LocalCluster(tmp_path_factory.mktemp("limited") / "cluster", cgroup=cgroup)
    try:
        cluster.start(timeout_s=600)
        yield cluster, cgroup
    finally:
        cluster.stop()
        cgroup.remove()


def _complete(cluster: LocalCluster, prompt: list[int]) -> dict[str, object]:
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        headers=cluster.headers,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    return body


def test_the_default_cluster_serves_and_reuses_in_8_gib(
    limited: tuple[LocalCluster, MemoryCgroup],
) -> None:
    cluster, cgroup = limited
    rng = random.Random(16)
    prefix = [rng.randrange(100, 40000) for _ in range(40 * 64)]
    first = _complete(cluster, [*prefix, *(rng.randrange(100, 40000) for _ in range(20))])

    def pooled() -> bool:
        # The prefix is in a kvstore, so any prefill instance can reuse it.
        stored = [
            e
            for e in events_of(read_log(cluster), ev.BlockStored)
            if e.instance_id.startswith("kvstore-")
        ]
        return sum(len(e.block_hashes) for e in stored) >= 40

    wait_until(pooled, 120, "the first prompt's blocks in a kvstore")
    second = _complete(cluster, [*prefix, *(rng.randrange(100, 40000) for _ in range(20))])
    decision = decision_of(cluster, str(second["id"]), timeout_s=60)
    assert isinstance(decision, ev.RequestScheduled)
    assert decision.reused_blocks >= 40, decision  # the shared prefix, from a cache tier
    assert first["choices"] and second["choices"]

    assert cgroup.oom_kills() == 0
    info = cluster.info()
    assert info.restarts == {} and info.given_up == {}, cluster.output()[-3000:]
    assert "exited with" not in cluster.output()
    # yb up said what each engine took, and the cluster ran inside the cgroup (three
    # engines' weights alone are over 1.5 GiB).
    output = cluster.output()
    assert "KV cache per engine" in output, output[-3000:]
    for engine in ("prefill-0", "prefill-1", "decode-0"):
        assert f"  {engine} " in output.split("KV cache per engine")[1]
    assert cgroup.peak_bytes() > 2 * 2**30
