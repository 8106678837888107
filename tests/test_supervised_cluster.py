"""`yb up` keeps its cluster up when a process dies: the default `--on-exit restart`.

One `yb up` cluster as a user starts it, no `--keep-going` (tiny model; 2 prefill,
2 decode, 2 kvstore), killed from outside as a crash would. In file order:

1. the decode instance of a greedy stream is SIGKILLed while the stream is parked
   after its 20th token: the stream goes on, without an error, with the text of an
   undisturbed run; `yb up` says what exited (code, log) and restarts it, and the new
   process announces itself;
2. a prefill instance and both kvstores are SIGKILLed: all three are restarted, and
   the cluster serves again, prompts stored in and reused from the restarted pool;
3. nats-server is SIGKILLed: `yb up` starts it again on its port and store, and the
   services, reconnecting, serve again;
4. a kvstore whose SSD tier is broken (a file where its directory goes) dies at
   every start: `yb up` gives up on it after 5 tries in a row, says why, and the
   cluster keeps serving with the other one;
5. the last kvstore breaks the same way: no kvstore is left, and `yb up` stops the
   cluster and exits non-zero, leaving no process behind.

And on a cluster with one decode instance: a stream whose decode is killed ends with
the clean error (there is nowhere to re-plan it), and the next request is served once
`yb up` has the instance back.

The conductor's heartbeat timeout is a minute here, as long as the gateway's
token-idle timeout, so a stream survives only if the death is known at once (the
launcher's verdict, the restarted process's own notice), never by waiting. What
breaks is parked at a failpoint first; every wait has its own deadline and ends as
soon as its condition holds.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from yb_core import events as ev
from yb_testkit.faults import (
    Gate,
    SseClient,
    complete,
    decision_of,
    events_of,
    kill,
    long_stream_body,
    read_log,
    tiny_prompt,
    wait_every_engine_up,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster, pid_alive

HOLD_TOKENS = 20
ACT_S = 60.0
VERDICT_S = 60.0
# Five failed starts: 1 + 2 + 4 + 8 s of back-off, and five starts of a kvstore.
GIVE_UP_S = 180.0

pytestmark = [pytest.mark.timeout(600, func_only=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Gate]]:
    root = tmp_path_factory.mktemp("supervised")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "2", "--decode", "2", "--kvstore", "2"),
        # Kills in earlier tests count as exits in a row: a short ceiling keeps the
        # give-up tests' five back-offs short (what they check is the count).
        *("--restart-max-backoff", "4"),
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": "60",
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            # Reuse comes from the pool, not a prefill's own pages.
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            "YB_FAILPOINTS": gate.spec(f"decode.token=hold({HOLD_TOKENS})"),
        },
    )
    cluster.start(timeout_s=300)
    try:
        # The tests kill one engine of two and re-plan onto the other.
        assert (
            len([i for i in cluster.pids if i.startswith(("prefill-", "decode-", "kvstore-"))]) == 6
        )
        wait_every_engine_up(cluster)
        yield cluster, gate
    finally:
        gate.release_everything()
        cluster.stop()


def _restarted(cluster: LocalCluster, instance_id: str, times: int) -> bool:
    """`yb up` restarted `instance_id` `times` times and the new process announced
    itself (the launcher says so once it saw the announcement)."""
    said = cluster.output().count(f"{instance_id} is back: it announced itself again")
    return cluster.info().restarts.get(instance_id, 0) >= times and said >= times


def test_a_stream_survives_its_decode_killed_and_decode_comes_back(
    supervised: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = supervised
    body = long_stream_body(tiny_prompt(1, 200), max_tokens=60)
    gate.arm("decode.token")
    stream = SseClient(cluster, body)
    held = gate.wait_held("decode.token", ACT_S)
    first = decision_of(cluster, held.request_id, timeout_s=ACT_S)
    assert isinstance(first, ev.RequestScheduled)
    assert first.decode_instance == held.instance_id
    kill(cluster, held.instance_id)
    stream.wait_done(VERDICT_S + ACT_S)
    assert stream.completed, stream.describe()

    wait_until(lambda: _restarted(cluster, held.instance_id, 1), ACT_S, "decode back")
    output = cluster.output()
    assert f"{held.instance_id} (decode) exited with signal SIGKILL" in output
    assert f"restarting {held.instance_id} in 1s (restart 1)" in output
    verdicts = [
        e.reason
        for e in events_of(read_log(cluster), ev.InstanceDown)
        if e.instance_id == held.instance_id
    ]
    assert "its process exited with signal SIGKILL (yb up)" in verdicts
    (replan,) = [
        e
        for e in events_of(read_log(cluster), ev.RequestReplanned)
        if e.request_id == held.request_id
    ]
    assert replan.failed_instance == held.instance_id

    # The undisturbed run, with both decode instances up again.
    undisturbed = SseClient(cluster, body)
    undisturbed.wait_done(ACT_S)
    assert undisturbed.completed, undisturbed.describe()
    assert stream.text() == undisturbed.text()


def test_prefill_and_kvstores_killed_come_back_and_serve(
    supervised: tuple[LocalCluster, Gate],
) -> None:
    cluster, _ = supervised
    cluster.refresh_pids()
    victims = ["prefill-0", "kvstore-0", "kvstore-1"]
    before = {name: cluster.info().restarts.get(name, 0) for name in victims}
    for name in victims:
        kill(cluster, name)
    for name in victims:
        wait_until(lambda n=name: _restarted(cluster, n, before[n] + 1), ACT_S, f"{name} back")
    # Served again, and the restarted pool keeps and hands out blocks: the same
    # four-block prompt twice, the second time from the pool.
    prompt = tiny_prompt(7, 4 * 64 + 10)
    first = complete(cluster, prompt)
    # A request completes before its prefill's blocks are in the log (the store is
    # announced once written): ask again only once they are.
    (admitted,) = [
        e for e in events_of(read_log(cluster), ev.RequestAdmitted) if e.request_id == first["id"]
    ]
    wanted = set(admitted.block_hashes[:4])

    def pooled() -> bool:
        stored = set()
        for e in events_of(read_log(cluster), ev.BlockStored):
            if e.instance_id.startswith("kvstore-"):
                stored.update(e.block_hashes)
        return wanted <= stored

    wait_until(pooled, ACT_S, "the first request's blocks in a kvstore")
    again = complete(cluster, prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]

    # The second request's decision reuses the first's blocks (shown whole if not).
    decision = decision_of(cluster, again["id"], timeout_s=ACT_S)
    assert isinstance(decision, ev.RequestScheduled) and decision.reused_blocks >= 4, decision


def test_nats_killed_is_restarted_and_the_cluster_serves_again(
    supervised: tuple[LocalCluster, Gate],
) -> None:
    cluster, _ = supervised
    cluster.refresh_pids()
    kill(cluster, "nats-server")
    wait_until(
        lambda: cluster.info().restarts.get("nats-server", 0) >= 1, ACT_S, "nats-server restarted"
    )
    assert "nats-server (nats) exited with signal SIGKILL" in cluster.output()

    def serves() -> bool:
        try:
            complete(cluster, tiny_prompt(9, 80))
        except (AssertionError, httpx.HTTPError):
            return False  # 503 (or no answer in time) while the services reconnect
        return True

    wait_until(serves, ACT_S, "a request served after NATS came back")


def _break_ssd_tier(cluster: LocalCluster, kvstore: str) -> None:
    """A file where the kvstore's SSD directory goes: every start fails on it."""
    ssd = cluster.data_dir / "ssd" / kvstore
    shutil.rmtree(ssd, ignore_errors=True)
    ssd.write_text("not a directory\n")


