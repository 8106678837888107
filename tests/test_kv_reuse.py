"""A prompt computed once is, the second time, served from the KV pool: the whole cluster.

`yb up` with the tiny model (2 prefill instances on two logical hosts, each with its
kvstore): a prompt computed once comes back with its prefix reused (the client sees
it as `usage.prompt_tokens_details.cached_tokens`), from the computing instance's own
pages; and once that instance cannot take work (SIGSTOPped until the conductor
declares it dead), from its host's kvstore, pulled over UCX by the other instance.
The answers are the same every time (greedy decoding).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from yb_testkit.fixtures import LocalCluster

BLOCK = 64  # the default block size

# The cluster's start-up (the module fixture, with its own deadline) does not count
# against the test's timeout.
pytestmark = pytest.mark.timeout(300, func_only=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("kv-reuse"),
        "--model",
        "tiny-random",
        "--model-name",
        "tiny",
        # Short enough to wait for once (the SIGSTOPped instance), long enough that no
        # instance starved for a few seconds on a busy machine is declared dead.
        env={"YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": "10"},
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def complete(cluster: LocalCluster, tokens: list[int]) -> tuple[list[int], int, str]:
    """(generated text as token-ish ids, cached tokens, request id) of one completion."""
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": "tiny", "prompt": tokens, "max_tokens": 6, "temperature": 0},
        timeout=60,
        headers=cluster.headers,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return body["choices"][0]["text"], cached, body["id"]


def prefill_of(cluster: LocalCluster, request_id: str) -> str:
    # Prefill logs the request after handing it to decode, so the answer may reach
    # the client first: look for a while.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for name in ("prefill-0", "prefill-1"):
            for line in cluster.instance_log(name).splitlines():
                if '"prefill_done"' in line and request_id in line:
                    return name
        time.sleep(0.1)
    raise AssertionError(f"no prefill instance logged {request_id}")


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def metric(cluster: LocalCluster, instance_id: str, prefix: str) -> float:
    """The sum of an instance's samples whose line starts with `prefix`, from /metrics."""
    address = ""
    for line in cluster.instance_log(instance_id).splitlines():
        if '"metrics_listening"' in line:
            record = json.loads(line)
            address = f"{record['host']}:{record['port']}"
    assert address, f"{instance_id} logged no metrics address"
    text = httpx.get(f"http://{address}/metrics", timeout=5, headers=cluster.metrics_headers).text
    samples = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    ]
    assert samples, f"{instance_id} exports no {prefix}"
    return sum(samples)


def stored_blocks(cluster: LocalCluster, instance_id: str) -> float:
    """Blocks the kvstore stored from puts."""
    return metric(cluster, instance_id, 'yb_kvstore_puts_total{outcome="stored"}')


def live_prefills(cluster: LocalCluster) -> list[str]:
    body = httpx.get(f"{cluster.url}/readyz", timeout=5).json()
    return list(body.get("prefill_instances", []))


def test_a_prompt_computed_once_is_served_from_the_pool(cluster: LocalCluster) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(10, 250) for _ in range(6 * BLOCK)]
    first, cached, rid = complete(cluster, [*prefix, 1, 2, 3])
    assert cached == 0
    computed_on = prefill_of(cluster, rid)

    # Again: the conductor plans the prefix from where it is (at least the engine's own
    # pages), and the answer does not change.
    again, cached, _ = complete(cluster, [*prefix, 1, 2, 3])
    assert again == first
    assert cached == 6 * BLOCK

    # The instance that computed it stops taking work: the other one pulls the prefix
    # from the first one's host kvstore.
    host_store = "kvstore-" + computed_on.rsplit("-", 1)[1]
    # The puts into the kvstore are off the request's path: wait until they landed.
    wait_for(lambda: stored_blocks(cluster, host_store) >= 6, 30, "the blocks to be stored")
    pid = cluster.pids[computed_on]
    os.kill(pid, signal.SIGSTOP)
    try:
        # Until its heartbeat lapses (the gateway applies the conductor's timeout too).
        wait_for(lambda: computed_on not in live_prefills(cluster), 30, "the heartbeat to lapse")
        # And the conductor, which places the request, counts it dead too (it sees
        # the silence on its own clock; no sleep can promise when).
        alive = f'yb_conductor_instance_alive{{instance="{computed_on}"}}'
        wait_for(lambda: metric(cluster, "conductor-0", alive) == 0, 30, "the conductor's verdict")
        remote, cached, rid = complete(cluster, [*prefix, 1, 2, 3])
    finally:
        os.kill(pid, signal.SIGCONT)
    assert remote == first
    assert cached == 6 * BLOCK
    other = "prefill-1" if computed_on == "prefill-0" else "prefill-0"
    assert prefill_of(cluster, rid) == other
    log = cluster.instance_log(other)
    assert "prefix_fetch_failed" not in log
    # Zero-copy all the way: the fetch into the other prefill's pages, the layer-wise
    # stream into decode and the puts into the kvstores landed straight in place.
    for instance in ("prefill-0", "prefill-1", "decode-0", "kvstore-0", "kvstore-1"):
        if instance != computed_on:
            assert metric(cluster, instance, "yb_kv_staged_bytes_total") == 0, instance
