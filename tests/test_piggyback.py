"""Short prompts prefilled inside a decode batch (piggybacking), on a real cluster.

One `yb up --piggyback` cluster (tiny model; 1 prefill, 2 decode, 2 kvstore; re-plan
budget 1), kept up when an instance dies. The conductor sends a prompt to a decode
instance only when its TTFT there is predicted lower than through the prefill pool,
so each scenario arranges its path by construction:

- the conductor's cost model (written here) prices attention heavily: a 3000-token
  prompt's prefill is predicted at 90 s, a 200-token one's at 0.4 s, and learned
  speed is off, so the estimates are the cost model's alone;
- the module's first request takes the normal path: with both pools idle the two
  options price the same (one step of the same prefill), and a tie goes to the
  prefill pool;
- `busy_prefill` parks a 3000-token prompt between its chunks (failpoint
  `prefill.chunk`): the prefill pool's queue is then predicted 90 s long, longer
  than any scenario runs, while an idle decode instance has no wait, so a
  short prompt goes there (the long one itself can never be piggybacked: no step
  could take a block of it within the TBT limit);
- a piggybacked prompt's full blocks go into the pool once computed, so a later
  request for the same prompt finds them there, and would be priced the cheaper on
  the decode instance on their host: `pool_stopped` SIGSTOPs every kvstore, so that
  nothing reaches the pool until it is resumed (puts wait for the store's answer),
  and the normal path computes a piggybacked prompt again from scratch.

In file order: a piggybacked prompt gives the normal path's greedy tokens (the pool
stopped meanwhile), its decision has `piggyback` set and the decode instance logs its
progress as a prefill would; a prompt whose prefix is in the pool reuses it (`cached_tokens`); a
piggybacked prompt's new blocks go into its host's kvstore (its `BlockStored`
events), and a later request reuses them, with the tokens the decode instance gave
computing it all; with the pool stopped a piggybacked prompt still completes, its
blocks' pages held by their upload until the kvstores resume; a client that leaves
while its prompt is in the batch gets its pages freed; SIGKILL of the decode
instance while it holds a piggybacked prompt in its batch (failpoint
`decode.prompt`, before any chunk) re-plans the request, which completes with the
same tokens; the log replays to the same decisions.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from yb_conductor.cost_model import load_cost_model, save_cost_model
from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_testkit.faults import (
    FaultRecord,
    Gate,
    RawStream,
    Scraper,
    SseClient,
    decision_of,
    events_of,
    kill,
    long_stream_body,
    read_log,
    record,
    signal_instance,
    tiny_prompt,
    wait_all,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster

BLOCK = 64
HEARTBEAT_S = 4.0
ACT_S = 60.0
VERDICT_S = 30.0
MAX_TOKENS = 12
PROMPT = 200  # three full blocks and a part
LONG = 3000
PUTS_STORED = 'yb_decode_block_puts_total{outcome="stored"}'


def _cost_model(path: Path) -> Path:
    """The default cost model with attention priced high (see the module docstring)."""
    model = load_cost_model("")
    prefill = msgspec.structs.replace(model.prefill, base_s=0.01, per_token_s=1e-4, per_pair_s=2e-5)
    decode = msgspec.structs.replace(model.decode, base_s=0.005, per_seq_s=0.001)
    save_cost_model(msgspec.structs.replace(model, prefill=prefill, decode=decode), path)
    return path


pytestmark = [pytest.mark.timeout(300, func_only=True)]


class Piggy:
    """The module's cluster, its gate and the normal path's answer to `prompt`."""

    def __init__(self, cluster: LocalCluster, gate: Gate) -> None:
        self.cluster = cluster
        self.gate = gate
        self.prompt = tiny_prompt(1, PROMPT)
        self.baseline: dict[str, Any] = {}


def _complete(cluster: LocalCluster, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        headers=cluster.headers,
        timeout=ACT_S,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.fixture(scope="module")
def piggy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Piggy]:
    root = tmp_path_factory.mktemp("piggyback")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "1", "--decode", "2", "--kvstore", "2"),
        "--piggyback",
        "--keep-going",
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            # Room in decode for several long streams at once (the tiny model's longest
            # sequence is 4,096 tokens; one is the laptop default).
            "YB_DECODE__KV_SEQUENCES": "8",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            # Prefixes are reused from the kvstores, the only pool a decode instance reads.
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            "YB_FAILPOINTS": gate.spec("prefill.chunk=hold(1)", "decode.prompt=hold"),
            "YB_CONDUCTOR__COST_MODEL": str(_cost_model(root / "cost-model.json")),
            "YB_CONDUCTOR__LEARN_SPEED": "false",
            # The long prompt's predicted TTFT is no reason to refuse it.
            "YB_GATEWAY__TTFT_SLO_S": "3600",
        },
    )
    cluster.start(timeout_s=300)
    try:
        state = Piggy(cluster, gate)
        # The normal path, while nothing has finished yet (see the module docstring).
        state.baseline = _complete(cluster, state.prompt)
        first = decision_of(cluster, state.baseline["id"])
        assert isinstance(first, ev.RequestScheduled) and not first.piggyback, first
        assert first.prefill_instance == "prefill-0"
        yield state
    finally:
        gate.release_everything()
        cluster.stop()


@contextmanager
def busy_prefill(piggy: Piggy, seed: int) -> Iterator[None]:
    """The prefill pool busy: a long prompt parked after its first chunk, let go (and
    answered) on the way out."""
    cluster, gate = piggy.cluster, piggy.gate
    gate.arm("prefill.chunk")
    parked = SseClient(cluster, long_stream_body(tiny_prompt(seed, LONG), max_tokens=4))
    held = gate.wait_held("prefill.chunk", ACT_S)
    try:
        yield
    finally:
        gate.release(held)
        parked.wait_done(ACT_S)
    assert parked.completed, parked.describe()


@contextmanager
def pool_stopped(cluster: LocalCluster) -> Iterator[None]:
    """Every kvstore SIGSTOPped, resumed on the way out: nothing is stored into the
    pool meanwhile, and every put waits for its answer. (A kvstore silent for the
    heartbeat timeout is declared dead by the conductor and taken back at its next
    report, its blocks resynced: no scenario here reads the pool meanwhile.)"""
    kvstores = [i for i in cluster.pids if i.startswith("kvstore-")]
    assert kvstores, cluster.pids
    for kvstore in kvstores:
        signal_instance(cluster, kvstore, signal.SIGSTOP)
    try:
        yield
    finally:
        for kvstore in kvstores:
            signal_instance(cluster, kvstore, signal.SIGCONT)


def _text(body: dict[str, Any]) -> str:
    text: str = body["choices"][0]["text"]
    return text


def _cached(body: dict[str, Any]) -> int:
    cached: int = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return cached


def _piggybacked(cluster: LocalCluster, request_id: str) -> ev.RequestScheduled:
    decision = decision_of(cluster, request_id)
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.piggyback, decision.explain.reason if decision.explain else decision
    assert decision.prefill_instance == decision.decode_instance
    assert decision.decode_instance.startswith("decode-")
    return decision


def _piggybacked_or_not(cluster: LocalCluster, request_id: str) -> bool:
    decision = decision_of(cluster, request_id)
    assert isinstance(decision, ev.RequestScheduled), decision
    return decision.piggyback


def test_a_piggybacked_prompt_gives_the_normal_pathstiny_prompt(piggy: Piggy) -> None:
    cluster = piggy.cluster
    # In no pool yet, and longer than one chunk of the decode batch (512 tokens).
    prompt = tiny_prompt(3, 700)
    with pool_stopped(cluster):
        with busy_prefill(piggy, seed=10):
            body = _complete(cluster, prompt)
        # Both pools idle now, and the prompt's blocks in no pool: the same prompt
        # takes the normal path, computed whole.
        normal = _complete(cluster, prompt)
    decision = _piggybacked(cluster, body["id"])
    assert decision.explain is not None and decision.explain.branch == "piggyback"
    assert decision.reused_blocks == 0 and _cached(body) == 0
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["usage"]["prompt_tokens"] == len(prompt)
    second = decision_of(cluster, normal["id"])
    assert isinstance(second, ev.RequestScheduled) and not second.piggyback, second
    assert second.reused_blocks == 0 and _cached(normal) == 0, second
    assert _text(body) == _text(normal)

    log = read_log(cluster)
    rid, where = body["id"], decision.decode_instance
    progress = [e for e in events_of(log, ev.RequestProgress) if e.request_id == rid]
    assert [(e.instance_id, e.stage) for e in progress] == [
        (where, "prefill_started"),
        (where, "prefill_done"),
        (where, "kv_committed"),
    ]
    assert (progress[1].computed_tokens, progress[1].reused_tokens) == (len(prompt), 0)
    (finished,) = [e for e in events_of(log, ev.RequestFinished) if e.request_id == rid]
    assert finished.instance_id == where and finished.outcome == "completed"
    assert finished.output_tokens == MAX_TOKENS and finished.ttft_s > 0


def test_a_piggybacked_prompt_reuses_its_prefix_from_the_pool(piggy: Piggy) -> None:
    cluster = piggy.cluster
    # The baseline's three full blocks are in the kvstores; a new tail follows them.
    prompt = piggy.prompt[: 3 * BLOCK] + tiny_prompt(2, 40)
    with busy_prefill(piggy, seed=20):
        body = _complete(cluster, prompt)
    decision = _piggybacked(cluster, body["id"])
    assert decision.reused_blocks == 3 and decision.reuse, decision
    assert all(plan.tier in ("dram", "ssd") for plan in decision.reuse)
    assert _cached(body) == 3 * BLOCK, body["usage"]
    normal = _complete(cluster, prompt)
    assert not _piggybacked_or_not(cluster, normal["id"])
    assert _text(body) == _text(normal)
    done: list[ev.RequestProgress] = []

    def logged() -> bool:
        # Logged off the request's path (the decode instance's outbox).
        done[:] = [
            e
            for e in events_of(read_log(cluster), ev.RequestProgress)
            if e.request_id == body["id"] and e.stage == "prefill_done"
        ]
        return bool(done)

    wait_until(logged, ACT_S, f"prefill_done of {body['id']}")
    assert len(done) == 1, done
    assert (done[0].computed_tokens, done[0].reused_tokens) == (
        len(prompt) - 3 * BLOCK,
        3 * BLOCK,
    )


def _stored_in_pool(cluster: LocalCluster, keys: list[int]) -> set[str]:
    """The kvstores whose `BlockStored` events hold every one of `keys`."""
    held: dict[str, set[int]] = {}
    for e in events_of(read_log(cluster), ev.BlockStored):
        if e.instance_id.startswith("kvstore-"):
            held.setdefault(e.instance_id, set()).update(e.block_hashes)
    return {kvstore for kvstore, hashes in held.items() if set(keys) <= hashes}


def test_a_piggybacked_prompts_blocks_go_into_the_pool_for_later_requests(
    piggy: Piggy,
) -> None:
    cluster = piggy.cluster
    scraper = Scraper(cluster)
    prompt = tiny_prompt(5, PROMPT)  # a new prefix: its three full blocks are in no pool
    with busy_prefill(piggy, seed=50):
        body = _complete(cluster, prompt)
    decision = _piggybacked(cluster, body["id"])
    assert decision.reused_blocks == 0 and _cached(body) == 0
    where = decision.decode_instance
    (admitted,) = [
        e for e in events_of(read_log(cluster), ev.RequestAdmitted) if e.request_id == body["id"]
    ]
    keys = admitted.block_hashes[:3]
    assert len(keys) == 3
    # The upload runs after the first token, off the request's path: wait for the
    # kvstore to log the blocks, the decode instance to count its puts, and the pages
    # it kept for them to come back.
    wait_all(
        {
            "a kvstore to log the prompt's three blocks": lambda: bool(
                _stored_in_pool(cluster, keys)
            ),
            f"{where} to count its puts": lambda: scraper.value(where, PUTS_STORED) >= 3,
            f"{where} to give the kept pages back": lambda: scraper.pages_used(where) == 0,
        },
        ACT_S,
    )
    (store,) = _stored_in_pool(cluster, keys)
    assert scraper.value(where, 'yb_decode_block_puts_total{outcome="failed"}') == 0
    # The same prompt again: the conductor plans it to reuse those blocks from that
    # kvstore, on whichever path (the decode instance on the kvstore's host may load
    # them cheaper than the prefill pool). The KV the decode instance computed gives
    # the tokens it gave computing the prompt whole.
    normal = _complete(cluster, prompt)
    second = decision_of(cluster, normal["id"])
    assert isinstance(second, ev.RequestScheduled), second
    assert second.reused_blocks == 3, second
    assert {plan.source_instance for plan in second.reuse} == {store}, second.reuse
    assert _cached(normal) == 3 * BLOCK, normal["usage"]
    assert _text(normal) == _text(body)


def test_a_piggybacked_prompt_does_not_wait_for_its_blocks_upload(piggy: Piggy) -> None:
    cluster = piggy.cluster
    scraper = Scraper(cluster)
    decodes = [i for i in cluster.pids if i.startswith("decode-")]
    prompt = tiny_prompt(6, PROMPT)  # a new prefix: nothing to fetch from the pool
    with busy_prefill(piggy, seed=60):
        pages = {d: scraper.pages_used(d) for d in decodes}
        stored = {d: scraper.value(d, PUTS_STORED) for d in decodes}
        with pool_stopped(cluster):
            body = _complete(cluster, prompt)
            where = _piggybacked(cluster, body["id"]).decode_instance
            wait_until(
                lambda: scraper.pages_used(where) == pages[where] + 3,
                ACT_S,
                f"{where} to hold only the prompt's three blocks, for their upload",
            )
            assert scraper.value(where, PUTS_STORED) == stored[where]
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    wait_all(
        {
            f"{where} to store the three blocks": lambda: (
                scraper.value(where, PUTS_STORED) == stored[where] + 3
            ),
            f"{where} to give their pages back": lambda: scraper.pages_used(where) == pages[where],
        },
        ACT_S,
    )


def test_a_client_that_leaves_frees_a_piggybacked_prompts_pages(piggy: Piggy) -> None:
    cluster, gate = piggy.cluster, piggy.gate
    scraper = Scraper(cluster)
    with busy_prefill(piggy, seed=40):
        gate.arm("decode.prompt")
        stream = RawStream(cluster, long_stream_body(tiny_prompt(4, 300), max_tokens=MAX_TOKENS))
        held = gate.wait_held("decode.prompt", ACT_S)
        assert held.request_id == stream.request_id
        _piggybacked(cluster, held.request_id)
        where = held.instance_id
        assert scraper.pages_used(where) > 0
        stream.close()
        wait_all(
            {
                f"{where} to free the prompt's pages": lambda: scraper.pages_used(where) == 0,
                "the request to end cancelled": lambda: any(
                    e.request_id == held.request_id and e.outcome == "cancelled"
                    for e in events_of(read_log(cluster), ev.RequestFinished)
                ),
            },
            ACT_S,
        )


def test_decode_death_while_prefilling_a_piggybacked_prompt_is_replanned(piggy: Piggy) -> None:
    cluster, gate = piggy.cluster, piggy.gate
    body = long_stream_body(piggy.prompt, max_tokens=MAX_TOKENS)
    with busy_prefill(piggy, seed=30):
        gate.arm("decode.prompt")
        stream = SseClient(cluster, body)
        held = gate.wait_held("decode.prompt", ACT_S)
        first = _piggybacked(cluster, held.request_id)
        assert first.decode_instance == held.instance_id
        killed_at = kill(cluster, held.instance_id)
        stream.wait_done(VERDICT_S + ACT_S)
    assert stream.completed, stream.describe()
    recovery_s = stream.ended_at - killed_at

    log = read_log(cluster)
    rid = held.request_id
    (replan,) = [e for e in events_of(log, ev.RequestReplanned) if e.request_id == rid]
    assert replan.attempt == 1 and replan.failed_instance == held.instance_id
    assert replan.generated_tokens == 0
    second = next(d for d in events_of(log, ev.Decision) if d.request_id == rid and d.attempt)
    assert isinstance(second, ev.RequestScheduled)
    assert held.instance_id not in (second.prefill_instance, second.decode_instance)
    # The same greedy tokens as the undisturbed normal path.
    text = "".join(
        choice.get("text", "")
        for frame in stream.frames
        if frame != "[DONE]"
        for choice in (json.loads(frame).get("choices") or [])
    )
    assert text == _text(piggy.baseline)
    record(
        "piggyback_decode_death",
        FaultRecord(
            fault="decode instance dies while it prefills a piggybacked prompt",
            caused_by=f"SIGKILL {held.instance_id} while the prompt is in its batch before "
            "any chunk (failpoint decode.prompt)",
            client_saw="one uninterrupted SSE stream, the normal path's greedy text, "
            f"ended {recovery_s:.2f}s after the kill",
            cleaned_up=f"the gateway logged RequestReplanned (attempt 1); the conductor "
            f"placed it on {second.prefill_instance} / {second.decode_instance}"
            f"{' (piggybacked)' if second.piggyback else ''}",
            checked_by="the client's text against the normal path's; RequestReplanned and "
            "the decisions in the log",
            recovery_s=round(recovery_s, 3),
            details={"heartbeat_timeout_s": HEARTBEAT_S},
        ),
    )


def test_the_log_replays_to_the_same_decisions(piggy: Piggy) -> None:
    logged = read_log(piggy.cluster)
    decisions = list(events_of(logged, ev.RequestScheduled))
    assert sum(d.piggyback for d in decisions) >= 3, decisions
    result = replay([LogRecord(seq=item.seq, event=item.event) for item in logged])
    assert result.divergences == []


def test_a_piggybacking_decode_instance_and_the_kvstores_connect_ahead(piggy: Piggy) -> None:
    # It fetches prefixes from the kvstores and puts blocks into them, and they send
    # it blocks: each side connects as the other is announced, not on a first request.
    # (A connect made by a request first would leave no "preconnected" line.)
    cluster = piggy.cluster
    kvstores = sorted(i for i in cluster.pids if i.startswith("kvstore-"))
    decodes = sorted(i for i in cluster.pids if i.startswith("decode-"))
    assert kvstores and decodes, cluster.pids
    pairs = [(d, k) for d in decodes for k in kvstores] + [
        (k, d) for k in kvstores for d in decodes
    ]
    wait_all(
        {
            f"{side} connected ahead to {peer}": (
                lambda side=side, peer=peer: _preconnected(cluster.instance_log(side), peer)
            )
            for side, peer in pairs
        },
        ACT_S,
    )


def _preconnected(log: str, instance_id: str) -> bool:
    """Whether an instance's log says its sender connected ahead to `instance_id`."""
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(entry, dict)
            and entry.get("event") == "preconnected"
            and entry.get("instance") == instance_id
        ):
            return True
    return False
