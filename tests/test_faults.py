"""Faults under a running cluster: real processes killed, paused and restarted.

One `yb up` cluster with the tiny model and spare instances of every kind (2 prefill,
2 decode, 2 kvstore, 2 conductors), kept up when an instance dies (`--keep-going`).
Its gateway re-plans nothing (`gateway.replan_budget` 0): these scenarios check the
clean error a client gets past its re-plan budget; `tests/test_replan.py` checks the
streams that survive their engines.
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
deadline; each writes its row of the fault table (`yb_testkit.faults.record`).

Every outcome holds by construction, not by the machine's speed: a request that must
be in flight when something breaks is parked at a failpoint the scenario armed for it
alone (`yb_core.failpoints`, `yb_testkit.faults.Gate`: a stream after its 20th token, a
prompt between its chunks, a job before its prefix load), and the fault strikes once
its marker says it is there; streams use `ignore_eos`; conditions that settle one
after another (pages, then the batch gauge, then the event) are awaited together;
every wait has its own full deadline; and each scenario starts from a cluster the
`healthy` fixture verified (every instance expected up, /readyz, an active
conductor, no page held), so one failure cannot fail the next scenario.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen, TimeoutExpired

import httpx
import pytest

# The shared fault helpers live beside this file (test modules are not importable
# under --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

from yb_core import events as ev
from yb_testkit.faults import (
    FaultRecord,
    Gate,
    RawStream,
    Scraper,
    SseClient,
    command_of,
    complete,
    decision_of,
    decisions_per_admission,
    events_of,
    finished_events,
    headers,
    kill,
    long_stream_body,
    read_log,
    record,
    restart,
    signal_instance,
    tiny_prompt,
    wait_all,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster, pid_alive

BLOCK = 64  # the default block size
HEARTBEAT_S = 4.0  # the conductor's heartbeat timeout in this cluster
LEASE_S = 2.0  # the conductor lease
HOLD_TOKENS = 20  # a gated stream parks after this many tokens (failpoint decode.token)
# Budgets, each wait its own (never what is left of another's). They are upper
# bounds, not expectations: a verdict takes the heartbeat timeout plus the next
# event, a takeover the lease plus an election; the margin is for a loaded machine.
VERDICT_S = 30.0
TAKEOVER_S = 30.0
READY_S = 90.0
ACT_S = 60.0  # a request to reach a gate, a stream to end, pages to be freed

pytestmark = [
    # The cluster's start-up (the module fixture, with its own deadline) does not
    # count against a scenario's timeout.
    pytest.mark.timeout(300, func_only=True),
]


@dataclass
class Faulty:
    """The cluster under test, what the tests started beside it, and what they broke
    for good (the instances the next scenarios must do without)."""

    cluster: LocalCluster
    scraper: Scraper
    gate: Gate
    spawned: list[Popen[bytes]] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.cluster.url

    def expected(self, role: str) -> list[str]:
        """The instances of a role that should be up now."""
        return [i for i in self.cluster.pids if i.startswith(role) and i not in self.gone]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    root = tmp_path_factory.mktemp("faults")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "2", "--decode", "2", "--kvstore", "2", "--conductors", "2"),
        "--keep-going",
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            "YB_CONDUCTOR__LEASE_TTL_S": str(LEASE_S),
            # Room in decode for several long streams at once (the tiny model's longest
            # sequence is 4,096 tokens; one is the laptop default).
            "YB_DECODE__KV_SEQUENCES": "8",
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            # No engine tier: reuse comes from the kvstores (the kvstore scenario needs
            # it), and an idle prefill instance holds no page at all.
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            # A failed engine ends its requests with an error (see the docstring).
            "YB_GATEWAY__REPLAN_BUDGET": "0",
            # Gates a scenario arms for one request of its own (`Gate.arm`); nothing
            # else ever parks. A prompt of more than one chunk (512) parks after its
            # first chunk; a stream after its 20th token.
            "YB_FAILPOINTS": gate.spec(
                f"decode.token=hold({HOLD_TOKENS})", "prefill.chunk=hold(1)", "prefill.load=hold"
            ),
        },
    )
    cluster.start(timeout_s=300)
    faults = Faulty(cluster, Scraper(cluster), gate)
    try:
        yield faults
    finally:
        gate.release_everything()
        for proc in faults.spawned:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except TimeoutExpired:
                proc.kill()
        cluster.stop()


@pytest.fixture(autouse=True)
def healthy(faulty: Faulty) -> Iterator[None]:
    """Each scenario starts from a cluster verified healthy, and leaves nothing parked.

    Healthy: every instance not broken for good is alive, the gateway is ready and
    lists exactly the engines expected, one conductor is active, and no engine holds
    a page for a request. So a scenario that failed cannot fail the next one for it.
    """
    _wait_healthy(faulty)
    try:
        yield
    finally:
        faulty.gate.release_everything()


def _wait_healthy(faults: Faulty) -> None:
    cluster, scraper = faults.cluster, faults.scraper
    prefill, decode = faults.expected("prefill"), faults.expected("decode")
    conductors = faults.expected("conductor")

    def engines_idle() -> bool:
        return all(scraper.held_for_requests(i) == 0 for i in prefill + decode)

    wait_all(
        {
            "every instance alive": lambda: all(
                pid_alive(pid) for i, pid in cluster.pids.items() if i not in faults.gone
            ),
            f"/readyz listing {len(prefill)} prefill and {len(decode)} decode": lambda: (
                _alive_engines(faults) == (len(prefill), len(decode))
            ),
            "an active conductor": lambda: _active_conductor(faults, conductors) is not None,
            "engines holding no request's pages": engines_idle,
        },
        READY_S,
    )


def _alive_engines(faults: Faulty) -> tuple[int, int] | None:
    """How many prefill and decode instances a ready gateway lists (None: not ready)."""
    try:
        r = httpx.get(f"{faults.url}/readyz", headers=headers(faults.cluster), timeout=5)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    body = r.json()
    return len(body.get("prefill_instances", [])), len(body.get("decode_instances", []))


def _scheduled(cluster: LocalCluster, request_id: str) -> ev.RequestScheduled:
    decision = decision_of(cluster, request_id, timeout_s=ACT_S)
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
    """Until the active conductor counts `instance_id` dead and the log holds its
    `InstanceDown`; the seconds since `since` (a monotonic time)."""
    conductors = faults.expected("conductor")

    def declared() -> bool:
        active = _active_conductor(faults, conductors)
        key = f'yb_conductor_instance_alive{{instance="{instance_id}"}}'
        return active is not None and faults.scraper.metrics(active).get(key) == 0

    def logged() -> bool:
        return any(
            e.instance_id == instance_id
            for e in events_of(read_log(faults.cluster), ev.InstanceDown)
        )

    wait_all({f"{instance_id} declared dead": declared, "its InstanceDown": logged}, VERDICT_S)
    return time.monotonic() - since


def _ended_by(cluster: LocalCluster, request_id: str, kind: type, **fields: object) -> bool:
    """Whether the log holds an event of `kind` ending the request, with `fields`."""
    return any(
        isinstance(e, kind) and all(getattr(e, k) == v for k, v in fields.items())
        for e in finished_events(cluster, request_id)
    )


# --- 1. clients that leave ------------------------------------------------------------


def test_client_disconnect_mid_stream_stops_decode_and_frees_its_pages(faulty: Faulty) -> None:
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("decode.token")
    stream = RawStream(cluster, long_stream_body(tiny_prompt(1, 40)))
    held = gate.wait_held("decode.token", ACT_S)
    assert held.request_id == stream.request_id, held
    decode = held.instance_id
    assert _scheduled(cluster, held.request_id).decode_instance == decode
    # Parked after its 20th token: in the batch, its pages held, by construction.
    assert scraper.pages_used(decode) > 0

    left = time.monotonic()
    stream.close()
    freed_s = wait_all(
        {
            f"{decode} to free pages": lambda: scraper.pages_used(decode) == 0,
            f"{decode} batch size 0": lambda: scraper.value(decode, "yb_engine_batch_size") == 0,
            f"RequestFinished(cancelled) from {decode}": lambda: _ended_by(
                cluster, held.request_id, ev.RequestFinished, instance_id=decode
            ),
        },
        ACT_S,
    )
    ends = finished_events(cluster, held.request_id)
    by_decode = [e for e in ends if isinstance(e, ev.RequestFinished) and e.instance_id == decode]
    # The decode instance itself says it stopped early: cancelled where it was held.
    assert by_decode[0].outcome == "cancelled", by_decode
    assert by_decode[0].output_tokens == HOLD_TOKENS, by_decode
    record(
        "client_disconnect_decode",
        FaultRecord(
            fault="client disconnects mid-stream (decoding)",
            caused_by=f"the HTTP client closes the SSE connection while the stream is "
            f"parked after {HOLD_TOKENS} of 3000 tokens (failpoint decode.token)",
            client_saw="(the client left)",
            cleaned_up=f"{decode} aborted the request after {by_decode[0].output_tokens} of "
            "3000 tokens and freed its KV pages; RequestFinished(cancelled) logged",
            checked_by=f"{decode} /metrics yb_engine_kv_pages_used back to 0 and batch size 0",
            recovery_s=round(time.monotonic() - left, 3),
            details={"pages_freed_after_s": round(freed_s, 3)},
        ),
    )


def test_client_disconnect_during_prefill_frees_prefill_and_decode(faulty: Faulty) -> None:
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("prefill.chunk")
    stream = RawStream(cluster, long_stream_body(tiny_prompt(2, 3000), 8))
    # Parked before its second chunk: decode has reserved the prompt's pages and is
    # receiving the first chunk's KV; the transfer cannot be committed yet.
    held = gate.wait_held("prefill.chunk", ACT_S)
    assert held.request_id == stream.request_id, held
    decision = _scheduled(cluster, held.request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert prefill == held.instance_id
    assert scraper.pages_used(decode) > 0 and scraper.pages_used(prefill) > 0

    left = time.monotonic()
    stream.close()
    freed_s = wait_all(
        {
            f"{prefill} and {decode} to free the request's pages": lambda: (
                scraper.pages_used(prefill) == 0 and scraper.pages_used(decode) == 0
            ),
            "RequestCancelled": lambda: _ended_by(cluster, held.request_id, ev.RequestCancelled),
            f"RequestFinished from {prefill}": lambda: _ended_by(
                cluster, held.request_id, ev.RequestFinished, instance_id=prefill
            ),
        },
        ACT_S,
    )
    ends = finished_events(cluster, held.request_id)
    progress = [
        e
        for e in events_of(read_log(cluster), ev.RequestProgress)
        if e.request_id == held.request_id
    ]
    # Decode never started it: the hang-up came during the prefill.
    assert not [p for p in progress if p.stage == "kv_committed"], progress
    outcome = [e for e in ends if isinstance(e, ev.RequestFinished)]
    # The job left its hold for the cancel, before any transfer could fail.
    assert [e.outcome for e in outcome if e.instance_id == prefill] == ["cancelled"], outcome
    record(
        "client_disconnect_prefill",
        FaultRecord(
            fault="client disconnects while its prompt is computed",
            caused_by="a raw HTTP client sends a 3000-token prompt, reads the response head "
            "and closes the socket while prefill is parked after its first 512-token chunk "
            "(failpoint prefill.chunk)",
            client_saw="(the client left)",
            cleaned_up=f"gateway logged RequestCancelled; {decode} dropped its reservation, "
            f"{prefill} ended the job ({[(e.instance_id, e.outcome) for e in outcome]}) and "
            "freed its pages; decode never started it",
            checked_by=f"{prefill} and {decode} /metrics yb_engine_kv_pages_used back to 0",
            recovery_s=round(time.monotonic() - left, 3),
            details={"pages_freed_after_s": round(freed_s, 3)},
        ),
    )


# --- 2. an engine pauses past the heartbeat timeout -----------------------------------


def test_a_paused_decode_is_declared_dead_then_rejoins(faulty: Faulty) -> None:
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("decode.token")
    client = SseClient(cluster, long_stream_body(tiny_prompt(12, 40)))
    held = gate.wait_held("decode.token", ACT_S)
    decode = held.instance_id
    assert _scheduled(cluster, held.request_id).decode_instance == decode
    paused = time.monotonic()
    signal_instance(cluster, decode, signal.SIGSTOP)
    try:
        # Silent past the heartbeat timeout: dead, as far as anyone can tell.
        client.wait_done(VERDICT_S + ACT_S)
        ended_s = client.ended_at - paused
        assert client.ended_cleanly_with_error, client.describe()
        assert decode in client.error_message(), client.error_message()
        verdict_s = _wait_declared_dead(faulty, decode, paused)
    finally:
        signal_instance(cluster, decode, signal.SIGCONT)
    resumed = time.monotonic()

    # Resumed, it obeys the cancel it slept through and frees the request, and,
    # seeing itself declared dead, announces itself again: back in service.
    def rejoined() -> bool:
        active = _active_conductor(faulty, faulty.expected("conductor"))
        key = f'yb_conductor_instance_alive{{instance="{decode}"}}'
        return (
            _alive_engines(faulty) == (len(faulty.expected("prefill")), 2)
            and active is not None
            and scraper.metrics(active).get(key) == 1
        )

    freed_s = wait_until(lambda: scraper.pages_used(decode) == 0, ACT_S, f"{decode} to free")
    wait_all(
        {
            f"{decode} to rejoin": rejoined,
            "RequestCancelled": lambda: _ended_by(cluster, held.request_id, ev.RequestCancelled),
        },
        READY_S,
    )
    back_s = time.monotonic() - resumed
    record(
        "decode_paused",
        FaultRecord(
            fault="decode instance paused mid-stream past the heartbeat timeout, then resumed",
            caused_by=f"SIGSTOP {decode} while the stream is parked after {HOLD_TOKENS} "
            "tokens (failpoint decode.token); SIGCONT after the conductor declared it dead",
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
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    prompt = [*tiny_prompt(3, 6 * BLOCK), 1, 2, 3]
    first = complete(cluster, prompt)
    computed_on = _scheduled(cluster, first["id"]).prefill_instance
    store = "kvstore-" + computed_on.rsplit("-", 1)[1]  # the kvstore on its host
    conductor = _active_conductor(faulty, faulty.expected("conductor"))
    assert conductor is not None
    index_key = f'yb_conductor_index_blocks{{instance="{store}"}}'
    # The blocks reach the store off the request's path: wait until the index has them.
    wait_until(lambda: scraper.value(conductor, index_key) >= 6, ACT_S, f"{store} indexed")

    # In flight: planned (and parked before its prefix load) while the store lived;
    # then the store dies, the prefetch fails, the prompt is recomputed, and the
    # answer is the same.
    gate.arm("prefill.load")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, cluster, prompt)
        held = gate.wait_held("prefill.load", ACT_S)
        planned = _scheduled(cluster, held.request_id)
        assert store in {r.source_instance for r in planned.reuse}, planned.reuse
        killed = kill(cluster, store)
        faulty.gone.add(store)
        started = time.monotonic()
        gate.release(held)
        fallback = pending.result(timeout=ACT_S)
    fallback_s = time.monotonic() - started
    assert fallback["id"] == held.request_id
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
            caused_by=f"SIGKILL {store}, which held a 6-block prefix, while a request "
            "planned to reuse it is parked before its prefix load (failpoint prefill.load)",
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
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("prefill.chunk")
    client = SseClient(cluster, long_stream_body(tiny_prompt(4, 3000), 8))
    # Mid-request by construction: parked before its second chunk, with decode's
    # reservation made and the first chunk's KV on its way.
    held = gate.wait_held("prefill.chunk", ACT_S)
    decision = _scheduled(cluster, held.request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert prefill == held.instance_id
    assert scraper.pages_used(decode) > 0
    killed = kill(cluster, prefill)
    faulty.gone.add(prefill)

    client.wait_done(VERDICT_S + ACT_S)
    ended_s = client.ended_at - killed
    assert client.ended_cleanly_with_error, client.describe()
    assert prefill in client.error_message(), client.error_message()
    freed_s = wait_all(
        {
            f"{decode} to drop the reservation": lambda: scraper.pages_used(decode) == 0,
            "an end of the request in the log": lambda: bool(
                finished_events(cluster, held.request_id)
            ),
        },
        VERDICT_S,
    )
    ends = finished_events(cluster, held.request_id)
    progress = [
        e.stage
        for e in events_of(read_log(cluster), ev.RequestProgress)
        if e.request_id == held.request_id
    ]
    assert "prefill_done" not in progress, progress
    # The conductor declares it dead (until then a request placed there is refused
    # at once: 503, no engine answered the job) ...
    verdict_s = _wait_declared_dead(faulty, prefill, killed)
    # ... and the next request is placed on the prefill instance left.
    after = complete(cluster, tiny_prompt(5, 40))
    assert _scheduled(cluster, after["id"]).prefill_instance != prefill
    record(
        "prefill_death",
        FaultRecord(
            fault="prefill instance dies mid-request",
            caused_by=f"SIGKILL {prefill} while it is parked between chunks of a 3000-token "
            f"prompt (failpoint prefill.chunk) whose pages {decode} had reserved",
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
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("decode.token")
    client = SseClient(cluster, long_stream_body(tiny_prompt(6, 40)))
    held = gate.wait_held("decode.token", ACT_S)
    decision = _scheduled(cluster, held.request_id)
    prefill, decode = decision.prefill_instance, decision.decode_instance
    assert decode == held.instance_id
    killed = kill(cluster, decode)
    faulty.gone.add(decode)

    client.wait_done(VERDICT_S + ACT_S)
    ended_s = client.ended_at - killed
    assert client.ended_cleanly_with_error, client.describe()
    assert decode in client.error_message(), client.error_message()
    # The prefill side holds nothing for it (its KV went to decode long ago).
    assert scraper.held_for_requests(prefill) == 0
    wait_all(
        {
            f"InstanceDown for {decode}": lambda: any(
                e.instance_id == decode for e in events_of(read_log(cluster), ev.InstanceDown)
            ),
            "RequestCancelled": lambda: _ended_by(cluster, held.request_id, ev.RequestCancelled),
        },
        VERDICT_S,
    )
    downs = [e for e in events_of(read_log(cluster), ev.InstanceDown) if e.instance_id == decode]
    after = complete(cluster, tiny_prompt(7, 40))
    assert _scheduled(cluster, after["id"]).decode_instance != decode
    record(
        "decode_death",
        FaultRecord(
            fault="decode instance dies mid-stream",
            caused_by=f"SIGKILL {decode} while the stream is parked after {HOLD_TOKENS} "
            "tokens (failpoint decode.token)",
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
    cluster, scraper, gate = faulty.cluster, faulty.scraper, faulty.gate
    gate.arm("decode.token")
    client = SseClient(cluster, long_stream_body(tiny_prompt(8, 40)))
    # Parked after its 20th of 3000 tokens: still running when the gateway dies.
    held = gate.wait_held("decode.token", ACT_S)
    decode = held.instance_id
    command = command_of(cluster.pids["gateway-0"])

    killed = kill(cluster, "gateway-0")
    client.wait_done(ACT_S)
    assert client.failure is not None, "the client should have lost its connection"
    proc = restart(command, cluster.data_dir / "logs" / "gateway-0.log")
    faulty.spawned.append(proc)
    cluster.pids["gateway-0"] = proc.pid
    # Nobody will read those tokens: decode stops and frees the request's pages.
    wait_all(
        {
            f"{decode} to free pages": lambda: scraper.pages_used(decode) == 0,
            "RequestCancelled": lambda: _ended_by(cluster, held.request_id, ev.RequestCancelled),
            f"RequestFinished(cancelled) from {decode}": lambda: _ended_by(
                cluster, held.request_id, ev.RequestFinished, instance_id=decode
            ),
        },
        VERDICT_S + ACT_S,
    )
    freed_at = time.monotonic() - killed
    ends = finished_events(cluster, held.request_id)
    cancels = [e for e in ends if isinstance(e, ev.RequestCancelled)]
    stopped = [e for e in ends if isinstance(e, ev.RequestFinished) and e.instance_id == decode]
    assert stopped[0].outcome == "cancelled", ends
    assert stopped[0].output_tokens == HOLD_TOKENS, stopped
    wait_until(lambda: _alive_engines(faulty) is not None, READY_S, "the new gateway ready")
    ready_s = time.monotonic() - killed
    complete(cluster, tiny_prompt(9, 40))
    record(
        "gateway_restart",
        FaultRecord(
            fault="gateway restarts",
            caused_by="SIGKILL gateway-0 while a 3000-token stream is parked after "
            f"{HOLD_TOKENS} tokens (failpoint decode.token), then start it again with the "
            "same command and environment",
            client_saw=f"its connection broken ({type(client.failure).__name__})",
            cleaned_up=f"the conductor cancelled the old gateway's request "
            f"({cancels[0].reason!r}); {decode} stopped after "
            f"{stopped[0].output_tokens} tokens and freed its pages",
            checked_by=f"{decode} /metrics yb_engine_kv_pages_used back to 0; "
            "RequestCancelled and RequestFinished(cancelled) in the log",
            recovery_s=round(freed_at, 3),
            details={"kill_to_restarted_gateway_ready_s": round(ready_s, 3)},
        ),
    )


# --- 7. the active conductor dies -----------------------------------------------------


class _Traffic:
    """Short completions back to back on a thread, recording each outcome with the
    phase it was sent in (`mark` starts a new phase)."""

    def __init__(self, faults: Faulty) -> None:
        self._faults = faults
        self.phase = "before"
        self.outcomes: list[tuple[str, str, int]] = []  # (phase, request id, status)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            phase = self.phase
            try:
                r = httpx.post(
                    f"{self._faults.url}/v1/completions",
                    json={"model": "tiny", "prompt": tiny_prompt(100 + n, 30), "max_tokens": 2},
                    headers=headers(self._faults.cluster),
                    timeout=60,
                )
                self.outcomes.append((phase, r.headers.get("x-request-id", ""), r.status_code))
            except httpx.HTTPError as exc:
                self.outcomes.append((phase, repr(exc), 0))

    def mark(self, phase: str) -> int:
        """Requests sent from now on belong to `phase`; how many ended so far."""
        self.phase = phase
        return len(self.outcomes)

    def wait_answered(self, phase: str, n: int) -> None:
        """Until `n` requests sent in `phase` have been answered."""
        wait_until(
            lambda: sum(p == phase for p, _, _ in self.outcomes) >= n,
            ACT_S,
            f"{n} answers to requests sent {phase}",
        )

    def stop(self) -> list[tuple[str, str, int]]:
        self._stop.set()
        self._thread.join(90)
        assert not self._thread.is_alive(), "a request hung"
        return self.outcomes


def test_conductor_failover_gives_every_admission_exactly_one_decision(faulty: Faulty) -> None:
    cluster = faulty.cluster
    conductors = faulty.expected("conductor")
    first = _active_conductor(faulty, conductors)
    assert first is not None  # the `healthy` fixture saw to it
    (second,) = [c for c in conductors if c != first]
    traffic = _Traffic(faulty)
    traffic.wait_answered("before", 3)

    # A pause longer than the lease: the standby takes over; the old one, resumed,
    # must stand down rather than decide alongside it.
    traffic.mark("during pause")
    paused = time.monotonic()
    signal_instance(cluster, first, signal.SIGSTOP)
    try:
        takeover_s = wait_until(
            lambda: _active_conductor(faulty, [second]) == second,
            TAKEOVER_S,
            f"{second} to take over",
        )
        traffic.mark(f"after {second} took over")
        traffic.wait_answered(f"after {second} took over", 3)
    finally:
        signal_instance(cluster, first, signal.SIGCONT)
    wait_until(
        lambda: _active_conductor(faulty, [first]) is None, TAKEOVER_S, f"{first} to stand down"
    )
    pause_s = time.monotonic() - paused

    # Then the active one dies outright: the resumed one takes over again.
    traffic.mark("during failover")
    killed = kill(cluster, second)
    faulty.gone.add(second)
    again_s = wait_until(
        lambda: _active_conductor(faulty, [first]) == first, TAKEOVER_S, f"{first} to take over"
    )
    traffic.mark(f"after {first} took over")
    traffic.wait_answered(f"after {first} took over", 3)
    outcomes = traffic.stop()
    failover_s = time.monotonic() - killed

    # Requests sent while an active conductor was known to be in charge succeed;
    # those sent across a takeover may wait or fail, but none is decided twice.
    settled = {"before", f"after {second} took over", f"after {first} took over"}
    failed = [o for o in outcomes if o[0] in settled and o[2] != 200]
    assert not failed, failed
    # A marker request, decided after every request above was admitted: the
    # conductor decides in log order, so once its decision is logged every earlier
    # admission has had its decision made, if it ever gets one.
    marker = complete(cluster, tiny_prompt(99, 30), max_tokens=2)
    _scheduled(cluster, marker["id"])
    decisions = decisions_per_admission(read_log(cluster))
    wrong = {rid: d for rid, d in decisions.items() if len(d) != 1}
    assert not wrong, f"requests without exactly one decision: {wrong}"
    answered = {rid for _, rid, status in outcomes if status}
    assert answered <= set(decisions), answered - set(decisions)
    codes = sorted({status for _, _, status in outcomes})
    record(
        "conductor_failover",
        FaultRecord(
            fault="active conductor paused past its lease, resumed; then the new active "
            "conductor dies",
            caused_by=f"SIGSTOP {first} ({LEASE_S:g}s lease), SIGCONT it; SIGKILL {second}",
            client_saw=f"{len(outcomes)} requests sent meanwhile, answered {codes}; every one "
            "sent while a conductor was active answered 200",
            cleaned_up=f"{second} took over in {takeover_s:.2f}s, {first} stood down when "
            f"resumed, then took over again {again_s:.2f}s after {second} was killed",
            checked_by=f"yb_conductor_active on both; the log: each of {len(decisions)} "
            "RequestAdmitted has exactly one RequestScheduled/RequestRejected",
            recovery_s=round(max(takeover_s, again_s), 3),
            details={
                "pause_to_standing_down_s": round(pause_s, 3),
                "kill_to_traffic_resumed_s": round(failover_s, 3),
                "answers": {str(c): sum(s == c for _, _, s in outcomes) for c in codes},
            },
        ),
    )
