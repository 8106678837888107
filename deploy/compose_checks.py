"""The client side of deploy/compose-smoke.sh: what a user's application sees.

    python deploy/compose_checks.py chat|reuse|decode-killed|nats-restarted [--project P]

Talks to the gateway at http://127.0.0.1:8000/v1 with the key in `.env` (YB_API_KEYS),
through the official `openai` client. Each check prints what it saw and exits 1 with
the reason when something is not as it must be. Every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
    compose = json.loads(os.environ.get("YB_COMPOSE", '["docker", "compose"]'))
    subprocess.run([*compose, "-p", args.project, "restart", "nats"], check=True, timeout=120)
    print(f"nats restarted; a chat answered after {served_within(DEADLINE_S):.1f}s")
    after = stream_messages(args.project)
    print(f"YB_EVENTS: {before} events before the restart, {after} after")
    if after < before or before == 0:
        raise CheckFailed(f"the event log did not survive: {before} -> {after}")


CHECKS = {
    "chat": check_chat,
    "reuse": check_reuse,
    "decode-killed": check_decode_killed,
    "nats-restarted": check_nats_restarted,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--project", default="yuebing")
    args = parser.parse_args()
    try:
        CHECKS[args.check](args)
    except (CheckFailed, openai.APIError, subprocess.SubprocessError) as exc:
        print(f"FAILED {args.check}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
