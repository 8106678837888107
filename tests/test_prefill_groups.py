"""A prefill group (chunked pipeline parallelism) serving requests in a real cluster.

Two `yb up` clusters with the tiny random model (2 layers) and 16-token chunks, one
after the other:

- the reference: one whole-model prefill instance, whose greedy answers to the
  module's prompts are the tokens every other path must give;
- the group: no whole-model prefill instance, one group of 2 stages
  (`--prefill 0 --prefill-groups 2`), each stage holding one layer, so the conductor
  can only plan on the group, and every request runs through both stages (kept up
  when an instance dies).

In file order: the stages announce their group and layers, and the conductor plans
each request on the group (`prefill_stages`); the group's greedy tokens equal the
whole model's, for prompts of one chunk and of many chunks and blocks; SIGKILL of the
second stage while the lead holds a request between its chunks (failpoint
`prefill.chunk`) ends that stream cleanly, with an error (no prefill can take its
re-plan), and frees the lead's and decode's pages; the log replays to the same
decisions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_testkit.faults import (
    FaultRecord,
    Gate,
    Scraper,
    SseClient,
    complete,
    decision_of,
    events_of,
    kill,
    long_stream_body,
    read_log,
    record,
    wait_all,
)
from yb_testkit.fixtures import LocalCluster

HEARTBEAT_S = 4.0
ACT_S = 60.0
MAX_TOKENS = 8
CHUNK = 16
LEAD, SECOND = "prefill-g0-0", "prefill-g0-1"

pytestmark = [pytest.mark.timeout(300, func_only=True)]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


#: One chunk; many chunks and more than two 64-token blocks.
PROMPTS = [_tokens(1, 12), _tokens(2, 200)]


def _cluster(root: Path, *args: str, gate: Gate | None = None) -> LocalCluster:
    env = {
        "YB_PREFILL__CHUNK_SIZE": str(CHUNK),
        "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
        "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
        "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
        "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
        "YB_GATEWAY__TTFT_SLO_S": "3600",
    }
    if gate is not None:
        env["YB_FAILPOINTS"] = gate.spec("prefill.chunk=hold(1)")
    return LocalCluster(
        root,
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--decode", "1", "--kvstore", "1"),
        *args,
        env=env,
    )


@dataclass
class Group:
    """The group's cluster, its gate, and the reference answers to `PROMPTS`."""

    cluster: LocalCluster
    gate: Gate
    reference: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    root = tmp_path_factory.mktemp("prefill-groups")
    reference = _cluster(root / "reference", "--prefill", "1")
    reference.start(timeout_s=300)
    try:
        texts = [_text(complete(reference, p, max_tokens=MAX_TOKENS)) for p in PROMPTS]
    finally:
        reference.stop()
    gate = Gate(root / "gate")
    cluster = _cluster(
        root / "group", "--prefill", "0", "--prefill-groups", "2", "--keep-going", gate=gate
    )
    cluster.start(timeout_s=300)
    try:
        yield Group(cluster, gate, texts)
    finally:
        gate.release_everything()
        cluster.stop()


def _text(body: dict[str, object]) -> str:
    choices = body["choices"]
    assert isinstance(choices, list)
    text = choices[0]["text"]
    assert isinstance(text, str)
    return text


def test_the_stages_announce_their_group_and_requests_are_planned_on_it(group: Group) -> None:
    cluster = group.cluster
    ups = {e.instance_id: e for e in events_of(read_log(cluster), ev.InstanceUp)}
    lead, second = ups[LEAD], ups[SECOND]
    assert (lead.group, lead.layer_start, lead.layer_end, lead.num_layers) == ("g0", 0, 1, 2)
    assert (second.group, second.layer_start, second.layer_end) == ("g0", 1, 2)
    assert lead.chunk_tokens == second.chunk_tokens == CHUNK
    body = complete(cluster, PROMPTS[0], max_tokens=MAX_TOKENS)
    decision = decision_of(cluster, body["id"])
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.prefill_instance == LEAD
    assert decision.prefill_stages == [LEAD, SECOND]


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=["one-chunk", "many-chunks"])
def test_the_group_gives_the_whole_models_tokens(group: Group, index: int) -> None:
    cluster, prompt = group.cluster, PROMPTS[index]
    body = complete(cluster, prompt, max_tokens=MAX_TOKENS)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert _text(body) == group.reference[index]
    progress = [
        (e.instance_id, e.stage, e.computed_tokens)
        for e in events_of(read_log(cluster), ev.RequestProgress)
        if e.request_id == body["id"] and e.stage in ("prefill_started", "prefill_done")
    ]
    assert progress == [(LEAD, "prefill_started", 0), (LEAD, "prefill_done", len(prompt))]


def test_a_stage_killed_mid_request_ends_it_cleanly_and_frees_the_pages(group: Group) -> None:
    cluster, gate = group.cluster, group.gate
    scraper = Scraper(cluster)
    gate.arm("prefill.chunk")
    stream = SseClient(cluster, long_stream_body(PROMPTS[1], max_tokens=MAX_TOKENS))
    held = gate.wait_held("prefill.chunk", ACT_S)
    assert held.instance_id == LEAD
    # The lead holds the prompt's pages and decode its reservation, between chunks.
    assert scraper.pages_used(LEAD) > 0
    killed_at = kill(cluster, SECOND)
    gate.release(held)
    stream.wait_done(ACT_S)
    ended_s = stream.ended_at - killed_at
    assert stream.ended_cleanly_with_error, stream.describe()
    wait_all(
        {
            "the lead to free the prompt's pages": lambda: scraper.pages_used(LEAD) == 0,
            "decode to free its reservation": lambda: scraper.pages_used("decode-0") == 0,
            "the request to end failed in the log": lambda: any(
                e.request_id == held.request_id and e.outcome == "failed"
                for e in events_of(read_log(cluster), ev.RequestFinished)
            ),
        },
        ACT_S,
    )
    record(
        "prefill_stage_death",
        FaultRecord(
            fault="a stage of a prefill group dies mid-request",
            caused_by=f"SIGKILL {SECOND} (layers 1-2 of 2) while the lead holds the request "
            "after its first chunk (failpoint prefill.chunk)",
            client_saw=f"the stream ended with an error {ended_s:.2f}s after the kill "
            "(no other prefill could take the re-plan)",
            cleaned_up="the lead failed the job (RequestFinished failed) and gave decode's "
            "reservation back; the lead's and decode's pages are free",
            checked_by="the client's stream; RequestFinished in the log; "
            "yb_engine_kv_pages_used of the lead and decode",
            recovery_s=round(ended_s, 3),
            details={"heartbeat_timeout_s": HEARTBEAT_S},
        ),
    )


def test_the_log_replays_to_the_same_decisions(group: Group) -> None:
    logged = read_log(group.cluster)
    decisions = list(events_of(logged, ev.RequestScheduled))
    assert sum(bool(d.prefill_stages) for d in decisions) >= 3, decisions
    result = replay([LogRecord(seq=item.seq, event=item.event) for item in logged])
    assert result.divergences == []
