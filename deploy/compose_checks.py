"""The client side of deploy/compose-smoke.sh: what a user's application sees.

    python deploy/compose_checks.py chat|reuse|decode-killed|nats-restarted|elastic
                                    [--project P]

Talks to the gateway at http://127.0.0.1:8000/v1 with the key in `.env` (YB_API_KEYS),
through the official `openai` client. Each check prints what it saw and exits 1 with
the reason when something is not as it must be. Every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[1]
BASE_URL = "http://127.0.0.1:8000/v1"
MODEL = "SmolLM2-135M-Instruct"
DEADLINE_S = 180.0


class CheckFailed(Exception):
    pass


def api_key() -> str:
    for line in (ROOT / ".env").read_text().splitlines():
        if line.startswith("YB_API_KEYS="):
            return line.split("=", 1)[1].split(",")[0]
    raise CheckFailed(".env has no YB_API_KEYS (deploy/make-env.sh writes it)")


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=BASE_URL, api_key=api_key(), timeout=120, max_retries=0)


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise CheckFailed(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def describe(project: str) -> str:
    """Each container of `project`: its state and, when it has a health check, the last
    probes' results (what `up` waited on when it says a container is unhealthy)."""
    lines = []
    label = f"label=com.docker.compose.project={project}"
    for cid in docker("ps", "-aq", "--filter", label).split():
        lines.append(
            docker(
                "inspect",
                "-f",
                "  {{.Name}}: {{.State.Status}} (exit {{.State.ExitCode}}) health "
                "{{if .State.Health}}{{.State.Health.Status}}{{range .State.Health.Log}}\n"
                '      {{.Start.Format "15:04:05"}} exit {{.ExitCode}}: '
                '{{printf "%.200s" .Output}}{{end}}{{else}}-{{end}}',
                cid,
            )
        )
    return "\n".join(lines)


def container(project: str, service: str) -> str:
    """The container id of `service` (compose v1 and v2 label them alike)."""
    ids = docker(
        "ps",
        "-q",
        "--filter",
        f"label=com.docker.compose.project={project}",
        "--filter",
        f"label=com.docker.compose.service={service}",
    ).split()
    if len(ids) != 1:
        raise CheckFailed(f"expected one running container of {service}, found {ids}")
    return ids[0]


def served_within(deadline_s: float) -> float:
    """Seconds until a chat is answered 200 (retrying what fails meanwhile)."""
    api = client()
    started = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - started < deadline_s:
        try:
            answer = api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say yes."}],
                max_tokens=4,
                temperature=0,
            )
            if answer.choices[0].message.content:
                return time.monotonic() - started
        except openai.APIError as exc:
            last = exc
        time.sleep(1.0)
    raise CheckFailed(f"no chat answered within {deadline_s:g}s; last error: {last!r}")


def streamed_chat(
    api: openai.OpenAI, content: str, *, max_tokens: int
) -> tuple[list[str], float, float]:
    """One greedy streamed chat: its text pieces, seconds to the first, seconds to the end.
    Raises CheckFailed when the stream carries no text."""
    started = time.monotonic()
    first_token_s = 0.0
    pieces: list[str] = []
    for chunk in api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    ):
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first_token_s = first_token_s or time.monotonic() - started
            pieces.append(delta)
    if not pieces:
        raise CheckFailed("the stream carried no text")
    return pieces, first_token_s, time.monotonic() - started


def check_chat(_: argparse.Namespace) -> None:
    api = client()
    started = time.monotonic()
    whole = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    text = whole.choices[0].message.content or ""
    print(f"chat: {text!r} in {time.monotonic() - started:.2f}s")
    if "Paris" not in text:
        raise CheckFailed(f"the default model did not answer Paris: {text!r}")
    pieces, first_token_s, _total_s = streamed_chat(api, "Name three colours.", max_tokens=24)
    print(f"stream: {len(pieces)} chunks, first after {first_token_s:.2f}s")


def check_reuse(_: argparse.Namespace) -> None:
    api = client()
    prompt = " ".join(f"Item {i} is a small red box on the table." for i in range(120))
    cached = []
    for attempt in range(2):
        started = time.monotonic()
        answer = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt + " Summarize."}],
            max_tokens=4,
            temperature=0,
        )
        usage = answer.usage
        details = usage.prompt_tokens_details if usage else None
        cached.append(details.cached_tokens if details and details.cached_tokens else 0)
        took = time.monotonic() - started
        print(
            f"long prompt, try {attempt + 1}: {usage and usage.prompt_tokens} prompt tokens, "
            f"{cached[-1]} cached, {took:.2f}s"
        )
    if not cached[1] > 0:
        raise CheckFailed(f"the repeated prompt reused no KV: cached_tokens {cached}")


