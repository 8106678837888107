"""A NATS outage: the gateway answers 503 meanwhile, and every service comes back.

Real processes (conductor, prefill, decode, gateway, tiny model) against a real
nats-server that is stopped and started again on the same port and store. The
scheduling log survives it whole: every request admitted before the outage is still
there afterwards, and every admission in it has exactly one decision.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# The shared fault helpers live beside this file (test modules are not importable
# under --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent))

from yb_core.config import NatsConfig, YbConfig, dump_env, load_config
from yb_testkit.faults import FaultRecord, decisions_per_admission, read_events, record, wait_until
from yb_tools.natsserver import NatsServer, die_with_parent, env_without_proxies, free_port

ROLES = ("conductor", "prefill", "decode", "gateway")
API_KEY = "outage-test-key"  # a gateway without one refuses to start


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[NatsServer, str, dict[str, subprocess.Popen[bytes]]]]:
    server = NatsServer(
        store_dir=tmp_path / "nats", port=free_port(), log_file=tmp_path / "nats.log"
    )
    server.start()
    port = free_port()
    cfg: YbConfig = load_config(
        env={},
        overrides={
            "model": {"source": "tiny-random", "name": "tiny"},
            # The default deadlines (no short ones: nothing here is timed, and a loaded
            # machine must not turn a slow answer before the outage into a 503); only
            # the reconnect backoff is capped, so the services retry often once the
            # server is back.
            "nats": {"url": server.url, "max_reconnect_wait_s": 0.5},
            "gateway": {"port": port, "api_keys": [API_KEY]},
            "prefill": {"num_kv_pages": 64, "load_report_interval_s": 0.5},
            "decode": {"num_kv_pages": 64, "load_report_interval_s": 0.5},
        },
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for role in ROLES:
        env = env_without_proxies()
        env.update(dump_env(cfg))
        env["YB_INSTANCE_ID"] = f"{role}-0"
        with open(tmp_path / f"{role}.log", "ab") as out:
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", f"yb_{role}"],
                env=env,
                stdout=out,
                stderr=out,
                preexec_fn=die_with_parent,
            )
    try:
        yield server, f"http://127.0.0.1:{port}", procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout_s}s")


def _complete(url: str) -> httpx.Response:
    # The client's timeout only guards against a hang: the gateway answers within its
    # own deadlines (decision, job, publish), which are far shorter.
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0},
        timeout=300,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )


@pytest.mark.timeout(900)  # the sum of its waits' deadlines; none is a speed bound
def test_services_ride_out_a_nats_restart(
    cluster: tuple[NatsServer, str, dict[str, subprocess.Popen[bytes]]],
) -> None:
    server, url, procs = cluster
    _wait_ready(url, 240)
    before = [_complete(url) for _ in range(3)]
    assert [r.status_code for r in before] == [200] * 3
    served = [r.json()["id"] for r in before]

    server.stop()
    stopped = time.monotonic()
    r = _complete(url)
    answered_s = time.monotonic() - stopped  # reported below, not asserted
    # A 503 at all (not a hang past the client's timeout) shows the gateway's deadlines.
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"]
    outage_code = r.json()["error"].get("code")
    assert httpx.get(f"{url}/healthz", timeout=60).status_code == 200

    server.start()
    restarted = time.monotonic()
    # Every service reconnects by itself: requests succeed again end to end.
    deadline = time.monotonic() + 240
    while True:
        r = _complete(url)
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    recovered_s = time.monotonic() - restarted
    assert r.json()["usage"]["completion_tokens"] >= 1
    served.append(r.json()["id"])
    assert all(p.poll() is None for p in procs.values()), "a service died during the outage"

    # The log is intact: nothing admitted was lost, nothing decided twice or never.
    # Attempts that failed while the services reconnected may have been admitted and
    # be decided a moment later: wait until every admission has a decision (not a
    # fixed pause), then check that none has two.
    cfg = NatsConfig(url=server.url)
    decisions: dict[str, list[str]] = {}

    def all_decided() -> bool:
        decisions.clear()
        decisions.update(decisions_per_admission(read_events(cfg)))
        return all(decisions.values())

    wait_until(all_decided, 120, "a decision for every admission in the log")
    missing = [rid for rid in served if rid not in decisions]
    assert not missing, f"admitted requests missing from the log: {missing}"
    wrong = {rid: d for rid, d in decisions.items() if len(d) != 1}
    assert not wrong, f"admissions without exactly one decision: {wrong}"
    record(
        "nats_restart",
        FaultRecord(
            fault="nats-server restarts",
            caused_by="stop nats-server (the JetStream store stays), start it again on the "
            "same port",
            client_saw=f"503 ({outage_code}) after {answered_s:.2f}s during the outage; "
            "200 once NATS was back",
            cleaned_up=f"every service reconnected by itself; the log kept all "
            f"{len(decisions)} admissions, each with exactly one decision",
            checked_by="the YB_EVENTS stream read back after the restart; /healthz during it",
            recovery_s=round(recovered_s, 3),
            details={"outage_answer_s": round(answered_s, 3)},
        ),
    )
