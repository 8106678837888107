"""The data plane across real processes: round trip, a killed sender, a stopped peer.

The other process runs `test_transport_helpers.py` (a sender or a receiver) and
reports progress on stdout; real UCX on both ends, nothing mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from yb_dataplane.transport import (
    KVReceiver,
    KVSender,
    PeerAddress,
    PeerUnreachable,
    TransferTimeout,
    checksum,
)

HELPER = Path(__file__).with_name("test_transport_helpers.py")
MIB = 1 << 20


def payload(seed: int, index: int, size: int, pattern: str = "random") -> np.ndarray:
    """Same bytes as the helper's `payload` (kept in step by `test_payload_matches_helper`)."""
    if pattern == "fill":
        return np.full(size, (seed * 31 + index) % 251, dtype=np.uint8)
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, 256, size, dtype=np.uint8)


class Peer:
    """A helper process and its stdout lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(
        cls, role: str, spec: dict[str, Any], env: dict[str, str] | None = None
    ) -> Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HELPER),
            role,
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=None if env is None else {**os.environ, **env},
        )
        return cls(proc)

    async def go(self) -> None:
        """Let a sender started with `wait_for_go` (and `ready`) send."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def expect(self, prefix: str, timeout: float = 20.0) -> str:
        """The next line starting with `prefix`; fails on EOF, timeout or an error line."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    raw = await self.proc.stdout.readline()
                    if not raw:
                        raise AssertionError(f"helper exited before {prefix!r}: {self.lines}")
                    line = raw.decode().strip()
                    self.lines.append(line)
                    if line.startswith(prefix):
                        return line
                    if line.startswith("error"):
                        raise AssertionError(f"helper failed while waiting for {prefix!r}: {line}")
        except TimeoutError:
            raise AssertionError(
                f"no {prefix!r} from the helper in {timeout}s; it said {self.lines}"
            ) from None

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
            self.proc.kill()
        await self.proc.wait()


def test_payload_matches_helper() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("transport_helper", HELPER)
    assert spec is not None and spec.loader is not None
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    for pattern in ("random", "fill"):
        assert np.array_equal(helper.payload(3, 7, 1000, pattern), payload(3, 7, 1000, pattern))


@pytest.mark.asyncio
async def test_round_trip_many_mixed_buffers_in_segments(receiver: KVReceiver) -> None:
    # Layer-wise streaming shape: 4 "layers" x 30 pages of mixed sizes, one segment per
    # layer, then a commit.
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.choice([96, 4096, 12_345, 65_536, 98_304, 262_144], 120)]
    dest = [np.zeros(size, dtype=np.uint8) for size in sizes]
    reservation = receiver.reserve("rt", dest, deadline_s=30)
    layers = [list(range(layer * 30, (layer + 1) * 30)) for layer in range(4)]
    spec = {
        "peer": str(receiver.address),
        "request_id": "rt",
        "sizes": sizes,
        "seed": 11,
        "segments": layers,
    }
    peer = await Peer.start("sender", spec)
    try:
        await peer.expect("sent 0")
        await asyncio.wait_for(reservation.wait_committed(), 30)
        await peer.expect("committed")
    finally:
        await peer.stop()
    assert reservation.received == set(range(120))
    for index, size in enumerate(sizes):
        assert np.array_equal(dest[index], payload(11, index, size)), index


@pytest.mark.asyncio
async def test_sender_killed_mid_transfer_fails_fast_and_receiver_carries_on(
    receiver: KVReceiver,
) -> None:
    # A small first segment, then a big one (8 x 8 MiB) during which the sender dies.
    sizes = [256 * 1024] * 4 + [8 * MIB] * 8
    dest = [np.zeros(size, dtype=np.uint8) for size in sizes]
    deadline_s = 20.0
    reservation = receiver.reserve("doomed", dest, deadline_s=deadline_s)
    spec = {
        "peer": str(receiver.address),
        "request_id": "doomed",
        "sizes": sizes,
        "pattern": "fill",
        "segments": [[0, 1, 2, 3], list(range(4, 12))],
    }
    peer = await Peer.start("sender", spec)
    try:
        await peer.expect("sent 0")
        await peer.expect("posting 1")  # the big segment's bytes are about to move
        peer.proc.kill()  # SIGKILL: no goodbye on the wire
        # Endpoint error handling reports the death (PeerUnreachable), not the
        # reservation's deadline (which would raise TransferTimeout).
        with pytest.raises(PeerUnreachable):
            await reservation.wait_committed()
    finally:
        await peer.stop()
    assert reservation.done
    assert {0, 1, 2, 3} <= reservation.received
    assert reservation.received != set(range(len(sizes)))
    assert receiver.reservation("doomed") is None

    # The receiver keeps working: another process, another request.
    sizes2 = [4096] * 10
    dest2 = [np.zeros(4096, dtype=np.uint8) for _ in sizes2]
    second = receiver.reserve("after", dest2, deadline_s=20)
    spec2 = {
        "peer": str(receiver.address),
        "request_id": "after",
        "sizes": sizes2,
        "seed": 5,
        "segments": [list(range(10))],
    }
    peer2 = await Peer.start("sender", spec2)
    try:
        # Its own report first: a failure on its side then says what it was.
        await peer2.expect("committed", timeout=20)
        await asyncio.wait_for(second.wait_committed(), 5)
    finally:
        await peer2.stop()
    assert all(np.array_equal(dest2[i], payload(5, i, 4096)) for i in range(10))


@pytest.mark.asyncio
async def test_silent_sender_hits_the_deadline(receiver: KVReceiver) -> None:
    sizes = [4096] * 4
    dest = [np.zeros(4096, dtype=np.uint8) for _ in sizes]
    # Long enough for the helper, connected already, to send its first segment on a
    # busy machine; the silence that follows is what must hit it.
    deadline_s = 8.0
    spec = {
        "peer": str(receiver.address),
        "request_id": "silent",
        "sizes": sizes,
        "segments": [[0, 1], [2, 3]],
        "pause_after": 0,
        "wait_for_go": True,
    }
    peer = await Peer.start("sender", spec)
    try:
        await peer.expect("ready", timeout=60)  # started, imported, connected
        reservation = receiver.reserve("silent", dest, deadline_s=deadline_s)
        await peer.go()
        await peer.expect("paused")
        peer.proc.send_signal(signal.SIGSTOP)  # alive, connected, and silent
        # The deadline ends it (TransferTimeout), not a broken connection: the
        # stopped process is alive and still connected.
        with pytest.raises(TransferTimeout, match=r"not committed in 8\.0s"):
            await reservation.wait_committed()
    finally:
        await peer.stop()
    assert reservation.received == {0, 1}
    assert receiver.reservation("silent") is None


@pytest.mark.asyncio
async def test_send_to_a_stopped_receiver_times_out() -> None:
    spec = {"request_id": "stalled", "sizes": [4096], "deadline_s": 30}
    peer = await Peer.start("receiver", spec)
    sender = KVSender()
    try:
        address = PeerAddress.parse((await peer.expect("address")).split()[1])
        peer.proc.send_signal(signal.SIGSTOP)
        # Its deadline ends the send (a stopped process answers nothing, and is not
        # dead); "it ended" is bounded generously, the outcome is what is checked.
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(
                sender.send(address, "stalled", [(0, np.ones(4096, np.uint8))], deadline_s=1.5),
                60,
            )
    finally:
        await sender.close()
        await peer.stop()


@pytest.mark.asyncio
async def test_receiver_process_gets_exact_bytes() -> None:
    # The other direction: this process sends, a receiver process verifies.
    sizes = [100_000, 4096, 1]
    spec = {"request_id": "out", "sizes": sizes, "deadline_s": 30}
    peer = await Peer.start("receiver", spec)
    sender = KVSender()
    try:
        address = PeerAddress.parse((await peer.expect("address")).split()[1])
        sources = [payload(2, i, size) for i, size in enumerate(sizes)]
        await sender.send(address, "out", [(0, sources[0])], deadline_s=10)
        await sender.send(address, "out", [(1, sources[1]), (2, sources[2])], deadline_s=10)
        await sender.commit(address, "out", deadline_s=10)
        line = await peer.expect("committed")
        assert [int(x) for x in line.split()[1:]] == [checksum(s) for s in sources]
    finally:
        await sender.close()
        await peer.stop()


@pytest.mark.asyncio
async def test_processes_share_no_shared_memory_fifo(tmp_path: Path) -> None:
    # UCX's shared-memory transports (`mm`: sysv, posix) carry small messages through
    # one FIFO per receiving process that every sender on the host writes into, and
    # the receiver reads it in order. A sender killed between taking a slot and
    # filling it leaves a slot that never fills: from then on no message from any
    # process on the host reaches that receiver. So the data plane keeps small
    # messages on TCP and bulk bytes on CMA (`ucx_env.UCX_ENV_DEFAULTS`); UCX's own
    # report of the protocols a receiver process chose is what this checks.
    report = tmp_path / "ucx.log"
    sizes = [64, 4096, 1 << 20]
    spec = {"request_id": "lanes", "sizes": sizes, "deadline_s": 30}
    peer = await Peer.start(
        "receiver", spec, env={"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(report)}
    )
    sender = KVSender()
    try:
        address = PeerAddress.parse((await peer.expect("address")).split()[1])
        sources = [payload(4, i, size) for i, size in enumerate(sizes)]
        await sender.send(address, "lanes", list(enumerate(sources)), deadline_s=10)
        await sender.commit(address, "lanes", deadline_s=10)
        await peer.expect("committed")
    finally:
        await sender.close()
        await peer.stop()
    lanes = report.read_text()
    assert "tcp/" in lanes, lanes  # the report is there, and it names the small-message lane
    assert "sysv/" not in lanes and "posix/" not in lanes, lanes
