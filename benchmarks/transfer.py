"""KV transfer throughput between two processes, against a plain memcpy of the same bytes.

    python benchmarks/transfer.py --json PATH [--sizes 1,16,64,256] [--repeat 7]

The parent process is the sender (`KVSender`); it starts a receiver process
(`KVReceiver`, this same file with `--role receiver`) whose reservation factory hands
out pre-faulted destination buffers. Each payload is cut into KV-page-sized buffers:
2 MiB each (one 512-token block of one layer of a Llama-3-8B-shaped model: 8 KV heads x
128 dims x bf16 x K and V = 2 MiB), or 8 buffers of size/8 for payloads under 16 MiB
(1 MiB -> 8 x 128 KiB). Buffers are grouped into segments of at most 16 MiB, as a
layer-wise streamer would send them, all posted at once, then committed. One timed
transfer runs from the first `send()` to the end of `commit()`: it includes the
sender's and the receiver's xxh3 checksums, the verification and the commit round trip.

Figures are the median over `--repeat` runs (after one warm-up); `*_best` keys give
the fastest run. `memcpy_gbps_*` is `numpy.copyto` of the same number of bytes into a
pre-faulted destination, in the same run; `xxh3_gbps_*` is one checksum pass over
them (both ends do one, which is where much of the gap to memcpy goes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from yb_shared.transport import KVReceiver, KVSender, PeerAddress, SegmentHeader, checksum
from yb_shared.transport.ucx_env import UCX_ENV_DEFAULTS

MIB = 1 << 20
PAGE_BYTES = 2 * MIB
SEGMENT_BYTES = 16 * MIB


def layout(size_mb: int) -> list[int]:
    """Buffer sizes for a payload of `size_mb` MiB (see the module docstring)."""
    total = size_mb * MIB
    if total < 16 * MIB:
        return [total // 8] * 8
    return [PAGE_BYTES] * (total // PAGE_BYTES)


def segments(count: int, sizes: Sequence[int]) -> list[list[int]]:
    """Group buffer indices into segments of at most SEGMENT_BYTES."""
    groups: list[list[int]] = [[]]
    used = 0
    for index in range(count):
        if groups[-1] and used + sizes[index] > SEGMENT_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += sizes[index]
    return groups


def faulted(size: int, fill: int) -> np.ndarray:
    buf = np.empty(size, dtype=np.uint8)
    buf.fill(fill)  # touch every page now, not inside a timed run
    return buf


# -- receiver process -------------------------------------------------------------------


async def run_receiver(sizes_mb: list[int]) -> None:
    destinations = {mb: [faulted(size, 0) for size in layout(mb)] for mb in sizes_mb}

    def factory(request_id: str, header: SegmentHeader) -> list[np.ndarray] | None:
        del header
        mb = int(request_id.split("-")[0])
        return destinations.get(mb)

    receiver = KVReceiver()
    receiver.set_reservation_factory(factory, deadline_s=120.0)
    address = await receiver.start()
    print(address, flush=True)
    # Run until the parent closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await receiver.close()


# -- sender (parent) ---------------------------------------------------------------------


async def timed_transfer(
    sender: KVSender, peer: PeerAddress, request_id: str, bufs: list[np.ndarray]
) -> float:
    groups = segments(len(bufs), [b.nbytes for b in bufs])
    start = time.perf_counter()
    await asyncio.gather(
        *(
            sender.send(peer, request_id, [(i, bufs[i]) for i in group], deadline_s=60.0)
            for group in groups
        )
    )
    await sender.commit(peer, request_id, deadline_s=60.0)
    return time.perf_counter() - start


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) used so far by this process, or by process `pid`."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def perftest_gbps(size: int, total: int) -> float | None:
    """UCX's own C benchmark, `ucx_perftest -t tag_bw`, for messages of `size` bytes.

    Error handling on and our UCX settings: what UCX itself reaches between two
    processes on this machine, with no Python, no protocol and no checksums. It sends
    the same buffer over and over: a 2 MiB one stays in cache (an upper bound), a 64 MiB
    one does not (memory-bound, like our runs). None if the libucx wheel ships no
    ucx_perftest.
    """
    try:
        import libucx  # the wheel that ships UCX and its tools
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**os.environ, **UCX_ENV_DEFAULTS, "LD_LIBRARY_PATH": str(root / "lib")}
    common = [str(binary), "-p", port, "-e", "-f"]
    iters = str(max(20, total // size))
    server = subprocess.Popen(common, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # let the server listen
        client = [*common, "127.0.0.1", "-t", "tag_bw", "-s", str(size), "-n", iters]
        out = subprocess.run(client, env=env, capture_output=True, text=True, timeout=120).stdout
    finally:
        if server.poll() is None:
            server.wait(timeout=30)
    # The last row: iterations, overhead x3 (us), bandwidth average and overall (MB/s),
    # message rate x2.
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == [iters]]
    if not rows or len(rows[-1]) != 8:
        return None
    return float(rows[-1][5]) * MIB / 1e9


def best_of(fn: object, repeat: int) -> list[float]:
    assert callable(fn)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


async def run_sender(sizes_mb: list[int], repeat: int) -> dict[str, float]:
    receiver = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--role",
        "receiver",
        "--sizes",
        ",".join(map(str, sizes_mb)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert receiver.stdout is not None and receiver.stdin is not None
    peer = PeerAddress.parse((await receiver.stdout.readline()).decode())
    sender = KVSender()
    results: dict[str, float] = {}
    rows = []
    try:
        for mb in sizes_mb:
            total = mb * MIB
            bufs = [faulted(size, i % 251) for i, size in enumerate(layout(mb))]
            await timed_transfer(sender, peer, f"{mb}-warmup", bufs)
            cpu_before = (cpu_seconds(), cpu_seconds(receiver.pid))
            ucx = [await timed_transfer(sender, peer, f"{mb}-{rep}", bufs) for rep in range(repeat)]
            moved_gb = total * repeat / 1e9
            cpu_tx = (cpu_seconds() - cpu_before[0]) / moved_gb
            cpu_rx = (cpu_seconds(receiver.pid) - cpu_before[1]) / moved_gb
            src = faulted(total, 7)
            dst = faulted(total, 0)
            memcpy = best_of(lambda src=src, dst=dst: np.copyto(dst, src), repeat)
            xxh3 = best_of(lambda src=src: checksum(src), repeat)
            gbps = {
                "ucx": total / statistics.median(ucx) / 1e9,
                "ucx_best": total / min(ucx) / 1e9,
                "memcpy": total / statistics.median(memcpy) / 1e9,
                "memcpy_best": total / min(memcpy) / 1e9,
                "xxh3": total / statistics.median(xxh3) / 1e9,
            }
            for key, value in gbps.items():
                name = key.split("_")[0]
                suffix = "_best" if key.endswith("_best") else ""
                results[f"{name}_gbps_{mb}mb{suffix}"] = round(value, 3)
            results[f"sender_cpu_s_per_gb_{mb}mb"] = round(cpu_tx, 4)
            results[f"receiver_cpu_s_per_gb_{mb}mb"] = round(cpu_rx, 4)
            rows.append((mb, len(bufs), gbps, cpu_tx, cpu_rx))
            del src, dst, bufs
    finally:
        await sender.close()
        receiver.stdin.close()
        await asyncio.wait_for(receiver.wait(), 30)

    print(
        f"{'payload':>8} {'buffers':>8} {'ucx GB/s':>9} {'(best)':>7} "
        f"{'memcpy GB/s':>12} {'ucx/memcpy':>11} {'xxh3 GB/s':>10} {'CPU s/GB tx':>12} "
        f"{'rx':>6}"
    )
    for mb, count, gbps, cpu_tx, cpu_rx in rows:
        print(
            f"{mb:>6}MB {count:>8} {gbps['ucx']:>9.2f} {gbps['ucx_best']:>7.2f} "
            f"{gbps['memcpy']:>12.2f} {gbps['ucx'] / gbps['memcpy']:>10.0%} {gbps['xxh3']:>10.2f} "
            f"{cpu_tx:>12.3f} {cpu_rx:>6.3f}"
        )
    tls = os.environ.get("UCX_TLS", "all")
    print(f"UCX_TLS={tls}; buffers of 2 MiB (size/8 under 16 MiB), segments of <=16 MiB")
    for label, size in (("2mib", PAGE_BYTES), ("64mib", 64 * MIB)):
        ceiling = perftest_gbps(size, 512 * MIB)
        if ceiling is not None:
            results[f"ucx_perftest_gbps_{label}_messages"] = round(ceiling, 3)
            print(
                f"ucx_perftest tag_bw, one {label} buffer resent (C, no checksums, same UCX "
                f"settings): {ceiling:.2f} GB/s"
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--sizes", default="1,16,64,256", help="payload sizes, MiB")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    args = parser.parse_args()
    sizes_mb = [int(s) for s in args.sizes.split(",")]
    if args.role == "receiver":
        asyncio.run(run_receiver(sizes_mb))
        return
    results = asyncio.run(run_sender(sizes_mb, args.repeat))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
