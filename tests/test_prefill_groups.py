"""A prefill group (chunked pipeline parallelism) serving requests in a real cluster.

One `yb up` cluster with the tiny random model (2 layers) and 16-token chunks: a
whole-model prefill instance (`prefill-0`) and one group of 2 stages
(`--prefill-groups 2`), each stage holding one layer; kept up when an instance dies.
The decode instance is tensor-parallel (TP=2, one KV head per rank): each stage sends
its layers' pages cut in its ranks' heads.
The fixture arranges who serves what by construction:

1. the group's second stage is killed, so the group cannot run (a layer is
   uncovered) and every request goes to `prefill-0`: its greedy answers to the
   module's prompts are the reference, and it puts their full blocks into the pool;
2. the second stage is started again (it rejoins the group) and `prefill-0` is
   killed: from then on the conductor can plan only on the group.

In file order: the stages announce their group and layers, and each request is
planned on the group (`prefill_stages`); the group's greedy tokens equal the whole
model's, for a prompt of one chunk, of several chunks, and one whose first three
blocks each stage loads from the pool (its own layers of them); the blocks the
group computes go into the pool (each stage puts its layers) and are reused; a job
not planned on the group, and a stage job from an instance that leads no group, are
refused with their reasons; a client that leaves while the lead holds its request
between chunks gets every stage's pages and decode's reservation freed; SIGKILL of
the second stage while the lead holds a request between its chunks (failpoint
`prefill.chunk`) ends that stream cleanly, with an error (no prefill can take its
re-plan), and frees the lead's and decode's pages; the log replays to the same
decisions.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus
from yb_testkit.faults import (
    FaultRecord,
    Gate,
    RawStream,
    Scraper,
    SseClient,
    command_of,
    complete,
    decision_of,
    events_of,
    kill,
    long_stream_body,
    read_log,
    record,
    restart,
    tiny_prompt,
    wait_all,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster

HEARTBEAT_S = 4.0
ACT_S = 60.0
MAX_TOKENS = 8
CHUNK = 16
BLOCK = 64
WHOLE, LEAD, SECOND = "prefill-0", "prefill-g0-0", "prefill-g0-1"

pytestmark = [pytest.mark.timeout(300, func_only=True)]


#: One chunk; four chunks and no full block; three full blocks (from the pool, once
#: the reference put them there) and four chunks after them.
PROMPTS = [tiny_prompt(1, 12), tiny_prompt(2, BLOCK - 1), tiny_prompt(3, 3 * BLOCK + 60)]
IDS = ["one-chunk", "four-chunks", "pool-prefix"]


@dataclass
class Group:
    """The cluster, its gate, and the whole model's answers to `PROMPTS`."""

    cluster: LocalCluster
    gate: Gate
    reference: list[str] = field(default_factory=list)
    restarted: subprocess.Popen[bytes] | None = None


def _verdict(cluster: LocalCluster, instance_id: str, after: int) -> bool:
    """Whether the log has a verdict on `instance_id` past sequence `after`."""
    return any(
        item.seq > after
        and isinstance(item.event, ev.InstanceDown)
        and item.event.instance_id == instance_id
        for item in read_log(cluster)
    )


def _up_again(cluster: LocalCluster, instance_id: str, after: int) -> bool:
    """Whether `instance_id` announced itself past sequence `after`."""
    return any(
        item.seq > after
        and isinstance(item.event, ev.InstanceUp)
        and item.event.instance_id == instance_id
        for item in read_log(cluster)
    )


