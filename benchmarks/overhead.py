"""Where a request's time goes: the system's own overhead, with almost no compute.

Starts `yb up` with the tiny random model as a user does (no trace export) and sends
streamed `max_tokens: 1` completions: `--requests` one at a time, then `--rounds`
rounds of `--loaded-requests` with 16 and with 64 in flight. For each load it reports
latency p50/p99 (from sending the request to the end of its SSE stream) and errors over
all its rounds, and requests/s over all of them together (`latency_p50_ms_c1`,
`requests_per_s_c64`, `errors_c16`, ...), with the slowest and fastest round
(`requests_per_s_c64_round_min`, `_round_max`): this machine's speed varies from one
minute to the next, and one round says little.

The breakdown comes from a second `yb up` whose services export every span to an OTLP
receiver in this process: `--requests` one at a time again, whose latency is reported
as `traced_latency_p50_ms_c1` and `traced_latency_p99_ms_c1` (recording and exporting
each request's spans costs CPU in every service, so a traced cluster is slower than
the one measured above). With `--url` (a running cluster, which cannot export to this
process) there is no traced pass: only the loads are measured.

Each traced request is broken down by hop, from its trace
(docs/observability.md lists the spans): the hops are the intervals between
consecutive span boundaries on the request's path, from the gateway's arrival to the end
of its span, each named after the span it lies in or, between spans, after the two
boundaries it joins (`hop_ms_<name>_p50`, the median over the requests). What no span
covers is summed as `hop_ms_unattributed_p50`. The hops of one trace add up to its
gateway span (`hop_ms_gateway_total_p50`); `hop_ms_outside_gateway_p50` is the rest of
the client's latency (HTTP, request parsing before the span opens, this client itself).

Where the CPU goes under load: each process of the cluster, and this client, is read
its user + system CPU time (/proc/<pid>/stat) before and after each loaded run; the
difference over the requests answered is `cpu_ms_per_request_<process>_c<in flight>`,
the process as `yb up` names it (`gateway_0`, `conductor_0`, `prefill_0`, `decode_0`,
`nats_server`, ...), `client` for this benchmark's own HTTP client and `total` for the
cluster's sum (the client's left out). The cluster and the client share the machine's
cores, so 2 cores answer at most 2000 / (total + client) requests per second. Before
the loads, the idle cluster's CPU is read the same way over 5 s
(`idle_cpu_ms_per_s_<process>`, `idle_cpu_ms_per_s_total`: ms of CPU a second). Not
measured with `--url` (the processes are not this benchmark's to read).

The client is one keep-alive HTTP/1.1 connection per request in flight, its answers
parsed by httptools, on uvloop (`Connection`): it costs about 0.5 ms of CPU per
request, where httpx costs about 5 ms at 64 in flight: CPU taken from the cluster.
Plain HTTP only (a `--url` of `https:` is refused).

    python benchmarks/overhead.py --json out.json [--url http://127.0.0.1:8000] [--rounds 3]

Goals (issue 20, this machine): one at a time p50 <= 15 ms and p99 <= 30 ms; 64 in
flight >= 250 requests/s with no error.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httptools
import uvloop

from yb_testkit.fixtures import LocalCluster
from yb_testkit.otlp import OtlpReceiver, ReceivedSpan

T = TypeVar("T")

PROMPT = "The capital of France is"
LOADS = (16, 64)
#: A request that takes longer than this counts as an error.
REQUEST_TIMEOUT_S = 60.0
GOALS: dict[str, tuple[str, float]] = {
    "latency_p50_ms_c1": ("<=", 15.0),
    "latency_p99_ms_c1": ("<=", 30.0),
    "requests_per_s_c64": (">=", 250.0),
    "errors_c64": ("<=", 0.0),
}

#: The request's path as its spans mark it, in the order the request crosses them:
#: (span name, which end, the hop from there to the next boundary). "gateway" is the
#: request's root span; a hop named None is time the request spends in no span's hop
#: (it counts as unattributed). A boundary whose span is missing is skipped.
PATH: tuple[tuple[str, str, str | None], ...] = (
    ("gateway", "start", "tokenize"),
    ("gateway tokenize", "end", None),
    ("gateway admission", "start", "admission publish"),  # to the log, then to the conductor
    ("conductor decide", "start", "conductor decide"),
    ("conductor decide", "end", "decision delivery"),  # to the log, then to the gateway
    ("gateway admission", "end", None),
    ("gateway hand-off", "start", "hand-off"),  # the job to prefill's queue
    ("prefill", "start", "prefill queue wait"),
    ("prefill queue wait", "end", "prefill own"),
    # The reservation on decode runs beside the prefix load and the compute (its spans
    # are reported on their own, `span_ms_prefill_reserve_decode_p50`), and so does
    # `kv transfer`; after the compute, what is left of them, and decode's verified
    # commit.
    ("prefill prefix load", "start", "prefix load"),
    ("prefill prefix load", "end", "prefill own"),
    ("prefill compute", "start", "compute"),
    ("prefill compute", "end", "after compute"),
    ("kv transfer", "end", "prefill own"),
    ("prefill hand-over", "start", "hand-over"),
    ("decode", "start", "decode admission"),
    ("decode first token", "start", "first token"),
    ("decode first token", "end", "sse"),  # the token back to the gateway and its SSE chunk
    ("gateway", "end", None),
)
#: Each span's own duration is reported too (`span_ms_<name>_p50`), those beside the
#: path's included.
SPANS = (
    *dict.fromkeys(name for name, _, _ in PATH if name != "gateway"),
    "prefill reserve decode",
    "decode reserve",
)


@dataclass
class Load:
    """What one load measured."""

    in_flight: int
    latencies_s: list[float] = field(default_factory=list)
    latency_by_request: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @classmethod
    def pooled(cls, rounds: list[Load]) -> Load:
        """Several rounds of one load as one: every latency and error, the time of all
        (so its requests/s is what the rounds sustained together)."""
        pooled = cls(rounds[0].in_flight)
        for load in rounds:
            pooled.latencies_s += load.latencies_s
            pooled.latency_by_request |= load.latency_by_request
            pooled.errors += load.errors
            pooled.elapsed_s += load.elapsed_s
        return pooled

    def figures(self) -> dict[str, float | int]:
        c = self.in_flight
        ms = sorted(x * 1000 for x in self.latencies_s)
        return {
            f"latency_p50_ms_c{c}": round(percentile(ms, 50), 2),
            f"latency_p99_ms_c{c}": round(percentile(ms, 99), 2),
            f"requests_per_s_c{c}": round(len(ms) / self.elapsed_s, 1) if self.elapsed_s else 0,
            f"requests_c{c}": len(ms) + len(self.errors),
            f"errors_c{c}": len(self.errors),
        }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_request(
    before: dict[str, float], after: dict[str, float], answered: int, in_flight: int
) -> dict[str, float]:
    """`cpu_ms_per_request_<process>_c<in_flight>` from two readings of CPU seconds by
    process (`client` is this process, left out of `total`)."""
    if not answered:
        return {}
    ms = {name: (after[name] - before[name]) * 1000 / answered for name in before}
    ms["total"] = sum(v for name, v in ms.items() if name != "client")
    return {
        f"cpu_ms_per_request_{_key(name)}_c{in_flight}": round(v, 2)
        for name, v in sorted(ms.items())
    }


#: How long the idle cluster's CPU is read for (s), after its warm-up requests.
IDLE_S = 5.0


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """`idle_cpu_ms_per_s_<process>` and `_total`: the CPU each process of a cluster
    that serves nothing spends a second (heartbeats, load reports, UCX's progress
    threads), read over `seconds` after a second's pause."""
    time.sleep(1.0)
    before = cpu_readings(pids)
    time.sleep(seconds)
    after = cpu_readings(pids)
    ms = {name: (after[name] - before[name]) * 1000 / seconds for name in pids}
    ms["total"] = sum(ms.values())
    return {f"idle_cpu_ms_per_s_{_key(name)}": round(v, 1) for name, v in sorted(ms.items())}


