"""The batch worker: runs the lines of the batches in JetStream, inside the gateway.

Every gateway runs one `BatchWorker` (an owned task of the service). Every
`gateway.batch_poll_s`, and at once when a batch is created or cancelled through it,
the worker lists the batches that are not done and tries to take the lease of each
(`batch_store`: a KV entry that expires unless renewed). The lease makes one gateway
the batch's worker at a time; it renews it every third of its ttl, and a gateway that
fails to renew stops working on the batch at once (cancelling its lines). A gateway
that stops, or dies, leaves the batch to whichever gateway takes the lease next.

Working on a batch (`_BatchRun`):

1. Read the input file (`batch_lines.parse_input`: the same lines at the same indices
   every time) and record the refused lines' results. The batch goes from
   `validating` to `in_progress` with its line count.
2. Run every line without a recorded result through the request path
   (`RequestRunner.run`, as a batch line), at most `batch_concurrency` lines at once in
   this gateway, each within `batch_line_timeout_s` and the batch's window (its
   deadline, which the conductor is told). A 429 or 503 is retried with a back-off
   (`retry_wait_s`: doubling from 0.5 s to 10 s, no less than the refusal's
   Retry-After, jittered) until then: the conductor refuses a batch line
   (`batch_held`) while interactive traffic uses the capacity it would take, and a
   line held back is neither a result nor a failure until its deadline passes. A
   line's result is recorded (KV `create`: once, whoever ran it) before it counts as
   done; the batch's `request_counts` follow every `batch_poll_s`.
3. Finalize: `finalizing`, the output and error files written in input order, then
   `completed` (or `cancelled` / `expired`, the lines never run going to the error
   file with `batch_cancelled` / `batch_expired`).

A batch is cancelled by its status (`cancelling`, set by the API): the worker sees it
at its next look and cancels the lines in flight. Exactly once, across restarts: a
line whose result is recorded never runs again; a line in flight when its gateway
stops gracefully is finished first (`drain`: for up to `batch_drain_s`), so it is not
run again either; only a line in flight on a gateway that dies or loses its lease runs
a second time, and its result is still recorded, and written out, once. Each run of a
line is a request of its own in the cluster, its id `<chatcmpl|cmpl>-<batch id>-<line
index>-<nonce>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
import nats.js.errors

from yb_core.config import YbConfig
from yb_core.telemetry import get_logger
from yb_gateway.batch_lines import (
    ENDPOINTS,
    BatchLine,
    ParsedInput,
    line_id,
    parse_input,
    render_results,
)
from yb_gateway.batch_store import (
    JS_ERRORS,
    TERMINAL,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchStore,
    FileObject,
    LineError,
    LineResult,
    RequestCounts,
)
from yb_gateway.errors import ApiError
from yb_gateway.render import ChatFormat, ResponseFormat, TextFormat
from yb_gateway.runner import RequestRunner, RunOptions, RunResult, decode_body
from yb_gateway.schemas import ChatCompletionRequest, CompletionRequest

log = get_logger(__name__)

#: How batch lines run: a request of the service tier its body names
#: (`service_tier`, `default` when none), marked as a batch line with its deadline
#: (`RunOptions.deadline`, set per line), which the conductor admits only into
#: idle capacity.
BATCH_RUN = RunOptions(batch=True)
#: Statuses a line retries (the cluster refused or could not take it now).
RETRIED = frozenset({429, 503})
#: The back-off between retries of one line: first and longest wait.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


def retry_wait_s(delay: float, retry_after_s: float, spread: float) -> float:
    """How long a refused line waits before its next try: the back-off `delay`, no
    less than the refusal's Retry-After, at most `RETRY_MAX_S`, times
    `0.5 + spread / 2` (`spread` in [0, 1): "equal jitter", so that lines refused
    together do not all come back at the same instant)."""
    return min(RETRY_MAX_S, max(delay, retry_after_s)) * (0.5 + 0.5 * spread)


#: How long a batch whose work failed (a bug) is left alone before it is tried again.
FAILED_BATCH_PAUSE_S = 30.0

#: The batch store of the bus now; None while the bus is down.
StoreSource = Callable[[], Awaitable[BatchStore | None]]


class _LeaseLost(Exception):
    """Another gateway holds the batch's lease now."""


