"""KV transfer throughput between two processes, against a plain memcpy of the same bytes.

    python benchmarks/transfer.py --json PATH [--sizes 1,16,64,256] [--repeat 7]
                                  [--page-kib 2048] [--layouts scattered,contiguous]
                                  [--device cpu|cuda]

The parent process is the sender (`KVSender`); it starts a receiver process
(`KVReceiver`, this same file with `--role receiver`) whose reservation factory hands
out pre-faulted destination buffers. Each payload is cut into KV-page-sized buffers:
2 MiB each by default (one 512-token block of one layer of a Llama-3-8B-shaped model:
8 KV heads x 128 dims x bf16 x K and V = 2 MiB), or 8 buffers of size/8 for payloads
under 16 MiB (1 MiB -> 8 x 128 KiB); `--page-kib 96` gives the pages of the default
model (SmolLM2-135M, fp32, 64-token blocks). Buffers are grouped into segments of at
most 16 MiB, as a layer-wise streamer would send them, and sent with one
`send_segments()` call: every segment posted at once (each hashed just before it is
posted, while the previous one moves), the last one carrying the commit. One timed
transfer runs from that call to its return: it includes the sender's and the
receiver's xxh3 checksums, the verification and the commit.

Two layouts: `scattered` (the headline figures): every page is its own allocation, on
both sides, so every page is one UCX message. `contiguous` (`*_contiguous` keys): the
pages are consecutive slices of one array on both sides, as consecutive pages of one
layer are in an engine's KV cache, so the sender sends runs of them as one message
(spans of up to 8 MiB).

Figures are the median over `--repeat` runs (after one warm-up); `*_best` keys give
the fastest run. `memcpy_gbps_*` is `numpy.copyto` of the same number of bytes into a
pre-faulted destination, in the same run; `xxh3_gbps_*` is one checksum pass over
them (both ends do one, which is where much of the gap to memcpy goes).

`--device cuda`: the pages are CUDA tensors in both processes (GPU 0, or the one
`CUDA_VISIBLE_DEVICES` gives each), sent and received by UCX straight from and into
device memory (cuda_ipc between two processes on one GPU). Device memory is not
checksummed (see the transport README), so the xxh3 column is absent; the baseline is
`d2d_gbps_*`, a device-to-device copy of the same bytes within one process
(`Tensor.copy_`, synchronised), and `ucx_over_d2d_*` the ratio (goal: 0.5 or more).
The receiver reports the bytes it staged (`receiver_staged_bytes`, which must be 0)
and a sum of every destination page, which the sender checks against its sources
(`device_bytes_verified`). Without CUDA it refuses to run.
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
from typing import Any

import numpy as np

from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress, SegmentHeader, checksum
from yb_dataplane.transport.ucx_env import UCX_ENV_DEFAULTS

MIB = 1 << 20
PAGE_BYTES = 2 * MIB
SEGMENT_BYTES = 16 * MIB


def layout(size_mb: float, page_bytes: int = PAGE_BYTES) -> list[int]:
    """Buffer sizes for a payload of `size_mb` MiB (see the module docstring)."""
    total = int(size_mb * MIB)
    if page_bytes == PAGE_BYTES and total < 16 * MIB:
        return [total // 8] * 8
    return [page_bytes] * (total // page_bytes)


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


def buffers(sizes: list[int], contiguous: bool, fill: int | None) -> list[np.ndarray]:
    """Pre-faulted buffers of `sizes`: separate arrays, or slices of one array."""
    if not contiguous:
        return [faulted(size, (i % 251) if fill is None else fill) for i, size in enumerate(sizes)]
    whole = faulted(sum(sizes), 0 if fill is not None else 7)
    if fill is None:
        whole[:] = np.arange(whole.nbytes, dtype=np.uint64).astype(np.uint8)
    out = []
    offset = 0
    for size in sizes:
        out.append(whole[offset : offset + size])
        offset += size
    return out


def device_buffers(sizes: list[int], contiguous: bool, fill: int | None) -> list[Any]:
    """`buffers`, as uint8 CUDA tensors (the same contents)."""
    import torch

    host = buffers(sizes, contiguous, fill)
    if not contiguous:
        out = [torch.from_numpy(b).to("cuda") for b in host]
    else:
        whole = torch.from_numpy(np.concatenate(host)).to("cuda")
        out = list(torch.split(whole, sizes))
    torch.cuda.synchronize()
    return out


def page_sums(bufs: Sequence[Any]) -> list[int]:
    """The sum of every page's bytes (a check that each page landed where it belongs)."""
    import torch

    return [int(b.to(torch.int64).sum()) for b in bufs]