def cpu_readings(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each of `pids` and of this process (`client`)."""
    readings = {name: cpu_seconds(pid) for name, pid in pids.items()}
    readings["client"] = cpu_seconds(os.getpid())
    return readings


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """`coroutine` to its end on uvloop, the loop the services run on (the client's
    CPU is the machine's too)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def percentile(sorted_values: list[float], p: float) -> float:
    """The nearest-rank percentile of an ascending list (0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * p // 100))
    return sorted_values[int(rank) - 1]


class Connection:
    """One keep-alive HTTP/1.1 connection to the gateway, its answers parsed by
    httptools (the C parser the gateway's uvicorn uses).

    The client shares the machine's cores with the cluster it measures, so it must
    cost little: httpx spent about 5 ms of CPU per request at 64 in flight, a third of
    the whole cluster's; this costs a fraction of a millisecond
    (`cpu_ms_per_request_client_c64`).
    """

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parsed = urlsplit(url)
        if parsed.scheme != "http":
            raise ValueError(f"{url}: this client speaks plain HTTP only")
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST, on this connection (opened when it is not)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._head}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        answer = _Answer()
        parser = httptools.HttpResponseParser(answer)
        try:
            while not answer.complete:
                data = await self._reader.read(65536)
                if not data:
                    raise ConnectionError("the gateway closed the connection mid-answer")
                parser.feed_data(data)
        except BaseException:
            self.close()
            raise
        if not parser.should_keep_alive():
            self.close()
        return parser.get_status_code(), b"".join(answer.body)

    def close(self) -> None:
        """Drop the connection (the next request opens another)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class _Answer:
    """httptools' callbacks for one response: its body, and when it is complete."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = False

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.complete = True


async def one_request(connection: Connection, model: str) -> tuple[float, str]:
    """(seconds to the stream's `[DONE]`, the request id) of one streamed completion;
    raises when it fails or its stream ends without a token or `[DONE]`."""
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    started = time.perf_counter()
    status, answer = await connection.post("/v1/completions", body)
    elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {answer[:200]!r}")
    request_id = ""
    done = False
    for line in answer.decode().splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            request_id = request_id or chunk.get("id", "")
    if not (done and request_id):
        raise RuntimeError("the stream ended without a chunk and [DONE]")
    return elapsed, request_id


async def run_load(
    url: str, headers: dict[str, str], model: str, in_flight: int, requests: int
) -> Load:
    """`requests` completions, `in_flight` at a time: as many workers, each on its own
    connection, each sending its next request as soon as its last one ended."""
    load = Load(in_flight)
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        connection = Connection(url, headers)
        try:
            while remaining > 0:
                remaining -= 1
                try:
                    latency, request_id = await asyncio.wait_for(
                        one_request(connection, model), REQUEST_TIMEOUT_S
                    )
                except Exception as error:  # counted, the load goes on
                    load.errors.append(f"{type(error).__name__}: {error}")
                    continue
                load.latencies_s.append(latency)
                load.latency_by_request[request_id] = latency
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    load.elapsed_s = time.perf_counter() - started
    return load


# --- the breakdown ----------------------------------------------------------------


def traces_by_request(
    spans: list[ReceivedSpan], request_ids: set[str]
) -> dict[str, list[ReceivedSpan]]:
    """The spans of each request's trace, by request id."""
    trace_of = {
        s.trace_id: str(s.attributes["yb.request_id"])
        for s in spans
        if s.service == "yuebing-gateway"
        and s.parent_span_id == ""
        and s.attributes.get("yb.request_id") in request_ids
    }
    out: dict[str, list[ReceivedSpan]] = {rid: [] for rid in trace_of.values()}
    for s in spans:
        if s.trace_id in trace_of:
            out[trace_of[s.trace_id]].append(s)
    return out


def complete(trace: list[ReceivedSpan]) -> bool:
    """The trace has its root and every span of the path and beside it (its processes
    exported them)."""
    return {name for name, _, _ in PATH} | set(SPANS) <= {_name(s) for s in trace}


def _name(span: ReceivedSpan) -> str:
    # The root is `gateway completions` or `gateway chat.completions`.
    return "gateway" if span.parent_span_id == "" else span.name


def _key(name: str) -> str:
    return name.replace(" ", "_").replace("-", "_").replace(".", "_")


def hops(trace: list[ReceivedSpan]) -> dict[str, float]:
    """One request's time in ms by hop: from each boundary of PATH to the next, named
    as PATH names it; `unattributed` sums the intervals PATH names None, and `total` is
    the gateway's span. A boundary earlier than the one before it (a span that began
    before the previous one ended) starts its hop at the previous boundary instead."""
    spans = {_name(s): s for s in trace}
    points = [
        (hop, spans[name].start_ns if end == "start" else spans[name].end_ns)
        for name, end, hop in PATH
        if name in spans
    ]
    out = {hop: 0.0 for _, _, hop in PATH if hop is not None}
    out["unattributed"] = 0.0
    at = points[0][1]
    for (hop, _), (_, t) in itertools.pairwise(points):
        if t <= at:
            continue
        out[hop or "unattributed"] += (t - at) / 1e6
        at = t
    root = spans["gateway"]
    out["gateway total"] = (root.end_ns - root.start_ns) / 1e6
    return out


def breakdown(
    receiver: OtlpReceiver, serial: Load, timeout_s: float
) -> tuple[dict[str, float], int]:
    """Median ms per hop (`hop_ms_*`) and per span (`span_ms_*`) over the requests of
    `serial` whose traces arrived whole, and their count."""
    wanted = set(serial.latency_by_request)
    deadline = time.monotonic() + timeout_s
    while True:
        traces = traces_by_request(receiver.spans(), wanted)
        whole = {rid: t for rid, t in traces.items() if complete(t)}
        if len(whole) == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    rows: list[dict[str, float]] = []
    for rid, trace in whole.items():
        row = {f"hop_ms_{_key(hop)}": ms for hop, ms in hops(trace).items()}
        # The HTTP exchange around the gateway's span: connection, request parsing
        # before its arrival time, and the stream's last bytes to the client.
        row["hop_ms_outside_gateway"] = (
            serial.latency_by_request[rid] * 1000 - row["hop_ms_gateway_total"]
        )
        spans = {_name(s): s for s in trace}
        for name in SPANS:
            row[f"span_ms_{_key(name)}"] = (spans[name].end_ns - spans[name].start_ns) / 1e6
        rows.append(row)
    medians = {
        f"{key}_p50": round(statistics.median(row[key] for row in rows), 3)
        for key in (rows[0] if rows else {})
    }
    return medians, len(rows)


def dump(trace: list[ReceivedSpan]) -> None:
    """One trace's spans, relative to its root, on stderr."""
    t0 = min(s.start_ns for s in trace)
    for s in sorted(trace, key=lambda s: s.start_ns):
        began, ended = (s.start_ns - t0) / 1e6, (s.end_ns - t0) / 1e6
        print(f"  {began:8.3f} {ended:8.3f}  {s.service:<18} {s.name}", file=sys.stderr)


def tiny_cluster(model: str, env: dict[str, str] | None = None) -> LocalCluster:
    """`yb up` with the tiny random model served as `model`, started (its environment
    plus `env`)."""
    cluster = LocalCluster(
        Path(tempfile.mkdtemp(prefix="yb-overhead-")),
        "--model",
        "tiny-random",
        "--model-name",
        model,
        env=env,
    )
    started = time.perf_counter()
    cluster.start(timeout_s=300)
    print(f"cluster ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return cluster


def measure_loads(
    url: str, headers: dict[str, str], args: argparse.Namespace, pids: dict[str, int]
) -> tuple[dict[str, float | int], list[str]]:
    """The loads' figures on the cluster at `url`, and their errors; with the `pids` of
    its processes, their CPU per request at the highest load."""
    run(run_load(url, headers, args.model, 1, args.warmup))
    cpu: dict[str, float] = idle_cpu(pids, IDLE_S) if pids else {}
    loads = [run(run_load(url, headers, args.model, 1, args.requests))]
    spread: dict[str, float | int] = {}
    for c in LOADS:
        before = cpu_readings(pids)
        rounds = [
            run(run_load(url, headers, args.model, c, args.loaded_requests))
            for _ in range(args.rounds)
        ]
        loads.append(Load.pooled(rounds))
        rates = [len(r.latencies_s) / r.elapsed_s for r in rounds if r.elapsed_s]
        if rates:
            spread[f"requests_per_s_c{c}_round_min"] = round(min(rates), 1)
            spread[f"requests_per_s_c{c}_round_max"] = round(max(rates), 1)
        if pids:
            cpu |= cpu_per_request(before, cpu_readings(pids), len(loads[-1].latencies_s), c)
    figures: dict[str, float | int] = {"rounds": args.rounds}
    for load in loads:
        figures |= load.figures()
    return figures | spread | cpu, [e for load in loads for e in load.errors]


def measure_breakdown(args: argparse.Namespace) -> tuple[dict[str, float | int], list[str]]:
    """One request at a time through a cluster that exports its spans here: its
    latency (`traced_*`) and the median hops of the requests whose traces arrived."""
    receiver = OtlpReceiver().start()
    cluster = None
    try:
        cluster = tiny_cluster(
            args.model,
            {
                "YB_TELEMETRY__OTLP_ENDPOINT": receiver.http_endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "1000",
            },
        )
        url, headers = cluster.url, cluster.headers
        run(run_load(url, headers, args.model, 1, args.warmup))
        serial = run(run_load(url, headers, args.model, 1, args.requests))
        c1 = serial.figures()
        figures: dict[str, float | int] = {
            "traced_latency_p50_ms_c1": c1["latency_p50_ms_c1"],
            "traced_latency_p99_ms_c1": c1["latency_p99_ms_c1"],
        }
        per_hop, traced = breakdown(receiver, serial, timeout_s=30)
        figures["traced_requests_c1"] = traced
        figures |= per_hop
        if args.dump_trace and serial.latency_by_request:
            trace = traces_by_request(receiver.spans(), {next(iter(serial.latency_by_request))})
            for t in trace.values():
                dump(t)
        return figures, serial.errors
    finally:
        if cluster is not None:
            cluster.stop()
        receiver.close()


def main() -> int:
    """Run the loads and the traced pass, and print/write the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway (default: start `yb up`)")
    parser.add_argument("--api-key", help="the gateway's API key, with --url")
    parser.add_argument("--model", default="tiny", help="the served model name")
    parser.add_argument("--requests", type=int, default=100, help="one at a time")
    parser.add_argument("--loaded-requests", type=int, default=512, help="per loaded round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each load (16, 64 in flight)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="requests before measuring")
    parser.add_argument("--dump-trace", action="store_true", help="print one trace's spans")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.url:
        if urlsplit(args.url).scheme != "http":
            parser.error(f"--url {args.url}: plain http:// only (the client speaks no TLS)")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        figures, errors = measure_loads(args.url, headers, args, {})
    else:
        cluster = tiny_cluster(args.model)
        try:
            figures, errors = measure_loads(cluster.url, cluster.headers, args, cluster.pids)
        finally:
            cluster.stop()
        traced, traced_errors = measure_breakdown(args)
        figures |= traced
        errors += traced_errors
    for error in sorted(set(errors))[:10]:
        print(f"error: {error}", file=sys.stderr)

    print(f"{'load':<16} {'requests/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}")
    for c in (1, *LOADS):
        print(
            f"{f'{c} in flight':<16} {figures[f'requests_per_s_c{c}']:>10} "
            f"{figures[f'latency_p50_ms_c{c}']:>9} {figures[f'latency_p99_ms_c{c}']:>9} "
            f"{figures[f'errors_c{c}']:>7}"
        )
    print(f"\n{'figure':<44} {'value':>10}  goal")
    for name, value in figures.items():
        note = ""
        if name in GOALS:
            op, target = GOALS[name]
            ok = value <= target if op == "<=" else value >= target
            note = f"{op} {target:g}  {'met' if ok else 'NOT met'}"
        print(f"{name:<44} {value:>10}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
