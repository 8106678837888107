"""Tensor-parallel instances through the whole cluster, with different degrees on
prefill and decode.

`yb up` serves a tiny random Llama (4 heads, 2 KV heads) with prefill at TP=2 and
decode at TP=1, prefill at TP=1 and decode at TP=2, and prefill at TP=4 (each KV head
held by two ranks) and decode at TP=2; and a tiny DeepSeek-V3 (latent attention: one
latent per token, kept by every rank, sent once) at TP=4 and TP=2. Each instance is
rank 0 (the service) and its ranks' processes, computing together over gloo. For each
pair:

- the official `openai` client's greedy text is what one process computes, streamed
  and not: the KV a prefill writes, cut by its ranks, lands cut by decode's ranks;
- a prompt whose prefix the pool holds is answered with that prefix fetched from a
  kvstore (no engine prefix cache here) and the same text;
- every engine announces its degree, and the log replays to the same decisions;
- (TP=2 prefill) a rank killed takes its instance down: the instance retires from the
  log, and the next requests are served by the cluster all the same.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.faults import events_of, read_log, wait_until
from yb_testkit.fixtures import LocalCluster
from yb_testkit.reference import assert_prefix_reused_from_pool, single_process_answer

BLOCK = 64
ASK: list[Any] = [{"role": "user", "content": "Tell me about the weather in Paris."}]
PAIRS = [("llama", 2, 1), ("llama", 1, 2), ("llama", 4, 2), ("deepseek_v3", 4, 2)]

pytestmark = pytest.mark.timeout(420, func_only=True)


class Served:
    def __init__(self, prefill_tp: int, decode_tp: int, path: Path, cluster: LocalCluster):
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        self.path = path
        self.cluster = cluster
        self.client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=0)


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{f}-P{p}-D{d}" for f, p, d in PAIRS])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    family, prefill_tp, decode_tp = request.param
    root = tmp_path_factory.mktemp(f"{family}-tp-{prefill_tp}-{decode_tp}")
    checkpoint = build_checkpoint(family, root / "model")
    cluster = LocalCluster(
        root / "data",
        *("--model", str(checkpoint), "--model-name", "tiny"),
        *("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)),
        # No prefix cache in the prefill engines: a reused prefix comes from the pool.
        env={"YB_PREFILL__PREFIX_CACHE_PAGES": "0"},
    )
    cluster.start(timeout_s=300)
    try:
        yield Served(prefill_tp, decode_tp, checkpoint, cluster)
    finally:
        cluster.stop()


def test_the_openai_client_gets_what_one_process_computes(served: Served) -> None:
    expected = single_process_answer(ASK, 16, model_path=served.path)
    completion = served.client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=16
    )
    assert completion.choices[0].message.content == expected
    stream = served.client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=16, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_prefix_in_the_pool_is_reused_and_changes_nothing(served: Served) -> None:
    assert_prefix_reused_from_pool(served.cluster, "tiny", block_size=BLOCK)


def test_engines_announce_their_degree_and_the_log_replays(served: Served) -> None:
    log = read_log(served.cluster)
    degrees = {
        up.instance_id: up.tensor_parallel
        for up in events_of(log, ev.InstanceUp)
        if up.role in ("prefill", "decode")
    }
    assert degrees, degrees
    for instance, degree in degrees.items():
        want = served.prefill_tp if instance.startswith("prefill") else served.decode_tp
        assert degree == want, degrees
    result = replay([LogRecord(seq=item.seq, event=item.event) for item in log])
    assert result.divergences == []


def test_a_lost_rank_takes_its_instance_down_and_nothing_is_lost(served: Served) -> None:
    if served.prefill_tp != 2:
        pytest.skip("run once, on the cluster whose prefill instances have two ranks")
    cluster = served.cluster
    victim = "prefill-0"
    # The cluster is ready once one instance of each role serves: the victim may
    # still be loading (a rank killed then fails its start, not its service).
    wait_until(
        lambda: any(up.instance_id == victim for up in events_of(read_log(cluster), ev.InstanceUp)),
        120.0,
        f"{victim} announced itself",
    )
    pids = cluster.refresh_pids()
    ranks = _children(pids[victim])
    assert len(ranks) == 1, ranks  # rank 1 of 2
    os.kill(ranks[0], signal.SIGKILL)
    wait_until(
        lambda: any(
            down.instance_id == victim for down in events_of(read_log(cluster), ev.InstanceDown)
        ),
        60.0,
        f"{victim} retired after losing a rank",
    )
    assert "tp_rank_lost" in cluster.instance_log(victim)
    expected = single_process_answer(ASK, 16, model_path=served.path)
    for _ in range(3):
        completion = served.client.chat.completions.create(
            model="tiny", messages=ASK, temperature=0, max_tokens=16
        )
        assert completion.choices[0].message.content == expected


def _children(pid: int) -> list[int]:
    """The processes `pid` started (its tensor-parallel ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent's pid; the command name (field 2) may hold spaces.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found