def check_decode_killed(args: argparse.Namespace) -> None:
    target = container(args.project, "decode-0")
    restarts = int(docker("inspect", "-f", "{{.RestartCount}}", target))
    pid = docker("inspect", "-f", "{{.State.Pid}}", target)
    stream = client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to one thousand."}],
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    error = ""
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
            if received == 20:
                # SIGKILL from the host: the container exits 137, so compose's
                # `restart: unless-stopped` applies (a `docker kill` would count as a
                # manual stop).
                subprocess.run(["kill", "-9", pid], check=True, timeout=10)
    except openai.APIError as exc:
        error = str(exc)
    print(f"decode killed after {received} chunks; the stream ended with: {error!r}")
    if received < 20:
        raise CheckFailed("the stream ended before decode was killed")
    if "decode" not in error.lower():
        raise CheckFailed(f"no clear error naming decode at the end of the stream: {error!r}")
    deadline = time.monotonic() + DEADLINE_S
    while int(docker("inspect", "-f", "{{.RestartCount}}", target)) <= restarts:
        if time.monotonic() > deadline:
            raise CheckFailed("compose did not restart decode-0")
        time.sleep(1.0)
    print(f"decode-0 restarted; next chat answered after {served_within(DEADLINE_S):.1f}s")


def compose_command() -> list[str]:
    """The compose command deploy/compose-env.sh chose (`YB_COMPOSE`, a JSON list)."""
    return list(json.loads(os.environ.get("YB_COMPOSE", '["docker", "compose"]')))


def stream_messages(project: str) -> int:
    """How many events YB_EVENTS holds, read from nats-server's monitor inside its
    container (the monitor is not published)."""
    probe = (
        "import json, urllib.request as u; "
        "d = json.load(u.urlopen('http://127.0.0.1:8222/jsz?accounts=true&streams=true')); "
        "print(sum(s['state']['messages'] for a in d.get('account_details', []) "
        "for s in a.get('stream_detail', []) if s['name'] == 'YB_EVENTS'))"
    )
    return int(docker("exec", container(project, "nats"), "python", "-c", probe))


def check_nats_restarted(args: argparse.Namespace) -> None:
    before = stream_messages(args.project)
    subprocess.run(
        [*compose_command(), "-p", args.project, "restart", "nats"], check=True, timeout=120
    )
    print(f"nats restarted; a chat answered after {served_within(DEADLINE_S):.1f}s")
    after = stream_messages(args.project)
    print(f"YB_EVENTS: {before} events before the restart, {after} after")
    if after < before or before == 0:
        raise CheckFailed(f"the event log did not survive: {before} -> {after}")


# --- elastic pools (docker-compose.elastic.yml) ----------------------------------------

ADDED_LABEL = "org.yuebing.added-by=planner-actuator"
#: Asked inside the actuator's container (its image has yb_core, its env the admin
#: user): the newest `InstanceUp` of one instance, from the log itself.
ANNOUNCED_PROBE = """
import asyncio, os, sys
from yb_core.bus import Bus
from yb_core.config import load_config
async def main():
    bus = await Bus.connect(load_config(env=dict(os.environ)).nats, "compose-smoke", timeout_s=10)
    try:
        found = await bus.last_event("yb.ev.instance.instance_up." + sys.argv[1], timeout_s=10)
    finally:
        await bus.close()
    print(found.event.time if found is not None else 0.0)
asyncio.run(main())
"""


@dataclass
class Load:
    """Closed-loop chats from `workers` threads, each a prompt of its own (`numbers`
    random numbers to sort: no shared prefix), until `stop`; every failure is kept."""

    workers: int
    numbers: int = 70  # about 500 prompt tokens
    stop: threading.Event = field(default_factory=threading.Event)
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, seed: int, pause_s: float) -> None:
        api = client()
        rng = random.Random(seed)
        while not self.stop.is_set():
            words = " ".join(str(rng.randrange(10**6)) for _ in range(self.numbers))
            try:
                api.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Sort these numbers: {words}"}],
                    max_tokens=8,  # mostly prefill: the pool the step grows
                    temperature=0,
                )
                with self.lock:
                    self.ok += 1
            except openai.APIError as exc:
                with self.lock:
                    self.failed.append(repr(exc))
            self.stop.wait(pause_s)


