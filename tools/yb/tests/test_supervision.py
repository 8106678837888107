"""`yb up`'s supervisor: the restart policy, and its decisions on real processes.

The members here are real child processes (`sh` scripts that write a line to their
log and exit with a chosen code), the clock is the test's: each step waits for the
processes to have exited, then advances the clock past the back-off, so nothing
depends on this machine's speed. The whole launcher under real kills is
`tests/test_supervised_cluster.py`.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from yb_tools.cli.supervision import (
    GiveUp,
    Incarnation,
    Restart,
    RestartPolicy,
    Supervisor,
    describe_exit,
    log_tail,
)


def test_the_back_off_doubles_up_to_its_ceiling() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(ValueError):
        RestartPolicy(give_up_after=0)


def test_an_incarnation_gives_up_only_on_failed_starts_in_a_row() -> None:
    policy = RestartPolicy(give_up_after=3, steady_after_s=60.0)
    inc = Incarnation()
    assert inc.exited(policy, announced=False, up_s=0) == Restart(1.0)
    assert inc.exited(policy, announced=False, up_s=0) == Restart(2.0)
    # It started this time (announced itself): the failed starts begin again, the
    # back-off keeps growing (it did not stay up long).
    assert inc.exited(policy, announced=True, up_s=5) == Restart(4.0)
    assert inc.failed_starts == 0
    assert inc.exited(policy, announced=False, up_s=0) == Restart(8.0)
    assert inc.exited(policy, announced=False, up_s=0) == Restart(16.0)
    assert inc.exited(policy, announced=False, up_s=0) == GiveUp(
        "it exited 3 times in a row before announcing itself"
    )
    # A steady run resets the back-off.
    steady = Incarnation(exits_in_a_row=4)
    assert steady.exited(policy, announced=True, up_s=60) == Restart(1.0)


def test_exits_are_described_in_words() -> None:
    assert describe_exit(1) == "code 1"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"


@dataclass
class ShellMember:
    """A real process: `sh -c script`, its output appended to its log."""

    name: str
    role: str
    script: str
    logs: Path
    spawned: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_offset: int = 0

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}.log"

    def exit_code(self) -> int | None:
        return self.spawned[-1].poll()

    def respawn(self) -> int:
        with open(self.log_path, "ab") as out:
            self.log_offset = out.tell()
            self.spawned.append(subprocess.Popen(["sh", "-c", self.script], stdout=out, stderr=out))
        return self.spawned[-1].pid

    def wait(self) -> None:
        self.spawned[-1].wait(timeout=30)

    def kill(self) -> None:
        self.spawned[-1].kill()
        self.spawned[-1].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def members(tmp_path: Path) -> list[ShellMember]:
    made: list[ShellMember] = []
    yield made
    for member in made:
        member.stop()


def _member(members: list[ShellMember], tmp_path: Path, name: str, role: str, script: str):
    member = ShellMember(name, role, script, tmp_path)
    member.respawn()
    members.append(member)
    return member


def test_a_crash_loop_is_given_up_on_and_a_lost_role_stops_the_cluster(
    members: list[ShellMember], tmp_path: Path
) -> None:
    crash = "echo 'kvstore: cannot open the SSD tier: Not a directory'; exit 3"
    first = _member(members, tmp_path, "kvstore-0", "kvstore", crash)
    second = _member(members, tmp_path, "kvstore-1", "kvstore", "exec sleep 600")
    said: list[str] = []
    clock = Clock()
    supervisor = Supervisor(
        [first, second],
        "restart",
        announced=lambda name: False,
        say=said.append,
        policy=RestartPolicy(give_up_after=3),
        clock=clock,
    )
    for attempt in range(1, 3):
        first.wait()
        assert supervisor.tick(ready=True) is None
        assert f"restarting kvstore-0 in {2 ** (attempt - 1)}s" in said[-1]
        clock.now += 2 ** (attempt - 1)
        assert supervisor.tick(ready=True) is None  # restarted now
        assert said[-1].startswith("restarted kvstore-0 (pid ")
        assert len(first.spawned) == attempt + 1
    first.wait()
    assert supervisor.tick(ready=True) is None  # given up on, but kvstore-1 is left
    text = "\n".join(said)
    assert "kvstore-0 (kvstore) exited with code 3" in text
    assert "before it announced itself" in text
    assert "  | kvstore: cannot open the SSD tier: Not a directory" in said  # its log
    assert said[-1].startswith(
        "giving up on kvstore-0: it exited 3 times in a row before announcing itself"
    )
    assert supervisor.given_up() == {
        "kvstore-0": "it exited 3 times in a row before announcing itself"
    }
    clock.now += 100
    assert supervisor.tick(ready=True) is None
    assert len(first.spawned) == 3  # never again

    # The other one now dies at start too: no kvstore is left.
    second.script = crash
    second.kill()
    for backoff in (1, 2):
        assert supervisor.tick(ready=True) is None
        clock.now += backoff
        assert supervisor.tick(ready=True) is None
        second.wait()
    assert supervisor.tick(ready=True) == (
        "no kvstore instance is left (kvstore-0, kvstore-1 given up on)"
    )


def test_an_instance_that_had_started_is_restarted_and_seen_back(
    members: list[ShellMember], tmp_path: Path
) -> None:
    decode = _member(members, tmp_path, "decode-0", "decode", "exec sleep 600")
    announced = {"decode-0"}
    said: list[str] = []
    clock = Clock()
    supervisor = Supervisor(
        [decode],
        "restart",
        announced=lambda name: name in announced,
        say=said.append,
        clock=clock,
    )
    assert supervisor.tick(ready=True) is None  # sees it announced
    clock.now += 5
    decode.kill()
    announced.clear()  # the next process has not announced itself yet
    assert supervisor.tick(ready=True) is None
    assert "decode-0 (decode) exited with signal SIGKILL after 5.0s" in said
    assert said[-1] == "restarting decode-0 in 1s (restart 1)"
    clock.now += 1
    assert supervisor.tick(ready=True) is None
    assert decode.exit_code() is None and len(decode.spawned) == 2
    announced.add("decode-0")
    assert supervisor.tick(ready=True) is None
    assert said[-1] == "decode-0 is back: it announced itself again"
    assert supervisor.restarts() == {"decode-0": 1}


@pytest.mark.parametrize("on_exit", ["keep-going", "stop"])
def test_keep_going_leaves_it_down_and_stop_stops(
    members: list[ShellMember], tmp_path: Path, on_exit: str
) -> None:
    prefill = _member(members, tmp_path, "prefill-0", "prefill", "exit 1")
    said: list[str] = []
    clock = Clock()
    supervisor = Supervisor(
        [prefill],
        on_exit,  # type: ignore[arg-type]
        announced=lambda name: True,
        say=said.append,
        clock=clock,
    )
    prefill.wait()
    verdict = supervisor.tick(ready=True)
    if on_exit == "stop":
        assert verdict == "prefill-0 exited (code 1)"
    else:
        assert verdict is None
        assert said[-1] == "keeping the rest of the cluster up (--on-exit keep-going)"
        clock.now += 100
        assert supervisor.tick(ready=True) is None
        assert len(prefill.spawned) == 1  # never restarted
        assert said.count("keeping the rest of the cluster up (--on-exit keep-going)") == 1


def test_before_the_cluster_was_ready_keep_going_fails_the_start(
    members: list[ShellMember], tmp_path: Path
) -> None:
    gateway = _member(members, tmp_path, "gateway-0", "gateway", "exit 2")
    supervisor = Supervisor(
        [gateway],
        "keep-going",
        announced=lambda name: False,
        say=lambda line: None,
        clock=Clock(),
    )
    gateway.wait()
    assert supervisor.tick(ready=False) == "gateway-0 exited (code 2)"


def test_the_log_tail_is_the_current_process_s_and_readable(tmp_path: Path) -> None:
    log = tmp_path / "kvstore-0.log"
    log.write_text('{"event": "started", "level": "info"}\n')  # an earlier process's
    offset = log.stat().st_size
    crash = {
        "event": "service_crashed",
        "level": "error",
        "service": "kvstore",
        "timestamp": "2026-11-28T16:26:25Z",
        "error": "FileExistsError(17, 'File exists')",
        "exception": "Traceback (most recent call last):\n  File x\nFileExistsError: ssd",
    }
    with log.open("a") as f:
        f.write("plain text from a library\n")
        f.write(json.dumps(crash) + "\n")
    assert log_tail(log, since=offset) == [
        "plain text from a library",
        "error service_crashed error=FileExistsError(17, 'File exists')",
        "  Traceback (most recent call last):",
        "    File x",
        "  FileExistsError: ssd",
    ]
    assert log_tail(log)[0] == "info started"
    assert log_tail(tmp_path / "missing.log") == []


def test_an_exit_before_the_announcement_was_seen_asks_the_log_once(
    members: list[ShellMember], tmp_path: Path
) -> None:
    # Killed right after it announced itself, before the launcher's copy of the log
    # showed it: the log confirms it had started, so it is no failed start.
    decode = _member(members, tmp_path, "decode-0", "decode", "exec sleep 600")
    asked: list[str] = []

    def confirm(name: str) -> bool:
        asked.append(name)
        return True

    said: list[str] = []
    supervisor = Supervisor(
        [decode],
        "restart",
        announced=lambda name: False,
        confirm_announced=confirm,
        say=said.append,
        clock=Clock(),
    )
    assert supervisor.tick(ready=True) is None
    assert asked == []  # only an exit asks
    decode.kill()
    assert supervisor.tick(ready=True) is None
    assert asked == ["decode-0"]
    assert "decode-0 (decode) exited with signal SIGKILL after 0.0s" in said
    assert said[-1] == "restarting decode-0 in 1s (restart 1)"


def test_a_restart_back_off_below_its_first_wait_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from yb_tools.cli import main

    code = main(["up", "--restart-max-backoff", "0.5", "--data-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--restart-max-backoff: the restart back-off needs 0 < initial <= max" in err
    assert "max 0.5 s" in err
    assert not (tmp_path / "nats").exists()
    assert RestartPolicy(max_backoff_s=4.0).backoff(5) == 4.0
