"""Open-loop load: every request leaves at its arrival time, whatever came before it.

A closed loop (send the next when one finishes) slows down with the server and hides
its queueing; the paper's workloads arrive on their own clock, so `LoadRunner` does
too. A concurrency cap still bounds what is in flight (a CPU cluster would otherwise
drown in connections); a request that waits for a slot records that wait as
`queued_s`, apart from its TTFT, so the table shows when the client, not the server,
was the queue.

Every request task is owned by the run: started by the dispatcher, cancelled and
awaited when the run stops (Ctrl-C sets `stop`), so a stop leaves no request running
and every planned request is accounted for: done, failed, or cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from yb_tools.bench.client import CANCELLED, BenchClient, RequestResult
from yb_tools.bench.workloads import RequestSpec


class LoadRunner:
    """Sends a workload through a `BenchClient`, open loop, with a concurrency cap."""

    def __init__(
        self,
        client: BenchClient,
        *,
        model: str,
        concurrency: int,
        deadline_s: float,
        temperature: float = 0.0,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {concurrency}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        self._client = client
        self._model = model
        self._slots = asyncio.Semaphore(concurrency)
        self._deadline_s = deadline_s
        self._temperature = temperature
        self._on_result = on_result or (lambda _r: None)
        self.in_flight = 0

    async def run(
        self, specs: Sequence[RequestSpec], stop: asyncio.Event | None = None
    ) -> tuple[list[RequestResult], float]:
        """Send every spec at its arrival time; returns one result per spec (in spec
        order) and the wall time of the run.

        When `stop` is set, no more requests leave and those in flight are cancelled
        (the gateway sees the client go and cancels them in the cluster); both kinds
        are reported as `cancelled`.
        """
        stop = stop or asyncio.Event()
        t0 = time.perf_counter()
        results: dict[int, RequestResult] = {}
        tasks: set[asyncio.Task[None]] = set()
        stopped = asyncio.ensure_future(stop.wait())
        try:
            for spec in specs:
                delay = spec.arrival_s - (time.perf_counter() - t0)
                if delay > 0 and not stop.is_set():
                    await asyncio.wait({stopped}, timeout=delay)
                if stop.is_set():
                    break
                task = asyncio.create_task(self._one(spec, t0, results), name=f"req-{spec.index}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks and not stop.is_set():
                await asyncio.wait({*tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whether stopped or cancelled from outside: nothing outlives the run.
            pending = [*tasks]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            stopped.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopped
        elapsed = time.perf_counter() - t0
        out = []
        for spec in specs:
            found = results.get(spec.index)
            if found is None:
                found = RequestResult(index=spec.index, group=spec.group, error=CANCELLED)
                found.message = "never sent: the run was stopped"
            out.append(found)
        return out, elapsed

    async def _one(self, spec: RequestSpec, t0: float, results: dict[int, RequestResult]) -> None:
        due = time.perf_counter()
        started: float | None = None
        try:
            async with self._slots:
                started = time.perf_counter()
                self.in_flight += 1
                try:
                    result = await self._client.send(
                        spec,
                        model=self._model,
                        deadline_s=self._deadline_s,
                        t0=t0,
                        temperature=self._temperature,
                        queued_s=started - due,
                    )
                finally:
                    self.in_flight -= 1
        except asyncio.CancelledError:
            results[spec.index] = RequestResult(
                index=spec.index,
                group=spec.group,
                sent_s=None if started is None else started - t0,
                error=CANCELLED,
                message="waiting for a slot when the run was stopped"
                if started is None
                else "in flight when the run was stopped",
            )
            self._on_result(results[spec.index])
            raise
        results[spec.index] = result
        self._on_result(result)