def project_containers(project: str, *labels: str) -> list[str]:
    """The ids of `project`'s containers (running or not) that have every label."""
    filters = [f"label=com.docker.compose.project={project}", *(f"label={x}" for x in labels)]
    return docker("ps", "-aq", *(a for f in filters for a in ("--filter", f))).split()


def running_engines(project: str) -> list[str]:
    """The names of `project`'s running engine containers."""
    services = docker(
        "ps",
        "--filter",
        f"label=com.docker.compose.project={project}",
        "--format",
        '{{.Names}} {{.Label "com.docker.compose.service"}}',
    )
    return sorted(
        name
        for name, _, service in (line.partition(" ") for line in services.splitlines())
        if service.startswith(("prefill", "decode"))
    )


def wait_for(what: str, deadline_s: float, probe: Callable[[], bool]) -> float:
    """Seconds until `probe()` is true; CheckFailed at the deadline."""
    started = time.monotonic()
    while not probe():
        if time.monotonic() - started > deadline_s:
            raise CheckFailed(f"{what}: not within {deadline_s:g}s")
        time.sleep(1.0)
    return time.monotonic() - started


class EventTap:
    """The project's container events of `kinds`, as Docker reports them, from now
    until `close()`: a `docker events` stream read by a thread (the daemon keeps only
    its last few hundred events, which the health checks' execs soon push out)."""

    def __init__(self, project: str, kinds: tuple[str, ...]) -> None:
        command = ["docker", "events", "--format", "{{json .}}"]
        command += ["--filter", f"label=com.docker.compose.project={project}"]
        command += [a for kind in kinds for a in ("--filter", f"event={kind}")]
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="docker-events", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._lock:
                self._events.append(json.loads(line))

    def events(self, action: str = "", since: float = 0.0) -> list[dict[str, Any]]:
        """The events seen so far (of `action`, at or after `since`, wall clock)."""
        with self._lock:
            return [
                e
                for e in self._events
                if (not action or e["Action"] == action) and e["timeNano"] / 1e9 >= since
            ]

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._reader.join(timeout=10)


def check_elastic(args: argparse.Namespace) -> None:
    """A load step: the planner adds an engine and the actuator starts its container,
    which becomes healthy and announces itself; the load falls, and the actuator drains
    engines: each container stops on SIGTERM with exit code 0 and is removed. No request
    of the load fails."""
    project = args.project
    actuator = container(project, "planner-actuator")
    tap = EventTap(project, ("create", "kill", "die", "destroy"))
    try:
        grown = load_until_added(args, project, actuator)
        drained_after_fall(args, project, tap, grown)
    finally:
        tap.close()


@dataclass
class Grown:
    """What the load step left: its clients' counts, the time the load fell."""

    high: Load
    low: Load
    pool: ThreadPoolExecutor
    running: list[Future[None]]
    fall: float


