"""Faults under a running cluster: real processes killed, paused and restarted.

One `yb up` cluster with the tiny model and spare instances of every kind (2 prefill,
2 decode, 2 kvstore, 2 conductors), kept up when an instance dies (`--keep-going`).
The scenarios run in file order, the harmless ones first and each destructive one
taking away an instance the later ones can do without:

1. a client hangs up mid-stream, then while its prompt is being computed;
2. a decode instance is paused mid-stream past the heartbeat timeout, then resumed;
3. a kvstore is killed: in-flight reuse falls back to recompute, its blocks leave the
   index within the heartbeat timeout;
4. the prefill instance of a request is killed mid-prefill;
5. the decode instance of a request is killed mid-stream;
6. the gateway is killed mid-stream and restarted;
7. the active conductor is paused past its lease, resumed, then the new active one
   is killed: every admission still gets exactly one decision.

Each checks what the client saw, what the instances' own accounting says was freed
(`/metrics`, read from the page allocators) and what the log recorded, each within a
deadline; each writes its row of the fault table (`faults_kit.record`).
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen, TimeoutExpired

import httpx
import pytest

# The shared fault helpers live beside this file (test modules are not importable
# under --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

from faults_kit import (
    FaultRecord,
    Scraper,
    SseClient,
    command_of,
    complete,
    decision_of,
    decisions_per_admission,
    events_of,
    finished_events,
    hang_up_after_headers,
    headers,
    kill,
    long_stream_body,
    read_log,
    record,
    restart,
    signal_instance,
    wait_until,
)

from yb_shared import events as ev
from yb_shared.testing import LocalCluster

BLOCK = 64  # the default block size
HEARTBEAT_S = 4.0  # the conductor's heartbeat timeout in this cluster
LEASE_S = 2.0  # the conductor lease
# Declaring an instance dead takes the heartbeat timeout plus the next event's
# arrival; a client or an engine hears of it a moment later.
VERDICT_S = HEARTBEAT_S + 4.0


@dataclass
class Faulty:
    """The cluster under test and what the tests started beside it."""

    cluster: LocalCluster
    scraper: Scraper
    spawned: list[Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.cluster.url


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("faults"),
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "2", "--decode", "2", "--kvstore", "2", "--conductors", "2"),
        "--keep-going",
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            "YB_CONDUCTOR__LEASE_TTL_S": str(LEASE_S),
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            # No engine tier: reuse comes from the kvstores (the kvstore scenario needs
            # it), and an idle prefill instance holds no page at all.
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            # Small chunks: the tiny model computes a 3,000-token prompt in 512-token
            # chunks in about 0.1 s, quicker than a test can see decode reserve its
            # pages and kill the prefill mid-request (a run lost that race).
            "YB_PREFILL__CHUNK_SIZE": "16",
        },
    )
    cluster.start(timeout_s=300)
    faults = Faulty(cluster, Scraper(cluster))
    try:
        # Every spare instance up and counted, not just the first of each kind.
        wait_until(lambda: _alive_engines(faults) == (2, 2), 60, "every engine to be up")
        yield faults
    finally:
        for proc in faults.spawned:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except TimeoutExpired:
                proc.kill()
        cluster.stop()


def _alive_engines(faults: Faulty) -> tuple[int, int]:
    try:
        body = httpx.get(f"{faults.url}/readyz", headers=headers(faults.cluster), timeout=5).json()
    except httpx.HTTPError:
        return (0, 0)
    return len(body.get("prefill_instances", [])), len(body.get("decode_instances", []))


def _ready(faults: Faulty) -> bool:
    try:
        r = httpx.get(f"{faults.url}/readyz", headers=headers(faults.cluster), timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def _scheduled(cluster: LocalCluster, request_id: str) -> ev.RequestScheduled:
    decision = decision_of(cluster, request_id)
    assert isinstance(decision, ev.RequestScheduled), decision
    return decision


def _active_conductor(faults: Faulty, candidates: list[str]) -> str | None:
    for name in candidates:
        try:
            if faults.scraper.value(name, "yb_conductor_active") == 1:
                return name
        except httpx.HTTPError:
            continue
    return None


def _wait_declared_dead(faults: Faulty, instance_id: str, since: float) -> float:
    """Until the active conductor counts `instance_id` dead and has said so in the
    log; the seconds since `since` (a monotonic time)."""

    def declared() -> bool:
        active = _active_conductor(faults, ["conductor-0", "conductor-1"])
        key = f'yb_conductor_instance_alive{{instance="{instance_id}"}}'
        return active is not None and faults.scraper.metrics(active).get(key) == 0

    wait_until(declared, VERDICT_S - (time.monotonic() - since), f"{instance_id} declared dead")
    took = time.monotonic() - since
    downs = [
        e
        for e in events_of(read_log(faults.cluster), ev.InstanceDown)
        if e.instance_id == instance_id
    ]
    assert downs, f"no InstanceDown for {instance_id} in the log"
    return took


# --- 1. clients that leave ------------------------------------------------------------


def test_client_disconnect_mid_stream_stops_decode_and_frees_its_pages(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    client = SseClient(cluster, long_stream_body(_tokens(1, 40)))
    client.wait_text(20, 60)
    decision = _scheduled(cluster, client.request_id)
    decode = decision.decode_instance
    assert scraper.pages_used(decode) > 0

    left = time.monotonic()
    client.hang_up()
    freed_s = wait_until(lambda: scraper.pages_used(decode) == 0, 10, f"{decode} to free pages")
    assert scraper.value(decode, "yb_engine_batch_size") == 0
    # The decode instance itself says it stopped early: cancelled, far short of max.
    ends = finished_events(cluster, client.request_id)
    by_decode = [e for e in ends if isinstance(e, ev.RequestFinished) and e.instance_id == decode]
    assert by_decode, ends
    assert by_decode[0].outcome == "cancelled", by_decode
    assert by_decode[0].output_tokens < 3000
    record(
        "client_disconnect_decode",
        FaultRecord(
            fault="client disconnects mid-stream (decoding)",
            caused_by="the HTTP client closes the SSE connection after 20 token frames",
            client_saw="(the client left)",
            cleaned_up=f"{decode} aborted the request after {by_decode[0].output_tokens} of "
            "3000 tokens and freed its KV pages; RequestFinished(cancelled) logged",
            checked_by=f"{decode} /metrics yb_engine_kv_pages_used back to 0 and batch size 0",
            recovery_s=round(time.monotonic() - left, 3),
            details={"pages_freed_after_s": round(freed_s, 3)},
        ),
    )


def test_client_disconnect_during_prefill_frees_prefill_and_decode(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    # A prompt long enough that its prefill is still running when the client leaves.
    request_id = hang_up_after_headers(cluster, long_stream_body(_tokens(2, 3000), 8))
    left = time.monotonic()
    decision = _scheduled(cluster, request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    wait_until(
        lambda: scraper.pages_used(prefill) == 0 and scraper.pages_used(decode) == 0,
        30,
        f"{prefill} and {decode} to free the request's pages",
    )
    freed_s = time.monotonic() - left
    ends = finished_events(cluster, request_id)
    assert any(isinstance(e, ev.RequestCancelled) for e in ends), ends
    progress = [
        e for e in events_of(read_log(cluster), ev.RequestProgress) if e.request_id == request_id
    ]
    # Decode never started it: the hang-up came during the prefill.
    assert not [p for p in progress if p.stage == "kv_committed"], progress
    outcome = [e for e in ends if isinstance(e, ev.RequestFinished)]
    record(
        "client_disconnect_prefill",
        FaultRecord(
            fault="client disconnects while its prompt is computed",
            caused_by="a raw HTTP client sends a 3000-token prompt, reads the response head "
            "and closes the socket",
            client_saw="(the client left)",
            cleaned_up=f"gateway logged RequestCancelled; {decode} dropped its reservation, "
            f"{prefill} ended the job ({[(e.instance_id, e.outcome) for e in outcome]}) and "
            "freed its pages; decode never started it",
            checked_by=f"{prefill} and {decode} /metrics yb_engine_kv_pages_used back to 0",
            recovery_s=round(freed_s, 3),
        ),
    )


# --- 2. an engine pauses past the heartbeat timeout -----------------------------------


def test_a_paused_decode_is_declared_dead_then_rejoins(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    client = SseClient(cluster, long_stream_body(_tokens(12, 40)))
    client.wait_text(20, 60)
    decode = _scheduled(cluster, client.request_id).decode_instance
    paused = time.monotonic()
    signal_instance(cluster, decode, signal.SIGSTOP)
    try:
        # Silent past the heartbeat timeout: dead, as far as anyone can tell.
        client.wait_done(VERDICT_S + 5)
        ended_s = client.ended_at - paused
        assert client.ended_cleanly_with_error, client.describe()
        assert decode in client.error_message(), client.error_message()
        verdict_s = _wait_declared_dead(faulty, decode, paused)
    finally:
        signal_instance(cluster, decode, signal.SIGCONT)
    resumed = time.monotonic()
    # Resumed, it obeys the cancel it slept through and frees the request ...
    wait_until(lambda: scraper.pages_used(decode) == 0, 10, f"{decode} to free pages")
    freed_s = time.monotonic() - resumed
    ends = finished_events(cluster, client.request_id)
    assert any(isinstance(e, ev.RequestCancelled) for e in ends), ends

    # ... and, seeing itself declared dead, announces itself again: back in service.
    def rejoined() -> bool:
        active = _active_conductor(faulty, ["conductor-0", "conductor-1"])
        key = f'yb_conductor_instance_alive{{instance="{decode}"}}'
        return (
            _alive_engines(faulty)[1] == 2
            and active is not None
            and scraper.metrics(active).get(key) == 1
        )

    wait_until(rejoined, 15, f"{decode} to rejoin")
    back_s = time.monotonic() - resumed
    record(
        "decode_paused",
        FaultRecord(
            fault="decode instance paused mid-stream past the heartbeat timeout, then resumed",
            caused_by=f"SIGSTOP {decode} after 20 streamed token frames; SIGCONT after the "
            "conductor declared it dead",
            client_saw=f"SSE error event then [DONE] after {ended_s:.2f}s: "
            f"{client.error_message()!r}",
            cleaned_up=f"{decode} declared dead after {verdict_s:.2f}s and the request "
            f"cancelled; resumed, {decode} aborted it and freed its pages "
            f"({freed_s:.2f}s), re-announced itself and rejoined ({back_s:.2f}s)",
            checked_by=f"{decode} /metrics pages used = 0; conductor "
            "yb_conductor_instance_alive 0 then 1; gateway /readyz lists it again",
            recovery_s=round(ended_s, 3),
            details={
                "declared_dead_after_s": round(verdict_s, 3),
                "resume_to_rejoined_s": round(back_s, 3),
            },
        ),
    )


# --- 3. a kvstore dies ----------------------------------------------------------------


def test_kvstore_death_falls_back_to_recompute_and_leaves_the_index(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    prompt = [*_tokens(3, 6 * BLOCK), 1, 2, 3]
    first = complete(cluster, prompt)
    computed_on = _scheduled(cluster, first["id"]).prefill_instance
    store = "kvstore-" + computed_on.rsplit("-", 1)[1]  # the kvstore on its host
    conductor = _active_conductor(faulty, ["conductor-0", "conductor-1"])
    assert conductor is not None
    index_key = f'yb_conductor_index_blocks{{instance="{store}"}}'
    # The blocks reach the store off the request's path: wait until the index has them.
    wait_until(lambda: scraper.value(conductor, index_key) >= 6, 30, f"{store} to be indexed")

    killed = kill(cluster, store)
    # In flight: planned from the store that is gone (the conductor cannot know yet);
    # the prefetch fails, the prompt is recomputed, and the answer is the same.
    started = time.monotonic()
    fallback = complete(cluster, prompt)
    fallback_s = time.monotonic() - started
    planned = _scheduled(cluster, fallback["id"])
    assert store in {r.source_instance for r in planned.reuse}, planned.reuse
    assert fallback["choices"][0]["text"] == first["choices"][0]["text"]
    assert fallback["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0

    # Within the heartbeat timeout the conductor drops it and everything it held.
    def dropped() -> bool:
        m = scraper.metrics(conductor)
        return (
            m.get(f'yb_conductor_instance_alive{{instance="{store}"}}') == 0
            and m.get(index_key) == 0
        )

    wait_until(dropped, VERDICT_S, f"the conductor to drop {store}")
    dropped_s = time.monotonic() - killed
    downs = [e for e in events_of(read_log(cluster), ev.InstanceDown) if e.instance_id == store]
    assert downs, f"no InstanceDown for {store} in the log"
    after = complete(cluster, prompt)
    replanned = _scheduled(cluster, after["id"])
    assert store not in {r.source_instance for r in replanned.reuse}, replanned.reuse
    assert after["choices"][0]["text"] == first["choices"][0]["text"]
    record(
        "kvstore_death",
        FaultRecord(
            fault="kvstore dies",
            caused_by=f"SIGKILL {store}, which held a 6-block prefix",
            client_saw="200 with the same answer: the request planned to reuse the prefix "
            f"from {store} recomputed it ({fallback_s:.2f}s), cached_tokens 0",
            cleaned_up=f"the conductor declared {store} dead (InstanceDown: "
            f"{downs[0].reason!r}), its blocks left the index, later plans avoid it",
            checked_by="conductor /metrics yb_conductor_instance_alive and "
            "yb_conductor_index_blocks for the store; decisions' reuse plans in the log",
            recovery_s=round(dropped_s, 3),
            details={"fallback_request_s": round(fallback_s, 3)},
        ),
    )


# --- 4. a prefill instance dies mid-request -------------------------------------------


def test_prefill_death_mid_request_ends_it_cleanly_and_frees_the_reservation(
    faulty: Faulty,
) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    client = SseClient(cluster, long_stream_body(_tokens(4, 3000), 8))
    assert client.started.wait(60) and client.status == 200, client.describe()
    decision = _scheduled(cluster, client.request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    # Mid-request: decode has reserved the prompt's pages and prefill is computing.
    wait_until(lambda: scraper.pages_used(decode) > 0, 30, f"{decode} to reserve pages")
    killed = kill(cluster, prefill)
    progress = [
        e.stage
        for e in events_of(read_log(cluster), ev.RequestProgress)
        if e.request_id == client.request_id
    ]
    assert "prefill_done" not in progress, f"the kill came too late: {progress}"

    client.wait_done(VERDICT_S + 5)
    ended_s = client.ended_at - killed
    assert client.ended_cleanly_with_error, client.describe()
    assert prefill in client.error_message(), client.error_message()
    freed_s = wait_until(
        lambda: scraper.pages_used(decode) == 0, VERDICT_S, f"{decode} to drop the reservation"
    )
    ends = finished_events(cluster, client.request_id)
    assert ends, "nothing in the log ended the request"
    # Within the heartbeat timeout the conductor declares it dead (until then a
    # request placed there is refused at once: 503, no engine answered the job) ...
    verdict_s = _wait_declared_dead(faulty, prefill, killed)
    # ... and the next request is placed on the prefill instance left.
    after = complete(cluster, _tokens(5, 40))
    assert _scheduled(cluster, after["id"]).prefill_instance != prefill
    record(
        "prefill_death",
        FaultRecord(
            fault="prefill instance dies mid-request",
            caused_by=f"SIGKILL {prefill} while it computed a 3000-token prompt whose pages "
            f"{decode} had reserved",
            client_saw=f"SSE error event then [DONE] after {ended_s:.2f}s: "
            f"{client.error_message()!r}",
            cleaned_up=f"{decode} freed the reservation; the log ended the request "
            f"({sorted({type(e).__name__ for e in ends})}); the next request went to the "
            "other prefill instance",
            checked_by=f"{decode} /metrics yb_engine_kv_pages_used back to 0",
            recovery_s=round(ended_s, 3),
            details={
                "decode_pages_freed_after_s": round(freed_s + ended_s, 3),
                "declared_dead_after_s": round(verdict_s, 3),
            },
        ),
    )


# --- 5. a decode instance dies mid-stream ---------------------------------------------


def test_decode_death_mid_stream_ends_the_stream_cleanly(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    client = SseClient(cluster, long_stream_body(_tokens(6, 40)))
    client.wait_text(20, 60)
    decision = _scheduled(cluster, client.request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    killed = kill(cluster, decode)

    client.wait_done(VERDICT_S + 5)
    ended_s = client.ended_at - killed
    assert client.ended_cleanly_with_error, client.describe()
    assert decode in client.error_message(), client.error_message()
    # The prefill side holds nothing for it (its KV went to decode long ago).
    assert scraper.held_for_requests(prefill) == 0
    downs = [e for e in events_of(read_log(cluster), ev.InstanceDown) if e.instance_id == decode]
    assert downs, f"no InstanceDown for {decode}"
    ends = finished_events(cluster, client.request_id)
    assert any(isinstance(e, ev.RequestCancelled) for e in ends), ends
    after = complete(cluster, _tokens(7, 40))
    assert _scheduled(cluster, after["id"]).decode_instance != decode
    record(
        "decode_death",
        FaultRecord(
            fault="decode instance dies mid-stream",
            caused_by=f"SIGKILL {decode} after 20 streamed token frames",
            client_saw=f"SSE error event then [DONE] after {ended_s:.2f}s: "
            f"{client.error_message()!r}",
            cleaned_up=f"{decode} declared dead (InstanceDown {downs[0].reason!r}); the "
            f"request cancelled in the log; {prefill} holds no page for it; the next "
            "request went to the other decode instance",
            checked_by=f"{prefill} /metrics pages used = 0; InstanceDown and "
            "RequestCancelled in the log",
            recovery_s=round(ended_s, 3),
        ),
    )


# --- 6. the gateway restarts ----------------------------------------------------------


def test_gateway_restart_cancels_its_orphaned_requests(faulty: Faulty) -> None:
    cluster, scraper = faulty.cluster, faulty.scraper
    client = SseClient(cluster, long_stream_body(_tokens(8, 40)))
    client.wait_text(20, 60)
    decode = _scheduled(cluster, client.request_id).decode_instance
    command = command_of(cluster.pids["gateway-0"])

    killed = kill(cluster, "gateway-0")
    client.wait_done(10)
    assert client.failure is not None, "the client should have lost its connection"
    faulty.spawned.append(restart(command, cluster.data_dir / "logs" / "gateway-0.log"))
    # Nobody will read those tokens: decode stops and frees the request's pages.
    wait_until(lambda: scraper.pages_used(decode) == 0, VERDICT_S + 10, f"{decode} to free pages")
    freed_s = time.monotonic() - killed
    ends = finished_events(cluster, client.request_id)
    cancels = [e for e in ends if isinstance(e, ev.RequestCancelled)]
    assert cancels, ends
    stopped = [e for e in ends if isinstance(e, ev.RequestFinished) and e.instance_id == decode]
    assert stopped and stopped[0].outcome == "cancelled", ends
    wait_until(lambda: _ready(faulty), 60, "the restarted gateway to be ready")
    ready_s = time.monotonic() - killed
    complete(cluster, _tokens(9, 40))
    record(
        "gateway_restart",
        FaultRecord(
            fault="gateway restarts",
            caused_by="SIGKILL gateway-0 during a 3000-token stream, then start it again "
            "with the same command and environment",
            client_saw=f"its connection broken ({type(client.failure).__name__})",
            cleaned_up=f"the conductor cancelled the old gateway's request "
            f"({cancels[0].reason!r}); {decode} stopped after "
            f"{stopped[0].output_tokens} tokens and freed its pages",
            checked_by=f"{decode} /metrics yb_engine_kv_pages_used back to 0; "
            "RequestCancelled and RequestFinished(cancelled) in the log",
            recovery_s=round(freed_s, 3),
            details={"kill_to_restarted_gateway_ready_s": round(ready_s, 3)},
        ),
    )


# --- 7. the active conductor dies -----------------------------------------------------


class _Traffic:
    """Short completions back to back on a thread, recording each outcome."""

    def __init__(self, faults: Faulty) -> None:
        self._faults = faults
        self.outcomes: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                r = httpx.post(
                    f"{self._faults.url}/v1/completions",
                    json={"model": "tiny", "prompt": _tokens(100 + n, 30), "max_tokens": 2},
                    headers=headers(self._faults.cluster),
                    timeout=60,
                )
                self.outcomes.append((r.headers.get("x-request-id", ""), r.status_code))
            except httpx.HTTPError as exc:
                self.outcomes.append((repr(exc), 0))

    def stop(self) -> list[tuple[str, int]]:
        self._stop.set()
        self._thread.join(90)
        assert not self._thread.is_alive(), "a request hung"
        return self.outcomes


def test_conductor_failover_gives_every_admission_exactly_one_decision(faulty: Faulty) -> None:
    cluster = faulty.cluster
    conductors = ["conductor-0", "conductor-1"]
    first = _active_conductor(faulty, conductors)
    assert first is not None
    (second,) = [c for c in conductors if c != first]
    traffic = _Traffic(faulty)
    wait_until(lambda: len(traffic.outcomes) >= 3, 30, "traffic to flow")

    # A pause longer than the lease: the standby takes over; the old one, resumed,
    # must stand down rather than decide alongside it.
    paused = time.monotonic()
    signal_instance(cluster, first, signal.SIGSTOP)
    try:
        takeover_s = wait_until(
            lambda: _active_conductor(faulty, [second]) == second, 30, f"{second} to take over"
        )
        n = len(traffic.outcomes)
        wait_until(lambda: len(traffic.outcomes) >= n + 3, 30, "traffic under the new leader")
    finally:
        signal_instance(cluster, first, signal.SIGCONT)
    wait_until(lambda: _active_conductor(faulty, [first]) is None, 10, f"{first} to stand down")
    pause_s = time.monotonic() - paused

    # Then the active one dies outright: the resumed one takes over again.
    killed = kill(cluster, second)
    again_s = wait_until(
        lambda: _active_conductor(faulty, [first]) == first, 30, f"{first} to take over"
    )
    n = len(traffic.outcomes)
    wait_until(lambda: len(traffic.outcomes) >= n + 3, 30, "traffic after the failover")
    outcomes = traffic.stop()
    failover_s = time.monotonic() - killed

    assert all(status == 200 for _, status in outcomes), outcomes
    decisions = decisions_per_admission(read_log(cluster))
    wrong = {rid: d for rid, d in decisions.items() if len(d) != 1}
    assert not wrong, f"requests without exactly one decision: {wrong}"
    admitted = list(decisions)
    assert {rid for rid, _ in outcomes} <= set(admitted)
    record(
        "conductor_failover",
        FaultRecord(
            fault="active conductor paused past its lease, resumed; then the new active "
            "conductor dies",
            caused_by=f"SIGSTOP {first} ({LEASE_S:g}s lease), SIGCONT it; SIGKILL {second}",
            client_saw=f"all {len(outcomes)} requests sent meanwhile answered 200 "
            "(decisions delayed by the takeover)",
            cleaned_up=f"{second} took over in {takeover_s:.2f}s, {first} stood down when "
            f"resumed, then took over again {again_s:.2f}s after {second} was killed",
            checked_by=f"yb_conductor_active on both; the log: each of {len(admitted)} "
            "RequestAdmitted has exactly one RequestScheduled/RequestRejected",
            recovery_s=round(max(takeover_s, again_s), 3),
            details={
                "pause_to_standing_down_s": round(pause_s, 3),
                "kill_to_traffic_resumed_s": round(failover_s, 3),
            },
        ),
    )