def _last_seq(cluster: LocalCluster) -> int:
    return max(item.seq for item in read_log(cluster))


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    root = tmp_path_factory.mktemp("prefill-groups")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "1", "--prefill-groups", "2", "--decode", "1", "--kvstore", "1"),
        "--keep-going",
        env={
            "YB_PREFILL__CHUNK_SIZE": str(CHUNK),
            # Decode at TP=2: the stages' whole pages land cut in its ranks' KV heads.
            "YB_DECODE__TENSOR_PARALLEL": "2",
            # Room in decode for several long streams at once (the tiny model's longest
            # sequence is 4,096 tokens; one is the laptop default).
            "YB_DECODE__KV_SEQUENCES": "8",
            # Reuse comes from the pool, which every stage reads.
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_GATEWAY__TTFT_SLO_S": "3600",
            "YB_FAILPOINTS": gate.spec("prefill.chunk=hold(1)"),
        },
    )
    cluster.start(timeout_s=300)
    state = Group(cluster, gate)
    try:
        # The cluster is ready once one prefill instance is: the others may still load.
        wait_until(
            lambda: all(_up_again(cluster, i, 0) for i in (WHOLE, LEAD, SECOND)),
            ACT_S * 3,
            "every prefill instance announced",
        )
        # 1. The group without its second stage: the whole model answers.
        second = command_of(cluster.pids[SECOND])
        seq = _last_seq(cluster)
        kill(cluster, SECOND)
        wait_until(lambda: _verdict(cluster, SECOND, seq), ACT_S, f"{SECOND} declared down")
        for prompt in PROMPTS:
            body = complete(cluster, prompt, max_tokens=MAX_TOKENS)
            decision = decision_of(cluster, body["id"])
            assert isinstance(decision, ev.RequestScheduled), decision
            assert decision.prefill_instance == WHOLE and not decision.prefill_stages
            state.reference.append(_text(body))
        # 2. The second stage back, the whole-model instance gone.
        seq = _last_seq(cluster)
        state.restarted = restart(second, cluster.data_dir / "logs" / f"{SECOND}.log")
        wait_until(lambda: _up_again(cluster, SECOND, seq), ACT_S, f"{SECOND} announced again")
        seq = _last_seq(cluster)
        kill(cluster, WHOLE)
        wait_until(lambda: _verdict(cluster, WHOLE, seq), ACT_S, f"{WHOLE} declared down")
        yield state
    finally:
        gate.release_everything()
        cluster.stop()
        if state.restarted is not None:
            state.restarted.kill()
            state.restarted.wait(timeout=30)


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
    assert lead.tensor_parallel == second.tensor_parallel == 1
    assert ups["decode-0"].tensor_parallel == 2
    body = complete(cluster, PROMPTS[0], max_tokens=MAX_TOKENS)
    decision = decision_of(cluster, body["id"])
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.prefill_instance == LEAD
    assert decision.prefill_stages == [LEAD, SECOND]


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=IDS)
def test_the_group_gives_the_whole_modelstiny_prompt(group: Group, index: int) -> None:
    cluster, prompt = group.cluster, PROMPTS[index]
    body = complete(cluster, prompt, max_tokens=MAX_TOKENS)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert _text(body) == group.reference[index]
    decision = decision_of(cluster, body["id"])
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.prefill_stages == [LEAD, SECOND]
    # The reference put full blocks into the pool: each stage loads its layers of them.
    reused = (len(prompt) - 1) // BLOCK * BLOCK
    assert decision.reused_blocks * BLOCK == reused
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == reused
    progress: list[tuple[str, str, int, int]] = []

    def milestones() -> bool:
        # Logged off the request's path (the lead's outbox): in the log soon after
        # the answer, not necessarily before it.
        progress[:] = [
            (e.instance_id, e.stage, e.computed_tokens, e.reused_tokens)
            for e in events_of(read_log(cluster), ev.RequestProgress)
            if e.request_id == body["id"] and e.stage in ("prefill_started", "prefill_done")
        ]
        return any(stage == "prefill_done" for _, stage, _, _ in progress)

    wait_until(milestones, ACT_S, f"the prefill milestones of {body['id']}")
    assert progress == [
        (LEAD, "prefill_started", 0, 0),
        (LEAD, "prefill_done", len(prompt) - reused, reused),
    ]


def test_the_group_puts_its_blocks_into_the_pool(group: Group) -> None:
    cluster = group.cluster
    prompt = tiny_prompt(5, 3 * BLOCK + 20)
    seq = _last_seq(cluster)
    first = complete(cluster, prompt, max_tokens=MAX_TOKENS)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    def stored() -> int:
        return sum(
            len(item.event.block_hashes)
            for item in read_log(cluster)
            if item.seq > seq and isinstance(item.event, ev.BlockStored)
        )

    # Every stage sent its layer of each full block; the last committed them.
    wait_until(lambda: stored() >= 3, ACT_S, "the group's three blocks stored in the pool")
    again = complete(cluster, prompt, max_tokens=MAX_TOKENS)
    decision = decision_of(cluster, again["id"])
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.prefill_stages == [LEAD, SECOND] and decision.reused_blocks == 3
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert _text(again) == _text(first)