def require_cuda() -> str | None:
    """None if `--device cuda` can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return f"torch {torch.__version__} ({built}) sees no CUDA device"
    return None


# -- receiver process -------------------------------------------------------------------


async def run_receiver(
    sizes_mb: list[float], page_bytes: int, layouts: list[str], ucx_host: str, device: str
) -> None:
    make = device_buffers if device == "cuda" else buffers
    destinations = {
        (str(mb), name): make(layout(mb, page_bytes), name == "contiguous", 0)
        for mb in sizes_mb
        for name in layouts
    }

    def factory(request_id: str, header: SegmentHeader) -> list[Any] | None:
        del header
        mb, name, _rep = request_id.split("-")
        return destinations.get((mb, name))

    receiver = KVReceiver(host=ucx_host)
    receiver.set_reservation_factory(factory, deadline_s=120.0)
    address = await receiver.start()
    print(address, flush=True)
    # Run until the parent closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await receiver.close()
    report: dict[str, Any] = {"staged": receiver.staged_bytes}
    if device == "cuda":
        report["sums"] = {f"{mb}-{name}": page_sums(b) for (mb, name), b in destinations.items()}
    print(json.dumps(report), flush=True)


# -- sender (parent) ---------------------------------------------------------------------


async def timed_transfer(
    sender: KVSender, peer: PeerAddress, request_id: str, bufs: list[Any]
) -> float:
    groups = segments(len(bufs), [b.nbytes for b in bufs])
    start = time.perf_counter()
    await sender.send_segments(
        peer, request_id, [[(i, bufs[i]) for i in group] for group in groups], deadline_s=60.0
    )
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


def d2d_copy_times(total: int, repeat: int) -> list[float]:
    """Seconds of each of `repeat` device-to-device copies of `total` bytes (one warm-up)."""
    import torch

    src = torch.full((total,), 7, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    times = []
    for rep in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return times


def best_of(fn: object, repeat: int) -> list[float]:
    assert callable(fn)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


async def start_receiver(
    sizes_mb: list[float], page_bytes: int, layouts: list[str], device: str
) -> tuple[asyncio.subprocess.Process, PeerAddress]:
    """A receiver process of this same file, and the address it listens on."""
    receiver = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--role",
        "receiver",
        "--sizes",
        ",".join(map(str, sizes_mb)),
        "--page-bytes",
        str(page_bytes),
        "--layouts",
        ",".join(layouts),
        "--device",
        device,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        # Its first line must be its address: UCX's own report would come first.
        env={k: v for k, v in os.environ.items() if k != "UCX_PROTO_INFO"},
    )
    assert receiver.stdout is not None
    return receiver, PeerAddress.parse((await receiver.stdout.readline()).decode())


async def run_sender(
    sizes_mb: list[float],
    repeat: int,
    page_bytes: int,
    layouts: list[str],
    perftest: bool,
    peer_address: str | None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Time the transfers; to a receiver started here, or to `peer_address` (elsewhere,
    started with the same sizes, layouts and device; its CPU time is then not measured)."""
    receiver: asyncio.subprocess.Process | None = None
    if peer_address is None:
        receiver, peer = await start_receiver(sizes_mb, page_bytes, layouts, device)
    else:
        peer = PeerAddress.parse(peer_address)
    cuda = device == "cuda"
    sender = KVSender()
    results: dict[str, Any] = {"device": device}
    rows = []
    expected: dict[str, list[int]] = {}
    try:
        for name in layouts:
            tag = "" if name == "scattered" else f"_{name}"
            for mb in sizes_mb:
                sizes = layout(mb, page_bytes)
                total = sum(sizes)
                if cuda:
                    bufs = device_buffers(sizes, name == "contiguous", None)
                    expected[f"{mb}-{name}"] = page_sums(bufs)
                else:
                    bufs = buffers(sizes, name == "contiguous", None)
                await timed_transfer(sender, peer, f"{mb}-{name}-warmup", bufs)
                rx_pid = None if receiver is None else receiver.pid
                cpu_before = (cpu_seconds(), cpu_seconds(rx_pid) if rx_pid else 0.0)
                ucx = [
                    await timed_transfer(sender, peer, f"{mb}-{name}-{rep}", bufs)
                    for rep in range(repeat)
                ]
                moved_gb = total * repeat / 1e9
                cpu_tx = (cpu_seconds() - cpu_before[0]) / moved_gb
                cpu_rx = (cpu_seconds(rx_pid) - cpu_before[1]) / moved_gb if rx_pid else None
                if cuda:
                    copy, xxh3 = d2d_copy_times(total, repeat), None
                    baseline = "d2d"
                else:
                    src = faulted(total, 7)
                    dst = faulted(total, 0)
                    copy = best_of(lambda src=src, dst=dst: np.copyto(dst, src), repeat)
                    xxh3 = best_of(lambda src=src: checksum(src), repeat)
                    baseline = "memcpy"
                    del src, dst
                gbps = {
                    "ucx": total / statistics.median(ucx) / 1e9,
                    "ucx_best": total / min(ucx) / 1e9,
                    baseline: total / statistics.median(copy) / 1e9,
                    f"{baseline}_best": total / min(copy) / 1e9,
                }
                if xxh3 is not None:
                    gbps["xxh3"] = total / statistics.median(xxh3) / 1e9
                if cuda:
                    results[f"ucx_over_d2d_{mb}mb{tag}"] = round(gbps["ucx"] / gbps["d2d"], 3)
                for key, value in gbps.items():
                    if tag and not key.startswith("ucx"):
                        continue  # the baselines do not depend on the layout
                    base = key.split("_")[0]
                    suffix = "_best" if key.endswith("_best") else ""
                    results[f"{base}_gbps_{mb}mb{tag}{suffix}"] = round(value, 3)
                results[f"sender_cpu_s_per_gb_{mb}mb{tag}"] = round(cpu_tx, 4)
                if cpu_rx is not None:
                    results[f"receiver_cpu_s_per_gb_{mb}mb{tag}"] = round(cpu_rx, 4)
                rows.append((name, mb, len(bufs), gbps, cpu_tx, cpu_rx))
                del bufs
    finally:
        await sender.close()
        if receiver is not None:
            assert receiver.stdin is not None and receiver.stdout is not None
            receiver.stdin.close()
            report_line = await asyncio.wait_for(receiver.stdout.readline(), 120)
            await asyncio.wait_for(receiver.wait(), 30)
    if receiver is not None and report_line:
        report = json.loads(report_line)
        results["receiver_staged_bytes"] = report["staged"]
        print(f"receiver staged {report['staged']} bytes (zero-copy: must be 0)")
        if cuda:
            verified = report.get("sums") == expected
            results["device_bytes_verified"] = verified
            print(f"device pages verified by their sums: {verified}")

    base = "d2d" if cuda else "memcpy"
    print(
        f"{'layout':<11} {'payload':>8} {'buffers':>8} {'ucx GB/s':>9} {'(best)':>7} "
        f"{base + ' GB/s':>12} {'ucx/' + base:>11} {'xxh3 GB/s':>10} {'CPU s/GB tx':>12} "
        f"{'rx':>6}"
    )
    for name, mb, count, gbps, cpu_tx, cpu_rx in rows:
        xxh3_text = f"{gbps['xxh3']:.2f}" if "xxh3" in gbps else "-"
        print(
            f"{name:<11} {mb:>6}MB {count:>8} {gbps['ucx']:>9.2f} {gbps['ucx_best']:>7.2f} "
            f"{gbps[base]:>12.2f} {gbps['ucx'] / gbps[base]:>10.0%} {xxh3_text:>10} "
            f"{cpu_tx:>12.3f} {'-' if cpu_rx is None else f'{cpu_rx:.3f}':>6}"
        )
    tls = os.environ.get("UCX_TLS", "all")
    pages = "2 MiB (size/8 under 16 MiB)" if page_bytes == PAGE_BYTES else f"{page_bytes} B"
    where = "CUDA device memory" if cuda else "host memory"
    print(f"UCX_TLS={tls}; pages of {pages} in {where}, segments of <=16 MiB")
    if perftest:
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
    parser.add_argument("--page-kib", type=int, default=PAGE_BYTES // 1024)
    parser.add_argument(
        "--page-bytes", type=int, help="pages of exactly this many bytes (beats --page-kib)"
    )
    parser.add_argument("--layouts", default="scattered,contiguous")
    parser.add_argument("--no-perftest", action="store_true", help="skip ucx_perftest")
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    parser.add_argument(
        "--peer", help="sender: a receiver already listening there (started with --role receiver)"
    )
    parser.add_argument(
        "--ucx-host", default="127.0.0.1", help="receiver: the address UCX listens on and announces"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the pages live in both processes (cuda: against a device-to-device copy)",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        why = require_cuda()
        if why is not None:
            parser.error(f"--device cuda needs a CUDA device: {why}")
    # Whole MiB name the figures as ever; a fraction sizes a payload of exact pages.
    sizes_mb = [int(s) if s.isdigit() else float(s) for s in args.sizes.split(",")]
    layouts = [name for name in args.layouts.split(",") if name]
    if set(layouts) - {"scattered", "contiguous"}:
        parser.error("--layouts takes scattered and/or contiguous")
    page_bytes = args.page_bytes or args.page_kib * 1024
    if args.role == "receiver":
        asyncio.run(run_receiver(sizes_mb, page_bytes, layouts, args.ucx_host, args.device))
        return
    perftest = not args.no_perftest and args.device == "cpu"
    results = asyncio.run(
        run_sender(sizes_mb, args.repeat, page_bytes, layouts, perftest, args.peer, args.device)
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