def load_until_added(args: argparse.Namespace, project: str, actuator: str) -> Grown:
    """Load until an engine container is added, healthy and announced, and `hold_s`
    more; then one request every 5 s."""
    before = set(project_containers(project, ADDED_LABEL))
    high, low = Load(workers=args.workers), Load(workers=1)
    pool = ThreadPoolExecutor(max_workers=args.workers + 1)
    running = [pool.submit(high.worker, seed, 0.0) for seed in range(args.workers)]
    step = time.time()
    print(f"load: {args.workers} clients in a closed loop from {time.strftime('%X')}")
    try:
        new: list[str] = []

        def added() -> bool:
            new[:] = [c for c in project_containers(project, ADDED_LABEL) if c not in before]
            return bool(new)

        add_s = wait_for("an engine container added under load", args.add_deadline_s, added)
        seen = time.time()
        name = docker("inspect", "-f", "{{.Name}}", new[0]).lstrip("/")
        labels = json.loads(docker("inspect", "-f", "{{json .Config.Labels}}", new[0]))
        instance = labels["org.yuebing.instance-id"]
        print(f"added: container {name} ({instance}) {add_s:.1f}s after the load rose")
        listed = subprocess.run(
            [
                *json.loads(os.environ.get("YB_COMPOSE", '["docker", "compose"]')),
                "-p",
                project,
                "ps",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        if name not in listed:
            raise CheckFailed(f"`compose ps` does not list {name}:\n{listed}")

        def healthy() -> bool:
            return docker("inspect", "-f", "{{.State.Health.Status}}", new[0]) == "healthy"

        healthy_s = wait_for(f"{name} healthy", DEADLINE_S, healthy)
        announced_at: list[float] = []

        def announced() -> bool:
            up_at = float(docker("exec", actuator, "python", "-c", ANNOUNCED_PROBE, instance))
            announced_at[:] = [up_at] if up_at >= step else []
            return bool(announced_at)

        wait_for(f"{instance}'s InstanceUp in the log", DEADLINE_S, announced)
        print(
            f"{name}: listed by `compose ps`; healthy {healthy_s:.1f}s after it appeared; its "
            f"InstanceUp {announced_at[0] - seen:+.1f}s from then"
        )
        time.sleep(args.hold_s)  # the grown pool serves a while
        engines = ", ".join(running_engines(project))
        print(f"load: {high.ok} answered, {len(high.failed)} failed; engines {engines}")
    finally:
        high.stop.set()
    fall = time.time()
    running.append(pool.submit(low.worker, 1000, 5.0))
    print(f"load fell to one request every 5s at {time.strftime('%X')}")
    return Grown(high, low, pool, running, fall)


def drained_after_fall(args: argparse.Namespace, project: str, tap: EventTap, grown: Grown) -> None:
    """Wait for the actuator's drains after the fall; each must have stopped on SIGTERM
    with exit code 0 and been removed; no request of the load may have failed."""
    fall = grown.fall
    try:
        drain_s = wait_for(
            "an engine drained and removed",
            args.drain_deadline_s,
            lambda: bool(tap.events("destroy", fall)),
        )
        time.sleep(args.hold_s)  # drains decided with the first one
    finally:
        grown.low.stop.set()
        for future in grown.running:
            future.result(timeout=DEADLINE_S)
        grown.pool.shutdown()
    removed = tap.events("destroy", fall)
    for destroyed in removed:
        who = destroyed["Actor"]["Attributes"]["name"]
        mine = [e for e in tap.events(since=fall) if e["id"] == destroyed["id"]]
        dies = [e for e in mine if e["Action"] == "die"]
        kills = [e for e in mine if e["Action"] == "kill"]
        if not dies or not kills:
            raise CheckFailed(f"{who} was removed without being stopped")
        code = dies[-1]["Actor"]["Attributes"].get("exitCode")
        signals = sorted({k["Actor"]["Attributes"].get("signal") for k in kills})
        took = (dies[-1]["timeNano"] - kills[0]["timeNano"]) / 1e9
        at = destroyed["timeNano"] / 1e9 - fall
        print(
            f"drained: {who}: signals {signals}, exit code {code} {took:.1f}s after the first; "
            f"removed {at:.1f}s after the load fell"
        )
        if code != "0" or signals != ["15"]:
            raise CheckFailed(f"{who} did not drain cleanly: exit code {code}, signals {signals}")
        if destroyed["id"][:12] in project_containers(project):
            raise CheckFailed(f"{who} is still listed after its removal")
    print(f"first drain done {drain_s:.1f}s after the load fell; {len(removed)} drained")
    print(f"engines: {', '.join(running_engines(project))}")
    failures = grown.high.failed + grown.low.failed
    print(f"load: {grown.high.ok + grown.low.ok} requests answered, {len(failures)} failed")
    if failures:
        raise CheckFailed(f"{len(failures)} requests of the load failed: {failures[:3]}")


CHECKS = {
    "chat": check_chat,
    "reuse": check_reuse,
    "decode-killed": check_decode_killed,
    "nats-restarted": check_nats_restarted,
    "elastic": check_elastic,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--project", default="yuebing")
    elastic = parser.add_argument_group("elastic")
    elastic.add_argument("--workers", type=int, default=5, help="clients of the load step")
    elastic.add_argument("--add-deadline-s", type=float, default=300.0)
    elastic.add_argument("--hold-s", type=float, default=20.0, help="load kept once grown")
    elastic.add_argument("--drain-deadline-s", type=float, default=240.0)
    args = parser.parse_args()
    try:
        CHECKS[args.check](args)
    except (CheckFailed, openai.APIError, subprocess.SubprocessError) as exc:
        print(f"FAILED {args.check}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