def test_what_a_stage_will_not_run_is_refused_with_its_reason(group: Group) -> None:
    """A job not planned on the group, at its lead; a stage job from an instance that
    leads no group, at a stage: each refused, saying why, nothing run."""

    async def ask() -> tuple[pr.JobReply, pr.StageReply]:
        bus = await Bus.connect(group.cluster.nats_config(), "test-prefill-groups")
        try:
            decision = ev.RequestScheduled(
                request_id="r-whole",
                gateway_id="gateway-0",
                prefill_instance=LEAD,
                decode_instance="decode-0",
            )
            job = pr.PrefillJob(
                request_id="r-whole",
                token_ids=PROMPTS[0],
                block_hashes=[],
                sampling=pr.SamplingParams(),
                decision=decision,
                token_subject="yb.tok.test.r-whole",
                deadline=time.time() + ACT_S,
            )
            reply = await bus.request(pr.prefill_job_subject(LEAD), pr.encode(job), timeout_s=ACT_S)
            stage_job = pr.StageJob(
                request_id="r-stage",
                lead_instance="decode-0",
                next_instance=LEAD,
                last=True,
                prompt_len=12,
                deadline=time.time() + ACT_S,
                decode_instance="decode-0",
                decode_address="",
                num_pages=1,
            )
            stage_reply = await bus.request(
                pr.prefill_stage_subject(SECOND), pr.encode(stage_job), timeout_s=ACT_S
            )
            return (
                pr.job_reply_decoder.decode(reply.data),
                pr.stage_reply_decoder.decode(stage_reply.data),
            )
        finally:
            await bus.close()

    refused, stage_refused = asyncio.run(ask())
    assert isinstance(refused, pr.JobRefused), refused
    assert "runs only requests planned on the group" in refused.reason
    assert isinstance(stage_refused, pr.StageRefused), stage_refused
    assert stage_refused.reason == "decode-0 does not lead prefill group 'g0'"
    scraper = Scraper(group.cluster)
    assert scraper.pages_used(LEAD) == 0 and scraper.pages_used(SECOND) == 0


def test_a_client_that_leaves_frees_every_stages_pages(group: Group) -> None:
    cluster, gate = group.cluster, group.gate
    scraper = Scraper(cluster)
    gate.arm("prefill.chunk")
    stream = RawStream(cluster, long_stream_body(tiny_prompt(6, 3 * CHUNK), max_tokens=MAX_TOKENS))
    held = gate.wait_held("prefill.chunk", ACT_S)
    assert held.instance_id == LEAD and held.request_id == stream.request_id
    # Both stages hold the prompt's pages, decode its reservation.
    assert scraper.pages_used(LEAD) > 0 and scraper.pages_used(SECOND) > 0
    stream.close()
    wait_all(
        {
            f"{stage} to free the prompt's pages": lambda stage=stage: (
                scraper.pages_used(stage) == 0
            )
            for stage in (LEAD, SECOND, "decode-0")
        }
        | {
            "the request to end cancelled": lambda: any(
                e.request_id == held.request_id and e.outcome == "cancelled"
                for e in events_of(read_log(cluster), ev.RequestFinished)
            )
        },
        ACT_S,
    )


def test_a_stage_killed_mid_request_ends_it_cleanly_and_frees_the_pages(group: Group) -> None:
    cluster, gate = group.cluster, group.gate
    scraper = Scraper(cluster)
    gate.arm("prefill.chunk")
    stream = SseClient(cluster, long_stream_body(PROMPTS[1], max_tokens=MAX_TOKENS))
    held = gate.wait_held("prefill.chunk", ACT_S)
    assert held.instance_id == LEAD
    # The lead holds the prompt's pages and decode its reservation, between chunks.
    assert scraper.pages_used(LEAD) > 0
    # The second stage runs as the fixture restarted it.
    assert group.restarted is not None
    killed_at = time.monotonic()
    group.restarted.kill()
    group.restarted.wait(timeout=10)
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
    assert sum(bool(d.prefill_stages) for d in decisions) >= len(PROMPTS) + 1, decisions
    result = replay([LogRecord(seq=item.seq, event=item.event) for item in logged])
    assert result.divergences == []