def test_a_kvstore_that_dies_at_every_start_is_given_up_on(
    supervised: tuple[LocalCluster, Gate],
) -> None:
    cluster, _ = supervised
    cluster.refresh_pids()
    _break_ssd_tier(cluster, "kvstore-1")
    kill(cluster, "kvstore-1")
    wait_until(lambda: "kvstore-1" in cluster.info().given_up, GIVE_UP_S, "give up on kvstore-1")
    output = cluster.output()
    assert "giving up on kvstore-1: it exited 5 times in a row before announcing itself" in output
    assert re.search(r"kvstore-1 \(kvstore\) exited with code \d+ after [\d.]+s, before", output)
    assert "FileExistsError" in output  # the last lines of its log, shown by yb up
    assert cluster.process is not None and cluster.process.poll() is None  # still up
    complete(cluster, tiny_prompt(8, 100))


def test_no_kvstore_left_stops_the_cluster(supervised: tuple[LocalCluster, Gate]) -> None:
    cluster, _ = supervised
    pids = cluster.refresh_pids()
    _break_ssd_tier(cluster, "kvstore-0")
    kill(cluster, "kvstore-0")
    assert cluster.process is not None
    wait_until(lambda: cluster.process.poll() is not None, GIVE_UP_S, "yb up to stop")
    assert cluster.process.returncode == 1
    output = cluster.output()
    assert "no kvstore instance is left (kvstore-0, kvstore-1 given up on)" in output
    assert not [name for name, pid in pids.items() if pid_alive(pid)]


def test_with_one_decode_the_stream_ends_cleanly_and_the_next_is_served(
    tmp_path: Path,
) -> None:
    gate = Gate(tmp_path / "gate")
    cluster = LocalCluster(
        tmp_path / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "1", "--decode", "1", "--kvstore", "1"),
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": "60",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_FAILPOINTS": gate.spec(f"decode.token=hold({HOLD_TOKENS})"),
        },
    )
    cluster.start(timeout_s=300)
    try:
        gate.arm("decode.token")
        stream = SseClient(cluster, long_stream_body(tiny_prompt(3, 100), max_tokens=60))
        held = gate.wait_held("decode.token", ACT_S)
        kill(cluster, held.instance_id)
        stream.wait_done(VERDICT_S)
        assert stream.ended_cleanly_with_error, stream.describe()
        assert "decode-0" in stream.error_message()
        wait_until(lambda: _restarted(cluster, "decode-0", 1), ACT_S, "decode back")
        complete(cluster, tiny_prompt(4, 100))
    finally:
        gate.release_everything()
        cluster.stop()