class BatchWorker:
    """Works on the batches of the cluster from one gateway; see the module docstring."""

    def __init__(
        self, cfg: YbConfig, holder: str, runner: RequestRunner, stores: StoreSource
    ) -> None:
        self.cfg = cfg
        self.holder = holder
        self.runner = runner
        self._stores = stores
        #: The lines this gateway runs at once, over all its batches.
        self.slots = asyncio.Semaphore(cfg.gateway.batch_concurrency)
        self._owned: dict[str, asyncio.Task[None]] = {}
        # Batch id -> when work on it failed (it is left alone for a while then).
        self._failed: dict[str, float] = {}
        self._wake = asyncio.Event()
        #: Set once the gateway stops: no line starts any more.
        self.draining = False

    def wake(self) -> None:
        """Look for batches now (one was created or cancelled through this gateway)."""
        self._wake.set()

    @property
    def batches(self) -> list[str]:
        """The batches this gateway works on now."""
        return sorted(self._owned)

    async def run(self) -> None:
        """Find batches to work on for as long as the gateway runs (an owned task)."""
        poll_s = self.cfg.gateway.batch_poll_s
        try:
            while True:
                if not self.draining:
                    try:
                        await self._scan()
                    except (*JS_ERRORS, msgspec.DecodeError) as exc:
                        log.warning("batch_scan_failed", error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), poll_s)
                self._wake.clear()
        finally:
            await self._cancel_owned()

    async def drain(self, timeout_s: float) -> None:
        """Start no more lines; let those in flight finish and be recorded for up to
        `timeout_s`, then cancel what is left (not recorded: it runs again later)."""
        self.draining = True
        owned = list(self._owned.values())
        if owned:
            log.info("batches_draining", batches=self.batches, timeout_s=timeout_s)
            await asyncio.wait(owned, timeout=timeout_s)
        await self._cancel_owned()

    async def _cancel_owned(self) -> None:
        tasks = list(self._owned.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _scan(self) -> None:
        store = await self._stores()
        if store is None:
            return
        for batch in sorted(await store.list_batches(), key=lambda b: b.id):
            if batch.status in TERMINAL or batch.id in self._owned or self.draining:
                continue
            if time.monotonic() - self._failed.get(batch.id, -FAILED_BATCH_PAUSE_S) < (
                FAILED_BATCH_PAUSE_S
            ):
                continue
            revision = await store.acquire_lease(batch.id, self.holder)
            if not revision:
                continue  # another gateway works on it
            if self.draining:  # the gateway began to stop meanwhile
                await store.release_lease(batch.id, revision)
                return
            task = asyncio.create_task(
                self._own(store, batch.id, revision), name=f"batch:{batch.id}"
            )
            self._owned[batch.id] = task
            task.add_done_callback(functools.partial(self._forget, batch.id))

    def _forget(self, batch_id: str, task: asyncio.Task[None]) -> None:
        if self._owned.get(batch_id) is task:
            del self._owned[batch_id]
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if isinstance(exc, JS_ERRORS):
            # JetStream did not answer: the next look tries again.
            log.warning("batch_worker_interrupted", batch_id=batch_id, error=repr(exc))
        else:
            self._failed[batch_id] = time.monotonic()
            log.error("batch_worker_failed", batch_id=batch_id, error=repr(exc), exc_info=exc)

    async def _own(self, store: BatchStore, batch_id: str, revision: int) -> None:
        """Work on a batch while holding its lease; give the lease up at the end."""
        log.info("batch_lease_taken", batch_id=batch_id, holder=self.holder)
        lease = [revision]
        keeper = asyncio.create_task(self._keep_lease(store, batch_id, lease))
        work = asyncio.create_task(_BatchRun(self, store, batch_id).run())
        try:
            done, _ = await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
            else:
                keeper.result()  # raises _LeaseLost
        except _LeaseLost:
            log.warning("batch_lease_lost", batch_id=batch_id)
            lease[0] = 0
        finally:
            for task in (keeper, work):
                task.cancel()
            await asyncio.gather(keeper, work, return_exceptions=True)
            if lease[0]:
                await store.release_lease(batch_id, lease[0])

    async def _keep_lease(self, store: BatchStore, batch_id: str, lease: list[int]) -> None:
        """Renew the lease every third of its ttl; raise `_LeaseLost` once it is gone
        (another gateway holds it), or once a renewal failed for want of JetStream
        two thirds of the ttl after the last one stored (the entry may expire before
        the next try)."""
        ttl_s = self.cfg.gateway.batch_lease_ttl_s
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                lease[0] = await store.renew_lease(batch_id, self.holder, lease[0])
                renewed = time.monotonic()
            except JS_ERRORS as exc:
                wrong_revision = isinstance(exc, nats.js.errors.KeyWrongLastSequenceError)
                # Given up a third of the ttl before the entry can expire, so that
                # this gateway has stopped before another can take the lease.
                if wrong_revision or time.monotonic() - renewed >= ttl_s * 2 / 3:
                    raise _LeaseLost from exc
                log.warning("batch_lease_renew_failed", batch_id=batch_id, error=repr(exc))


class _BatchRun:
    """One batch worked on by this gateway, from wherever it stands to its end (or
    until the gateway stops)."""

    def __init__(self, worker: BatchWorker, store: BatchStore, batch_id: str) -> None:
        self.worker = worker
        self.store = store
        self.batch_id = batch_id
        gcfg = worker.cfg.gateway
        self.poll_s = gcfg.batch_poll_s
        self.line_timeout_s = gcfg.batch_line_timeout_s
        self.model = worker.cfg.model.name
        self.expires_at = float("inf")
        self.endpoint = ""
        # Index -> answered 200, for every line with a recorded result.
        self.done: dict[int, bool] = {}
        self.total = 0

    async def run(self) -> None:
        batch = await self.store.get_batch(self.batch_id)
        if batch is None or batch.status in TERMINAL:
            return
        self.expires_at = float(batch.expires_at) if batch.expires_at else float("inf")
        self.endpoint = batch.endpoint
        data = await self.store.file_bytes(batch.input_file_id)
        if data is None:
            await self._fail(
                BatchError(
                    code="input_file_missing",
                    message=f"The input file {batch.input_file_id} no longer exists.",
                    param="input_file_id",
                )
            )
            return
        parsed = parse_input(
            data, self.batch_id, batch.endpoint, self.model, self.worker.cfg.gateway.batch_max_lines
        )
        if isinstance(parsed, BatchError):
            await self._fail(parsed)
            return
        self.total = parsed.total
        recorded = await self.store.line_results(self.batch_id)
        for refused in parsed.refused:
            if refused.index not in recorded and await self.store.record_line(
                self.batch_id, refused
            ):
                recorded[refused.index] = refused
        self.done = {i: r.ok for i, r in recorded.items()}
        batch = await self.store.update_batch(self.batch_id, self._started)
        if batch is None:
            return
        log.info(
            "batch_working",
            batch_id=self.batch_id,
            status=batch.status,
            lines=self.total,
            recorded=len(self.done),
        )
        if batch.status == "cancelling":
            ending = "cancelled"
        elif batch.status == "finalizing":
            ending = "completed"
        else:
            pending = [line for line in parsed.lines if line.index not in self.done]
            ran = await self._run_lines(pending)
            if ran is None:
                return  # the gateway stops: whoever takes the lease next goes on
            ending = ran
        await self._finalize(parsed, ending)

    # --- states ---------------------------------------------------------------------

    def _counts(self) -> RequestCounts:
        completed = sum(self.done.values())
        return RequestCounts(
            total=self.total, completed=completed, failed=len(self.done) - completed
        )

    def _started(self, batch: BatchObject) -> BatchObject | None:
        counts = self._counts()
        if batch.status == "validating":
            return msgspec.structs.replace(
                batch, status="in_progress", in_progress_at=_now(), request_counts=counts
            )
        return self._progress(batch)

    def _progress(self, batch: BatchObject) -> BatchObject | None:
        counts = self._counts()
        if batch.status in TERMINAL or batch.request_counts == counts:
            return None
        return msgspec.structs.replace(batch, request_counts=counts)

    async def _fail(self, error: BatchError) -> None:
        log.warning("batch_failed", batch_id=self.batch_id, code=error.code, error=error.message)

        def failed(batch: BatchObject) -> BatchObject | None:
            if batch.status in TERMINAL:
                return None
            return msgspec.structs.replace(
                batch, status="failed", failed_at=_now(), errors=BatchErrors(data=[error])
            )

        await self.store.update_batch(self.batch_id, failed)

    # --- lines ----------------------------------------------------------------------

    async def _run_lines(self, pending: list[BatchLine]) -> str | None:
        """Run the lines; how the batch ends (`completed`, `cancelled`, `expired`),
        or None when the gateway stops first."""
        queue = iter(pending)
        lanes = [
            asyncio.create_task(self._lane(queue))
            for _ in range(min(len(pending), self.worker.cfg.gateway.batch_concurrency))
        ]
        watch = asyncio.create_task(self._watch())
        try:
            running: set[asyncio.Task[Any]] = set(lanes)
            while running and not watch.done():
                done, _ = await asyncio.wait({*running, watch}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {watch}:
                    running.discard(task)
                    task.result()  # a lane's bug ends the batch's run here
            if watch.done():
                return watch.result()
            if self.worker.draining and len(self.done) < self.total:
                return None
            return "completed"
        finally:
            for task in (*lanes, watch):
                task.cancel()
            await asyncio.gather(*lanes, watch, return_exceptions=True)
            with contextlib.suppress(*JS_ERRORS):
                await self.store.update_batch(self.batch_id, self._progress)

    async def _lane(self, queue: Iterator[BatchLine]) -> None:
        """Take lines one at a time (the lanes share `queue`) until none is left or
        the gateway stops."""
        slots = self.worker.slots
        for line in queue:
            if self.worker.draining:
                return
            async with slots:
                if self.worker.draining:
                    return
                result = await self._run_line(line)
            if result is None:
                return
            await self._record(result)

    async def _record(self, result: LineResult) -> None:
        """Record a result (JetStream may be moving: retried until it answers)."""
        delay = RETRY_FIRST_S
        while True:
            try:
                recorded = await self.store.record_line(self.batch_id, result)
                break
            except JS_ERRORS as exc:
                log.warning("batch_line_record_failed", batch_id=self.batch_id, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
        if not recorded:
            log.warning("batch_line_recorded_elsewhere", batch_id=self.batch_id, index=result.index)
        self.done[result.index] = result.ok

    async def _run_line(self, line: BatchLine) -> LineResult | None:
        """A line's result; None when the gateway stops before it has one."""
        endpoint = ENDPOINTS[self.endpoint]
        chat = endpoint == "chat.completions"
        kind: type[ChatCompletionRequest] | type[CompletionRequest] = (
            ChatCompletionRequest if chat else CompletionRequest
        )
        prefix = "chatcmpl" if chat else "cmpl"
        deadline = min(
            time.monotonic() + self.line_timeout_s,
            time.monotonic() + max(0.0, self.expires_at - time.time()),
        )
        try:
            body = decode_body(line.body, kind)
        except ApiError as exc:
            # Refused as the HTTP endpoint refuses it, before anything runs.
            request_id = f"{prefix}-{self.batch_id}-{line.index}"
            return self._result(line, RunResult.of_error(request_id, exc))
        # The conductor is told when the line is due (wall clock).
        options = dataclasses.replace(
            BATCH_RUN, deadline=time.time() + max(0.0, deadline - time.monotonic())
        )
        delay = RETRY_FIRST_S
        while True:
            request_id = f"{prefix}-{self.batch_id}-{line.index}-{uuid.uuid4().hex[:8]}"
            fmt: ResponseFormat = (
                ChatFormat(request_id, self.model) if chat else TextFormat(request_id, self.model)
            )
            left = deadline - time.monotonic()
            try:
                answer = await asyncio.wait_for(
                    self.worker.runner.run(body, fmt, endpoint, options=options), max(0.0, left)
                )
            except TimeoutError:
                return self._timed_out(line)
            if answer.status in RETRIED:
                if self.worker.draining:
                    return None
                wait = retry_wait_s(delay, answer.retry_after_s, random.random())
                if deadline - time.monotonic() > wait:
                    await asyncio.sleep(wait)
                    delay = min(RETRY_MAX_S, delay * 2)
                    continue
                # Refused until its deadline: it timed out, as docs/batch.md says.
                return self._timed_out(line)
            return self._result(line, answer)

    def _result(self, line: BatchLine, answer: RunResult) -> LineResult:
        return LineResult(
            index=line.index,
            id=line_id(self.batch_id, line.index),
            custom_id=line.custom_id,
            status_code=answer.status,
            request_id=answer.request_id,
            body=msgspec.Raw(answer.body),
        )

    def _timed_out(self, line: BatchLine) -> LineResult:
        expired = time.time() >= self.expires_at
        return LineResult(
            index=line.index,
            id=line_id(self.batch_id, line.index),
            custom_id=line.custom_id,
            error=LineError(code="batch_expired", message="The batch expired before the line ran.")
            if expired
            else LineError(
                code="line_timeout",
                message=f"The line got no answer within {self.line_timeout_s:g}s "
                "(gateway.batch_line_timeout_s).",
            ),
        )

    async def _watch(self) -> str:
        """Follow the batch while its lines run: publish the counts, and return
        `cancelled` or `expired` when it is cancelled or its window closes."""
        while True:
            await asyncio.sleep(self.poll_s)
            if time.time() >= self.expires_at:
                return "expired"
            try:
                batch = await self.store.update_batch(self.batch_id, self._progress)
            except JS_ERRORS as exc:
                log.warning("batch_progress_failed", batch_id=self.batch_id, error=repr(exc))
                continue
            if batch is None or batch.status == "cancelling":
                return "cancelled"

    # --- the end --------------------------------------------------------------------

    async def _finalize(self, parsed: ParsedInput, ending: str) -> None:
        """Write the output and error files, then the batch's final state."""

        def finalizing(batch: BatchObject) -> BatchObject | None:
            if batch.status not in ("validating", "in_progress"):
                return None
            return msgspec.structs.replace(batch, status="finalizing", finalizing_at=_now())

        batch = await self.store.update_batch(self.batch_id, finalizing)
        if batch is None or batch.status in TERMINAL:
            return
        if batch.status == "cancelling":
            ending = "cancelled"
        recorded = await self.store.line_results(self.batch_id)
        custom_ids = {line.index: line.custom_id for line in parsed.lines}
        never_run = {
            "cancelled": LineError(code="batch_cancelled", message="The batch was cancelled."),
            "expired": LineError(code="batch_expired", message="The batch expired first."),
        }.get(ending, LineError(code="not_run", message="The line was not run."))
        results = [
            recorded.get(i)
            or LineResult(
                index=i,
                id=line_id(self.batch_id, i),
                custom_id=custom_ids.get(i),
                error=never_run,
            )
            for i in range(parsed.total)
        ]
        output, errors = render_results(results)
        now = _now()
        output_id = error_id = None
        hex_id = self.batch_id.removeprefix("batch_")
        # Ids of the batch's own: a finalize done again (its gateway died in the
        # middle) writes the same files again, never a second pair.
        if output:
            output_id = f"file-{hex_id}-output"
            await self.store.put_file(
                _output_file(output_id, f"{self.batch_id}_output.jsonl", output, now), output
            )
        if errors:
            error_id = f"file-{hex_id}-errors"
            await self.store.put_file(
                _output_file(error_id, f"{self.batch_id}_errors.jsonl", errors, now), errors
            )
        completed = sum(r.ok for r in results)
        counts = RequestCounts(
            total=len(results), completed=completed, failed=len(results) - completed
        )

        def final(batch: BatchObject) -> BatchObject | None:
            if batch.status in TERMINAL:
                return None
            status = "cancelled" if batch.status == "cancelling" else ending
            stamps = {"completed": "completed_at", "cancelled": "cancelled_at"}
            return msgspec.structs.replace(
                batch,
                status=status,
                output_file_id=output_id,
                error_file_id=error_id,
                request_counts=counts,
                **{stamps.get(status, "expired_at"): now},
            )

        done = await self.store.update_batch(self.batch_id, final)
        if done is not None and done.status in TERMINAL:
            # Only now: until the final state is stored, a finalize done again needs them.
            with contextlib.suppress(*JS_ERRORS):
                await self.store.forget_lines(self.batch_id)
        log.info(
            "batch_finished",
            batch_id=self.batch_id,
            status=done.status if done else None,
            completed=counts.completed,
            failed=counts.failed,
        )


def _output_file(file_id: str, filename: str, data: bytes, now: int) -> FileObject:
    return FileObject(
        id=file_id, bytes=len(data), created_at=now, filename=filename, purpose="batch_output"
    )


def _now() -> int:
    return int(time.time())
