"""What a prefill instance does with its engine: the job queue and each job's phases.

A job runs in four phases, each with a deadline: reserve pages on the decode
instance the conductor chose (`_reserve_on_decode`), load the planned prefix into
pages here (`_load_prefix`), compute the rest while streaming every page to decode
layer by layer and commit (`_compute_and_stream`), and hand the request over with
its first token (`_hand_over`). The reservation's round trip runs beside the load
and the compute: what they complete meanwhile is queued, and streamed once decode
has answered. Compute is wasted only when decode refuses, which the conductor's
plan makes rare; waiting for the answer before computing would add its round trip
to every request.

The engine runs one group of jobs at a time (one job, or several short prompts
computed in one forward pass: `batching.py`), but a job needs it only to compute:
once its group's compute has ended, the next group in the queue starts while the KV
still on its way to decode is committed and the request handed over (at most
`MAX_FINISHING` groups' worth of jobs at once). Those ends are round trips to the
decode instance; waiting for them before the next compute made the engine idle for
most of each job under load.
A job's KV goes out once the group before its own to the same decode instance has
carried data (the first stream of each group waits for the first of the group
before; the others of a group, for their group's first: see `_compute_and_stream`):
meanwhile it computes, and what it computes waits.

A batch line's job (`PrefillJob.preemptible`) computing alone is the exception to
"one group at a time": when a job of a higher priority is queued, its engine call
holds between two layers (`yb_engine.pausing`; on a tensor-parallel engine every
rank holds at the same layer) and the other job starts meanwhile, computing on the
same engine thread; the line goes on from the next layer once that has left the
engine (`preemption.py`). Every other job, once started, computes to its end (the
stage of a prefill group, `stage.py`, never pauses its jobs).

Whatever ends a job early gives back what it held: the decode reservation, and its
pages here (its full blocks stay cached, the new ones are uploaded to the host's
kvstore in the background).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.block_events import AnyBlockEvent, BlockEventPublisher, BlockLog
from yb_core.failpoints import Failpoints
from yb_core.outbox import Outbox
from yb_core.telemetry import (
    bind_request,
    child_span,
    extract_context,
    get_logger,
    inject_headers,
    trace_id_hex,
    tracer,
    wall_time_ns,
)
from yb_dataplane.block_upload import BlockUploader, blocks_to_store, full_blocks
from yb_dataplane.prefix_fetch import PrefixLoadFailed
from yb_dataplane.transport import PeerAddress, TransferError
from yb_dataplane.worker import Capacity, Worker, WorkerContext, decided_before
from yb_engine.choice_sampling import Sampled, sample_first_tokens
from yb_engine.host import EngineGauges, EngineHost
from yb_engine.kv_cache import OutOfPages
from yb_engine.pausing import EnginePause
from yb_engine.runner import LayerReady, PrefillSeq, RowLogits
from yb_engine.tensor_parallel import transfer_cuts
from yb_prefill.batching import ComputeBatch, Outcome, take_group
from yb_prefill.decode_link import DecodeLink
from yb_prefill.failure import JobOwner
from yb_prefill.job_queue import JobQueue, Liveness, QueuedJob, refusal, take_job
from yb_prefill.preemption import EngineTurn, Pauses
from yb_prefill.prefix_cache import PrefixCache
from yb_prefill.prompt_logprobs import PromptScorer
from yb_prefill.reuse import Prefix, PrefixLoader
from yb_prefill.streaming import LayerStreamer

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)
_tracer = tracer(__name__)

MAX_QUEUE = 256
#: Groups past their compute whose commits and hand-overs may still be under way
#: while the next group computes: the queue starts no job while `MAX_FINISHING` times
#: `batch_jobs` jobs are started and not ended.
MAX_FINISHING = 4
#: How often a preemptible job's compute looks again whether the queue's head
#: outranks it, besides at each new job (the head may be waiting for pages).
PAUSE_CHECK_S = 0.01
T = TypeVar("T")

#: A job's compute on the engine thread: (job, its pages, tokens cached, its stream).
_Part = tuple[pr.PrefillJob, list[int], int, LayerStreamer]


@dataclass(frozen=True, slots=True)
class _Lead:
    """The first stream of the last group of jobs to one decode instance (`group`:
    its `ComputeBatch`, None for a job alone)."""

    group: object | None
    stream: LayerStreamer


@dataclass(frozen=True, slots=True)
class _Computed:
    """The outcome of the compute phase."""

    first: list[Sampled]  # each choice's first token
    at: float  # monotonic time the compute ended (streaming may have gone on)
    handed_over: bool  # the hand-over rode on the commit (decode has the request)


class PrefillMetrics:
    """What a prefill instance exports besides the engine's gauges and the transport's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefill = Histogram(
            "yb_prefill_seconds",
            "Prefill time per request (compute and KV streaming)",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.jobs = Counter(
            "yb_prefill_jobs_total", "Jobs by outcome", ["outcome"], registry=registry
        )
        self.tokens = Counter(
            "yb_prefill_tokens_total", "Prompt tokens computed", registry=registry
        )
        self.prompt_logprobs = Counter(
            "yb_prefill_prompt_logprobs_total",
            "Jobs that asked for their prompt's logprobs (computed from the first token)",
            registry=registry,
        )
        self.prompt_logprobs_recomputed = Counter(
            "yb_prefill_prompt_logprobs_recomputed_tokens_total",
            "Prompt tokens whose planned KV reuse was dropped to compute the prompt's "
            "logprobs (a full prefill instead of a reused one)",
            registry=registry,
        )
        self.reused = Counter(
            "yb_prefill_reused_tokens_total",
            "Prompt tokens whose KV was reused, by where it came from",
            ["source"],
            registry=registry,
        )
        self.fetch = Histogram(
            "yb_prefill_prefix_fetch_seconds",
            "Time to pull a planned prefix from kvstores",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
        )
        self.fetch_failures = Counter(
            "yb_prefill_prefix_fetch_failures_total",
            "Planned prefix fetches that failed (recomputed instead)",
            registry=registry,
        )
        self.puts = Counter(
            "yb_prefill_block_puts_total",
            "Blocks put into the host's kvstore, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.batch_jobs = Histogram(
            "yb_prefill_batch_jobs",
            "Jobs started together, whose prompts compute in one forward pass",
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64),
        )
        self.preemptions = Counter(
            "yb_prefill_preemptions_total",
            "Pauses of a batch line's compute between two layers for a job of a higher priority",
            registry=registry,
        )
        self.cached = Gauge(
            "yb_prefill_engine_cache_blocks",
            "Blocks kept in the engine's own pages",
            registry=registry,
        )


class PrefillWorker(JobOwner, Worker):
    """Runs prefill jobs one at a time on one engine and streams their KV to decode."""

    # It streams KV to decode instances, and puts blocks into / fetches from kvstores.
    preconnect_roles = frozenset({"decode", "kvstore"})

    def __init__(
        self,
        context: WorkerContext,
        engine: EngineHost,
        metrics: PrefillMetrics,
        gauges: EngineGauges,
    ) -> None:
        cfg = context.cfg
        self.instance_id = context.instance_id
        self.cfg = cfg
        self.pcfg = cfg.prefill
        self.bus = context.bus
        self.peers = context.peers
        self.sender = context.sender
        self.tasks = context.tasks
        self.engine = engine
        self.decode = DecodeLink(context.bus)
        # Progress and outcomes reach the log in order without a job waiting for them.
        self.outbox = Outbox(context.bus)
        self.gauges = gauges
        self.gauges.follow(engine)
        self.metrics = metrics
        self.block_log = BlockLog(self.instance_id)
        self.cache = PrefixCache(
            engine.allocator,
            engine.prefix_cache_pages,
            self.block_log,
            self._emit_block_event,
        )
        # Idle, the engine holds exactly its cached blocks: any page used beyond them
        # is held for a request (which is how a leak shows).
        cache = self.cache
        self.metrics.cached.set_function(lambda: len(cache))
        self.publisher = BlockEventPublisher(context.bus, self.block_log, self.cache.inventory)
        self.loader = PrefixLoader(
            self.instance_id, self.cache, engine.cache, context.peers, context.receiver, self.sender
        )
        self.uploader = BlockUploader(
            engine.cache, self.sender, deadline_s=self.pcfg.transfer_timeout_s
        )
        self._queue = JobQueue(maxsize=MAX_QUEUE)
        # The jobs started and not ended (one computes, the others finish their
        # transfer), and the request on the engine, if any.
        self._jobs: set[asyncio.Task[None]] = set()
        # The uploads to the kvstore in flight: each holds its blocks' pages.
        self._uploads: set[asyncio.Task[None]] = set()
        # The first stream of the group that started last to each decode instance
        # (`_compute_and_stream`).
        self._streams: dict[str, _Lead] = {}
        # The batch each job of a group of several computes in (by id of the job).
        self._batch_of: dict[int, ComputeBatch[_Part, list[Sampled]]] = {}
        # The prompt logprobs the engine thread computed for a job (by id of the job),
        # until its hand-over takes them; and the scorer each chunk's logits go to while
        # it computes (across the parts of a compute split by a test failpoint).
        self._prompt_logprobs: dict[int, list[pr.TokenLogprob]] = {}
        self._scorers: dict[int, PromptScorer] = {}
        self.liveness = Liveness()
        # The preemptible jobs paused (`preemption.py`).
        self._pauses = Pauses(self.liveness)
        self._draining = False
        # While it drains: where its `InstanceDraining` is in the log (0: refuse all).
        self._drain_seq = 0
        # Test-only fault injection: inert unless YB_FAILPOINTS arms it.
        self.failpoints = Failpoints.from_text(cfg.failpoints, self.instance_id)

    # --- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        """Open the block-event log, then the cache (a new epoch: whatever an earlier
        life cached is gone)."""
        await self.publisher.open()
        self.cache.open()

    def capacity(self) -> Capacity:
        return Capacity(
            kv_capacity_blocks=self.engine.cache.num_pages,
            kv_block_bytes=self.engine.kv.page_nbytes,
            kv_spec=self.engine.cache.spec,
            max_batch_size=1,
            attention_backend=self.engine.attention_backend,
            epoch=self.block_log.epoch,
            tensor_parallel=self.engine.tensor_parallel,
        )

    async def serve(self) -> None:
        """Take jobs, publish block events, run the queue; a lost tensor-parallel rank
        fails the `ranks` task, which takes the instance down."""
        await self.bus.subscribe(pr.prefill_job_subject(self.instance_id), cb=self._on_job)
        self.tasks.spawn("ranks", self.engine.watch_ranks())
        self.tasks.spawn("block-events", self.publisher.run_publisher())
        self.tasks.spawn("resyncs", self.publisher.run_resyncs())
        self.tasks.spawn("worker", self._run_queue())
        self.tasks.spawn("outbox", self.outbox.run())

    def refuse_work(self) -> None:
        self._draining = True
        self._drain_seq = 0

    def drain(self, logged_seq: int) -> None:
        self.refuse_work()
        self._drain_seq = logged_seq

    def holds_work(self) -> bool:
        # The uploads too: the pool gets the blocks it computed.
        return bool(self._jobs or self._uploads or not self._queue.empty())

    async def close(self) -> None:
        self.engine.close()

    def load_report(self) -> ev.LoadReport:
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="prefill",
            queued_requests=self._queue.qsize(),
            queued_tokens=self._queue.queued_tokens,
            running_requests=len(self._jobs),
            kv_used_blocks=self.engine.allocator.num_used,
            kv_total_blocks=self.engine.cache.num_pages,
        )

    def on_cancel(self, request_id: str, reason: str) -> None:
        self.liveness.cancel(request_id, reason)
        self._pauses.wake(request_id)

    # --- intake ---------------------------------------------------------------------

    async def _on_job(self, msg: Msg) -> None:
        if await take_job(msg, self.instance_id, self._queue, self._refusal) is not None:
            self.gauges.queue.set(self._queue.qsize())

    def _refusal(self, job: pr.PrefillJob) -> str:
        """Why this instance will not queue `job` ('' if it will)."""
        stopping = self._draining and not decided_before(job.decision, self._drain_seq)
        reason = refusal(job, self.instance_id, self._queue, draining=stopping)
        if reason:
            self.metrics.jobs.labels("refused").inc()
        return reason

    # --- the engine loop ------------------------------------------------------------

    async def _run_queue(self) -> None:
        """Start the queue's jobs in its order, a group at a time (`_take_group`: the
        head, and the short prompts behind it that compute with it), each group once
        the engine is free of the one before (its compute ended), fewer than
        `MAX_FINISHING` groups' worth of jobs are still finishing, and the engine has
        the pages for the head's whole prompt or nothing else to wait for (the pages
        of jobs still finishing, and of uploads in flight, come back when they end: a
        job that could have them must not fail for want of them;
        `_must_wait_for_pages`). A paused job (`preemption.py`)
        has left the engine; it gets it back, before anything else starts, once the
        queue's head no longer goes first (`_outranks`) or it has paused long
        enough (`preemption.MAX_PAUSED_S`). Cancelled (shutdown), it cancels every
        job started, which fails it."""
        limit = MAX_FINISHING * self.pcfg.batch_jobs
        loop = asyncio.get_running_loop()
        try:
            while True:
                pauses = self._pauses
                if pauses and (pauses.top_overdue() or not self._outranks(pauses.top_priority())):
                    left = pauses.resume()
                    if left is not None:
                        self.gauges.batch.set(1)
                        try:
                            await asyncio.wait({left})
                        finally:
                            self.gauges.batch.set(0)
                    continue
                if len(self._jobs) >= limit:
                    await asyncio.wait(self._jobs, return_when=asyncio.FIRST_COMPLETED)
                    continue
                queued = await self._queue.peek()
                if self._must_wait_for_pages(queued.job):
                    await self._wait_for_pages(self.liveness.remaining_s(queued.job))
                    continue
                self.uploader.pages_wanted = False
                size = self._take_group(limit - len(self._jobs))
                group = [self._queue.get_nowait() for _ in range(size)]
                self.gauges.queue.set(self._queue.qsize())
                batch = None
                if size > 1:
                    batch = ComputeBatch([q.job for q in group], self._run_batch)
                computing: list[asyncio.Future[None]] = []
                for queued in group:
                    turn = EngineTurn(loop)
                    computing.append(turn.left)
                    if batch is not None:
                        self._batch_of[id(queued.job)] = batch
                    task = asyncio.create_task(self._run_job(queued, turn))
                    self._jobs.add(task)
                    task.add_done_callback(self._jobs.discard)
                self.gauges.batch.set(size)
                self.metrics.batch_jobs.observe(size)
                try:
                    await asyncio.wait(computing)
                finally:
                    self.gauges.batch.set(0)
        finally:
            jobs = list(self._jobs)
            for task in jobs:
                task.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)

    def _outranks(self, priority: int) -> bool:
        """Whether the queue's head goes before a paused job of `priority` (or one
        that would pause): it has a higher priority and can start at once (room for
        one more job, and the pages for its whole prompt)."""
        heads = self._queue.head(1)
        if not heads or heads[0].job.priority <= priority:
            return False
        needed = self.engine.cache.pages_for(len(heads[0].job.token_ids))
        limit = MAX_FINISHING * self.pcfg.batch_jobs
        return len(self._jobs) < limit and needed <= self.cache.room

    def _take_group(self, max_jobs: int) -> int:
        """How many jobs from the queue's head start together (`take_group`): alone
        while the test failpoint `prefill.chunk` is armed (it holds one compute
        between chunks)."""
        if self.failpoints.count("prefill.chunk") is not None:
            max_jobs = 1
        max_jobs = min(max_jobs, self.pcfg.batch_jobs)
        return take_group(
            [q.job for q in self._queue.head(max_jobs)],
            max_jobs=max_jobs,
            max_tokens=self.pcfg.chunk_size,
            room_pages=self.cache.room,
            pages_for=self.engine.cache.pages_for,
        )

    def _must_wait_for_pages(self, job: pr.PrefillJob) -> bool:
        """Whether `job` waits in the queue for pages that jobs finishing or uploads
        in flight hold: it does while its prompt does not fit in the room left, could
        fit in the whole engine, and its deadline has not passed (a prompt bigger
        than the engine starts, and fails "out of KV pages", at once)."""
        needed = self.engine.cache.pages_for(len(job.token_ids))
        return (
            bool(self._jobs or self._uploads)
            and self.cache.room < needed <= self.engine.cache.num_pages
            and self.liveness.remaining_s(job) > 0
        )

    async def _wait_for_pages(self, timeout_s: float) -> None:
        """Until a job ends, an upload gives a page back, or `timeout_s`; puts not
        yet posted are skipped meanwhile (`BlockUploader.pages_wanted`)."""
        self.uploader.pages_wanted = True
        self.uploader.released.clear()
        released = asyncio.ensure_future(self.uploader.released.wait())
        try:
            await asyncio.wait(
                {*self._jobs, *self._uploads, released},
                timeout=timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            released.cancel()

    async def _run_job(self, queued: QueuedJob, turn: EngineTurn) -> None:
        """One job to its end; its `turn` is left once it no longer needs the engine
        (its compute ended or paused, or the job ended)."""
        job = queued.job
        try:
            with bind_request(job.request_id):
                await self._run(queued, turn)
        except asyncio.CancelledError:
            await self._fail(job, pr.JobFailed("prefill instance shutting down"))
            raise
        finally:
            if (batch := self._batch_of.pop(id(job), None)) is not None:
                batch.leave(job)
            self._prompt_logprobs.pop(id(job), None)
            self._scorers.pop(id(job), None)
            turn.leave()

    async def _run(self, queued: QueuedJob, turn: EngineTurn) -> None:
        """One job, traced, with its outcome counted and a failure reported.

        Its span is a child of the gateway's hand-off (the context came with the
        job) and opens when the job was queued: the wait is its first phase.
        """
        job, trace_headers = queued.job, queued.trace_headers
        ctx = extract_context(trace_headers)
        log.info(
            "prefill_started",
            prompt_tokens=len(job.token_ids),
            decode=job.decision.decode_instance,
            queued_s=round(time.monotonic() - queued.enqueued_at, 4),
            trace_id=trace_id_hex(trace_headers),
        )
        queued_ns = wall_time_ns(queued.enqueued_at)
        with _tracer.start_as_current_span(
            "prefill", context=ctx, kind=trace.SpanKind.CONSUMER, start_time=queued_ns
        ) as span:
            if span.is_recording():
                span.set_attributes(
                    {
                        "yb.request_id": job.request_id,
                        "yb.prompt_tokens": len(job.token_ids),
                        "yb.decode_instance": job.decision.decode_instance,
                    }
                )
                _tracer.start_span("prefill queue wait", start_time=queued_ns).end()
            started = time.monotonic()
            try:
                await self._prefill(job, span, turn)
            except pr.JobFailed as exc:
                self.metrics.jobs.labels("failed").inc()
                await self._fail(job, exc)
                return
            except TransferError as exc:
                self.metrics.jobs.labels("failed").inc()
                self._log_event(
                    ev.TransferFailed(
                        request_id=job.request_id,
                        source_instance=self.instance_id,
                        target_instance=job.decision.decode_instance,
                        reason=str(exc),
                    )
                )
                await self._fail(job, pr.JobFailed(f"KV transfer to decode failed: {exc}"))
                return
            except Exception as exc:
                # One job's bug or bad input (the engine refusing a prompt, say) ends
                # that job, not the worker: a crashed worker takes every queued job
                # and the whole instance with it. Its pages were given back on the
                # way out of `_prefill`.
                log.exception("prefill_crashed", error=repr(exc))
                self.metrics.jobs.labels("failed").inc()
                await self._fail(job, pr.JobFailed(f"prefill failed: {exc}", status=500))
                return
            self.metrics.jobs.labels("completed").inc()
            self.metrics.prefill.observe(time.monotonic() - started)

    # --- one job's phases -----------------------------------------------------------

    async def _prefill(self, job: pr.PrefillJob, span: trace.Span, turn: EngineTurn) -> None:
        """Reserve on decode, load the prefix, compute and stream, hand over."""
        self.liveness.check(job)
        t_start = time.monotonic()
        self._log_event(
            ev.RequestProgress(
                request_id=job.request_id, instance_id=self.instance_id, stage="prefill_started"
            )
        )
        transfer_deadline = min(self.liveness.remaining_s(job), self.pcfg.transfer_timeout_s)
        reserving = asyncio.ensure_future(self._reserve_on_decode(job, transfer_deadline))
        try:
            with child_span(_tracer, "prefill prefix load") as loading:
                prefix = await self._load_prefix(job, transfer_deadline)
                if loading.is_recording():
                    loading.set_attributes(_prefix_attributes(job, prefix))
        except BaseException:
            await self._give_back(job, reserving)
            raise
        t_loaded = time.monotonic()
        cached_tokens = prefix.reused_blocks * self.engine.cache.block_size
        try:
            computed = await self._compute_and_stream(
                job, reserving, prefix, cached_tokens, transfer_deadline, span, turn
            )
        except PrefixLoadFailed as exc:
            # Computed on while it landed, and it did not land: the job cannot stand.
            self.metrics.fetch_failures.inc()
            self._log_event(
                ev.TransferFailed(
                    request_id=job.request_id,
                    source_instance=",".join(sorted({r.source for r in prefix.runs})),
                    target_instance=self.instance_id,
                    reason=str(exc),
                )
            )
            raise pr.JobFailed(f"prefix load failed mid-way: {exc}") from exc
        if not computed.handed_over:
            with child_span(_tracer, "prefill hand-over"):
                await self._hand_over(job, computed.first, cached_tokens, transfer_deadline)
        n = len(job.token_ids)
        self._log_event(
            ev.RequestProgress(
                request_id=job.request_id,
                instance_id=self.instance_id,
                stage="prefill_done",
                computed_tokens=n - cached_tokens,
                reused_tokens=cached_tokens,
            )
        )
        t_done = time.monotonic()
        log.info(
            "prefill_done",
            prompt_tokens=len(job.token_ids),
            reused_tokens=cached_tokens,
            # Asked for the prompt's logprobs: computed whole, whatever was cached.
            prompt_logprobs=job.sampling.prompt_logprobs is not None or None,
            fetch_s=round(prefix.fetch_s, 4),
            # Where the time went: reserve on decode and load the prefix, compute (with
            # streaming alongside), the streaming left after compute plus the hand-over.
            load_s=round(t_loaded - t_start, 4),
            compute_s=round(computed.at - t_loaded, 4),
            tail_s=round(t_done - computed.at, 4),
        )

    async def _reserve_on_decode(self, job: pr.PrefillJob, deadline_s: float) -> pr.KVReserved:
        """Phase 1: room on the decode instance, whose pages must have this engine's
        layout. The decode instance's spans for the request are children of this
        phase's."""
        with child_span(_tracer, "prefill reserve decode"):
            return await self._reserve(job, deadline_s)

    async def _reserve(self, job: pr.PrefillJob, deadline_s: float) -> pr.KVReserved:
        cache = self.engine.cache
        cuts = self._cuts_to(job.decision.decode_instance)
        return await self.decode.reserve_for(
            job,
            self.instance_id,
            cache,
            cache.num_layers,
            deadline_s,
            head_cuts=cuts if len(cuts) > 2 else None,
        )

    def _cuts_to(self, decode_id: str) -> list[int]:
        """Where this instance's pages are cut on the way to `decode_id`: at every
        boundary between the runs of heads one rank holds, on either side (the
        degrees may differ: `yb_engine.tensor_parallel.transfer_cuts`)."""
        up = self.peers.get(decode_id)
        theirs = up.tensor_parallel if up is not None else 1
        return transfer_cuts(self.engine.model.config, self.engine.tensor_parallel, theirs)

    async def _load_prefix(self, job: pr.PrefillJob, deadline_s: float) -> Prefix:
        """Phase 2: pages here, the planned prefix loaded into them; none for a job
        that asks for its prompt's logprobs (`_drop_reuse`)."""
        plans = job.decision.reuse if self.pcfg.reuse else []
        if job.sampling.prompt_logprobs is not None:
            plans = self._drop_reuse(job, plans)
        try:
            await self.failpoint(job, "prefill.load")
            self.liveness.check(job)
            return await self.loader.load(
                job.request_id,
                len(job.token_ids),
                job.block_hashes,
                plans,
                min(deadline_s, self.pcfg.fetch_timeout_s),
                overlap=self._overlaps(job),
            )
        except OutOfPages as exc:
            raise pr.JobFailed(f"prefill instance out of KV pages: {exc}") from exc

    def _overlaps(self, job: pr.PrefillJob) -> bool:
        """Whether the job computes on its prefix while it lands (`overlap_prefix_load`):
        not in a batch (its chunk is other jobs' too), not on a tensor-parallel
        instance (the other ranks would read their pages unguarded)."""
        return (
            self.pcfg.overlap_prefix_load
            and self.engine.tensor_parallel == 1
            and id(job) not in self._batch_of
        )

    def _drop_reuse(self, job: pr.PrefillJob, plans: list[ev.ReusePlan]) -> list[ev.ReusePlan]:
        """No reuse for a job that asks for its prompt's logprobs: a reused prefix has
        KV but no logits, so the whole prompt is computed (the blocks it could have
        reused stay cached). What that costs is counted and logged."""
        self.metrics.prompt_logprobs.inc()
        bs = self.engine.cache.block_size
        limit = max(0, (len(job.token_ids) - 1) // bs)
        planned = min(limit, sum(plan.num_blocks for plan in plans))
        if planned:
            self.metrics.prompt_logprobs_recomputed.inc(planned * bs)
            log.info(
                "prompt_logprobs_full_prefill",
                prompt_tokens=len(job.token_ids),
                dropped_reuse_tokens=planned * bs,
            )
        return []

    async def _give_back(
        self, job: pr.PrefillJob, reserving: asyncio.Future[pr.KVReserved]
    ) -> None:
        """Give back the decode reservation of a job that cannot finish, wherever the
        reservation is: one still on its way is waited for (2 s at most: a reservation
        also expires) and aborted all the same; one refused holds nothing."""
        if not reserving.done():
            await asyncio.wait({reserving}, timeout=2.0)
            reserving.cancel()
        if not reserving.cancelled() and reserving.exception() is not None:
            return
        await self.decode.abort(job.decision.decode_instance, job.request_id, "prefill failed")

    async def _compute_and_stream(
        self,
        job: pr.PrefillJob,
        reserving: asyncio.Future[pr.KVReserved],
        prefix: Prefix,
        cached_tokens: int,
        deadline_s: float,
        span: trace.Span,
        turn: EngineTurn,
    ) -> _Computed:
        """Phase 3: compute the rest with layer-wise streaming (the loaded prefix
        first; nothing leaves before the reservation is there), then commit. A
        failure, the reservation's included, aborts the stream and gives the decode
        reservation back; either way the pages are kept (once computed: their KV is
        valid even if the commit failed) or freed after (once the engine thread is
        done with them). The `turn` is left when the compute has ended (or paused): the
        commit no longer needs the engine. A decode instance that takes the hand-over
        on the commit (`KVReserved.handover_on_commit`) gets it there: the request is
        then decode's once the commit is acknowledged."""
        first: list[Sampled] | None = None
        decode_id = job.decision.decode_instance
        streamer: LayerStreamer | None = None
        handed_over = False
        overlapped = prefix.fetching is not None
        try:
            if not overlapped:
                await self._account_prefix(job, prefix, span)
            streamer = self._start_streaming(job, prefix, cached_tokens, deadline_s)
            # Its pages go out once the connection to the decode instance is known to
            # carry data: streams to one instance share one UCX connection, which a
            # transfer that fails closes (a peer cut off from this host leaves every
            # send on it hanging until its deadline); a stream that waited connects
            # afresh instead of failing with the one before. The first stream of a
            # group waits for the first of the group before; the others of a group
            # wait for their group's first only, not each for the one before it: a
            # group computed together would otherwise go out one round trip apart.
            before = self._stream_before(decode_id, self._batch_of.get(id(job)), streamer)
            try:
                ready = prefix.arrivals.wait_layer if prefix.arrivals is not None else None
                computing = asyncio.ensure_future(
                    self._compute_traced(
                        job, prefix.block_table, cached_tokens, streamer, turn, ready
                    )
                )
                computing.add_done_callback(lambda _: turn.leave())
                try:
                    reserved = await reserving
                    if before is not None and not before.flowing.done():
                        # Bounded by that stream's own deadline, and by this one's.
                        await asyncio.wait({before.flowing}, timeout=deadline_s)
                    handed_over = reserved.handover_on_commit
                    streamer.direct(
                        PeerAddress.parse(reserved.ucx_address),
                        reserved.breaks,
                        hand_over=handed_over,
                    )
                    first = await computing
                    if overlapped:
                        await self.loader.landed(prefix)
                        await self._account_prefix(job, prefix, span)
                except BaseException:
                    computing.cancel()
                    await asyncio.gather(computing, return_exceptions=True)
                    raise
                computed_at = time.monotonic()
                await self.failpoint(job, "prefill.commit")
                self.liveness.check(job)
                if handed_over:
                    with child_span(_tracer, "prefill hand-over"):
                        # Its trace context rides along: decode's spans are its children.
                        start = self._start_decode(job, first, cached_tokens, inject_headers())
                        streamer.hand_over(pr.encode(start))
                        await streamer.finish()
                else:
                    await streamer.finish()
            except BaseException:
                await streamer.abort()
                raise
        except BaseException:
            await self._give_back(job, reserving)
            raise
        finally:
            lead = self._streams.get(decode_id)
            if streamer is not None and lead is not None and lead.stream is streamer:
                del self._streams[decode_id]
            await self._keep_blocks(job, prefix, first is not None)
        self.metrics.tokens.inc(len(job.token_ids) - cached_tokens)
        span.set_attribute("yb.pages_sent", streamer.pages_sent)
        assert first is not None
        return _Computed(first, computed_at, handed_over)

    def _stream_before(
        self, decode_id: str, group: object | None, streamer: LayerStreamer
    ) -> LayerStreamer | None:
        """The stream whose data `streamer` waits for (None: none), noting `streamer`
        as its group's first stream to `decode_id` when it is."""
        lead = self._streams.get(decode_id)
        if lead is not None and group is not None and lead.group is group:
            return lead.stream
        self._streams[decode_id] = _Lead(group, streamer)
        return lead.stream if lead is not None else None

    def _start_streaming(
        self, job: pr.PrefillJob, prefix: Prefix, cached_tokens: int, deadline_s: float
    ) -> LayerStreamer:
        """A streamer into the decode reservation (directed there once it is known),
        sending the loaded prefix first. A prefix still landing goes out a layer at a
        time, with the layer's computed pages (it has landed by then)."""
        loaded = prefix.engine_blocks if prefix.fetching is not None else prefix.reused_blocks
        streamer = LayerStreamer(
            asyncio.get_running_loop(),
            self.sender,
            None,
            job.request_id,
            self.engine.cache,
            prefix.block_table,
            len(job.token_ids),
            loaded * self.engine.cache.block_size,
            deadline_s,
            cuts=self._cuts_to(job.decision.decode_instance),
            # The test failpoint `prefill.commit` holds a job between its last send
            # and its commit: the commit cannot ride on that send then.
            commit_last=self.failpoints.count("prefill.commit") is None,
        )
        streamer.start()
        streamer.queue_prefix(loaded)
        return streamer

    async def _hand_over(
        self, job: pr.PrefillJob, first: list[Sampled], cached_tokens: int, deadline_s: float
    ) -> None:
        """Phase 4, for a decode instance that takes it as a control message only:
        hand the request over; decode verifies the commit before admitting it."""
        start = self._start_decode(job, first, cached_tokens)
        await self.decode.start(job.decision.decode_instance, start, deadline_s)

    def _start_decode(
        self,
        job: pr.PrefillJob,
        first: list[Sampled],
        cached_tokens: int,
        trace_headers: dict[str, str] | None = None,
    ) -> pr.StartDecode:
        """The hand-over: every choice's first token (and its logprob when asked), and
        the prompt's logprobs when asked."""
        return pr.StartDecode(
            request_id=job.request_id,
            first_token=first[0].token_id,
            # The prompt the client sent: a resumed request's tail is its output.
            prompt_tokens=len(job.token_ids) - job.generated_tokens,
            reused_tokens=cached_tokens,
            first_tokens=[s.token_id for s in first] if len(first) > 1 else [],
            first_logprobs=[s.logprob for s in first if s.logprob is not None],
            trace_headers=trace_headers or {},
            prompt_logprobs=self._prompt_logprobs.pop(id(job), []),
        )

    async def _account_prefix(self, job: pr.PrefillJob, prefix: Prefix, span: trace.Span) -> None:
        """Metrics, trace attributes and `TransferFailed` events for a loaded prefix."""
        for tier, tokens in prefix.tokens_by_tier.items():
            self.metrics.reused.labels(tier).inc(tokens)
        if prefix.fetched_bytes:
            self.metrics.fetch.observe(prefix.fetch_s)
        span.set_attribute("yb.reused_blocks", prefix.reused_blocks)
        span.set_attribute("yb.engine_blocks", prefix.engine_blocks)
        for failure in prefix.failures:
            self.metrics.fetch_failures.inc()
            self._log_event(
                ev.TransferFailed(
                    request_id=job.request_id,
                    source_instance=failure.source,
                    target_instance=self.instance_id,
                    reason=f"prefix blocks {failure.first}..{failure.first + failure.count - 1}: "
                    f"{failure.reason}",
                )
            )

    # --- after a job: the pages -----------------------------------------------------

    async def _keep_blocks(self, job: pr.PrefillJob, prefix: Prefix, computed: bool) -> None:
        """After a prefill: cache its full blocks, upload the new ones, free the rest."""
        cache = self.cache
        if not computed:
            # The pages hold garbage or half a prompt: give them back, but only once no
            # fetch lands in them any more and the engine thread is done with them (a
            # cancelled call may still be running, or waiting on a layer that will
            # not land; the engine runs its calls in order).
            await self.loader.settle(prefix, "the job ended before its prefix landed")
            try:
                await self.engine.call(_engine_barrier)
            except RuntimeError:
                return  # the engine is shut down: so is the process, pages and all
            self.loader.release(prefix)
            return
        full = full_blocks(len(job.token_ids), len(job.block_hashes), self.engine.cache.block_size)
        first = prefix.engine_blocks
        keys = list(job.block_hashes[first:full])
        spare = cache.adopt(keys, prefix.block_table[first:full])
        cache.free(spare + prefix.block_table[max(full, first) :])
        cache.release(prefix.engine_keys)
        prefix.engine_keys = []
        store = self.peers.kvstore_on(self.cfg.host)
        if not self.pcfg.store_blocks or store is None:
            cache.release(keys)
            return
        # Blocks this host's kvstore gave us are there already; the rest go there
        # (those pulled from another host: a replica on this one).
        upload = [
            job.block_hashes[i]
            for i in blocks_to_store(first, full, prefix.loaded_from, store.instance_id)
        ]
        uploading = set(upload)
        cache.release([k for k in keys if k not in uploading])
        if upload:
            address = self.peers.address(store.instance_id)
            task = self.tasks.spawn(f"upload:{job.request_id}", self._upload(address, upload))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def _upload(self, address: PeerAddress | None, keys: list[int]) -> None:
        """Owned background task: put blocks into the host's kvstore; never raises."""
        try:
            result = await self.uploader.upload(address, keys, self.cache)
        except Exception as exc:  # a crash here must not take the service down
            log.exception("block_upload_crashed", error=repr(exc))
            return
        for outcome, count in result.counts().items():
            self.metrics.puts.labels(outcome).inc(count)

    # --- the engine thread ----------------------------------------------------------

    async def _compute_traced(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        cached: int,
        streamer: LayerStreamer,
        turn: EngineTurn,
        ready: LayerReady | None = None,
    ) -> list[Sampled]:
        """`_compute_with_holds` in the `prefill compute` span."""
        with child_span(_tracer, "prefill compute") as computing:
            if computing.is_recording():
                computing.set_attributes(
                    {
                        "yb.computed_tokens": len(job.token_ids) - cached,
                        "yb.chunk_size": self.pcfg.chunk_size,
                    }
                )
            return await self._compute_with_holds(job, pages, cached, streamer, turn, ready)

    async def _compute_with_holds(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        cached: int,
        streamer: LayerStreamer,
        turn: EngineTurn,
        ready: LayerReady | None = None,
    ) -> list[Sampled]:
        """`_compute` on the engine thread. With failpoint `prefill.chunk` armed at k,
        in two calls cut at chunk k's start (a chunk boundary of one call: the same KV,
        the same first token), holding between them on the event loop, so the engine
        thread is never the one that waits on a test. A preemptible job's calls may
        hold between two layers (`_engine_compute`), lending the engine thread to more
        urgent work meanwhile."""
        batch = self._batch_of.get(id(job))
        if batch is not None:
            return await batch.compute(job, (job, pages, cached, streamer))
        n, chunk = len(job.token_ids), self.pcfg.chunk_size
        k = self.failpoints.count("prefill.chunk")
        hold = cached + k * chunk if k is not None else n
        if hold < n:
            await self._engine_compute(
                job, turn, self._compute_part, job, pages, cached, hold, streamer, ready
            )
            cached, ready = hold, None
            await self.failpoint(job, "prefill.chunk")
            self.liveness.check(job)
        return await self._engine_compute(
            job, turn, self._compute, job, pages, cached, streamer, ready
        )

    async def _engine_compute(
        self, job: pr.PrefillJob, turn: EngineTurn, fn: Callable[..., T], *args: Any
    ) -> T:
        """`fn(*args, pause)` on the engine thread. A preemptible job's call gets an
        `EnginePause`: whenever the queue's head outranks the job (`_outranks`,
        looked at on each new job and every `PAUSE_CHECK_S`), the call holds after
        the layer it is computing and the job sits out (`_sit_out`) while the head
        computes on the same thread; then it goes on from the next layer. Every
        other call gets no pause (None)."""
        if not job.preemptible:
            return await self.engine.call(fn, *args, None)
        pause = self.engine.pause_point()
        pause.wanted = turn.may_pause() and self._outranks(job.priority)
        call = self.engine.submit(fn, *args, pause)
        try:
            while not call.done():
                waits: set[asyncio.Future[Any]] = {call, pause.held, self._queue.next_put()}
                await asyncio.wait(
                    waits,
                    timeout=PAUSE_CHECK_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if pause.held.done() and not call.done():
                    layer, start, end = pause.held.result()
                    await self._sit_out(job, turn, f"{start}..{end}", layer)
                    pause.resume()
                pause.wanted = turn.may_pause() and self._outranks(job.priority)
            return call.result()
        finally:
            # Ended early (the job failed while it sat out, or was cancelled): the
            # call ends at its next layer boundary; its error is the job's already.
            pause.abandon()
            call.add_done_callback(_retrieved)

    async def _sit_out(
        self, job: pr.PrefillJob, turn: EngineTurn, computing: str, layer: int | None = None
    ) -> None:
        """A preemptible job pauses (`computing`: the prompt positions it is computing,
        or has computed; `layer`: the layer it holds after, when it holds inside a
        call) while the queue's head outranks it and the work started ahead of it
        computes; what it holds stays held, and its deadline and a cancel end the
        pause and the job (`liveness.check` raises). It sits out at most
        `preemption.MAX_PAUSED_S` in all (`EngineTurn.may_pause`)."""
        head = self._queue.head(1)
        self.metrics.preemptions.inc()
        log.info(
            "prefill_paused",
            computing=computing,
            layer=layer,
            prompt_tokens=len(job.token_ids),
            priority=job.priority,
            for_request=head[0].job.request_id if head else None,
            for_priority=head[0].job.priority if head else None,
        )
        paused_at = time.monotonic()
        resumed = await self._pauses.pause(job, turn)
        self.liveness.check(job)
        if not resumed:  # only a cancel or the deadline wakes it: checked above
            raise pr.JobFailed("prefill ended while paused", status=500)
        log.info(
            "prefill_resumed",
            computing=computing,
            layer=layer,
            paused_s=round(time.monotonic() - paused_at, 4),
            paused_total_s=round(turn.paused_s, 4),
        )

    def _compute_part(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        num_cached_tokens: int,
        end: int,
        streamer: LayerStreamer,
        ready: LayerReady | None = None,
        pause: EnginePause | None = None,
    ) -> None:
        """Engine thread: compute the KV of tokens [num_cached_tokens, end) only (and
        keep their logits rows when the prompt's logprobs are asked for)."""
        self.engine.runner.prefill(
            job.token_ids[:end],
            pages,
            num_cached_tokens=num_cached_tokens,
            chunk_size=self.pcfg.chunk_size,
            layer_hook=streamer.on_layer,
            row_logits=self._scorer(job),
            layer_ready=ready,
            hold=pause,
        )

    def _compute(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        num_cached_tokens: int,
        streamer: LayerStreamer,
        ready: LayerReady | None = None,
        pause: EnginePause | None = None,
    ) -> list[Sampled]:
        """Engine thread: run the prefill over the uncached suffix, sample each choice's
        first token (with the code the decode batcher samples with). A job that asks
        for its prompt's logprobs computes every row's logits (its whole prompt: it
        reused nothing) and reads them from those. With `pause`, the call may hold
        between two layers (`_engine_compute`)."""
        score = self._scorer(job)
        logits = self.engine.runner.prefill(
            job.token_ids,
            pages,
            num_cached_tokens=num_cached_tokens,
            chunk_size=self.pcfg.chunk_size,
            layer_hook=streamer.on_layer,
            row_logits=score,
            layer_ready=ready,
            hold=pause,
        )
        if score is not None:
            self._prompt_logprobs[id(job)] = self._scorers.pop(id(job)).entries
        return self._sample_first(job, logits)

    def _scorer(self, job: pr.PrefillJob) -> RowLogits | None:
        """Engine thread: where a job that asks for its prompt's logprobs hands each
        chunk's logits (kept across the calls of a split compute); None otherwise."""
        top = job.sampling.prompt_logprobs
        if top is None:
            return None
        scorer = self._scorers.get(id(job))
        if scorer is None:
            scorer = self._scorers[id(job)] = PromptScorer(job.token_ids, top)
        return scorer.add

    def _sample_first(self, job: pr.PrefillJob, logits: torch.Tensor) -> list[Sampled]:
        """Engine thread: each choice's first token from the logits after the prompt
        (with the code the decode batcher samples with)."""
        k = job.generated_tokens
        return sample_first_tokens(
            logits,
            job.sampling,
            job.token_ids[len(job.token_ids) - k :] if k else [],
            tokenizer=self.engine.model.tokenizer,
            eos_token_ids=self.engine.runner.arch.eos_token_ids,
        )

    def _run_batch(self, parts: list[_Part]) -> asyncio.Future[list[Outcome[list[Sampled]]]]:
        """A group's computes, queued on the engine thread as one call."""
        return self.engine.submit(self._compute_batch, parts)

    def _compute_batch(self, parts: list[_Part]) -> list[Outcome[list[Sampled]]]:
        """Engine thread: the prompts of `parts` in one forward pass, then each one's
        first tokens; one outcome per part, in order. A prompt the engine cannot
        compute fails alone (checked before anything is computed); the pass failing
        fails them all."""
        runner = self.engine.runner
        outcomes: list[Outcome[list[Sampled]] | None] = [None] * len(parts)
        seqs: list[PrefillSeq] = []
        computed: list[int] = []
        for i, (job, pages, cached, streamer) in enumerate(parts):
            try:
                runner.check_prefill(job.token_ids, pages, cached)
            except ValueError as exc:
                outcomes[i] = exc
                continue
            seqs.append(PrefillSeq(job.token_ids, pages, cached, streamer.on_layer))
            computed.append(i)
        try:
            logits = runner.prefill_batch(seqs)
        except Exception as exc:
            for i in computed:
                outcomes[i] = exc
        else:
            for row, i in enumerate(computed):
                try:
                    outcomes[i] = self._sample_first(parts[i][0], logits[row])
                except Exception as exc:
                    outcomes[i] = exc
        return [o for o in outcomes if o is not None]  # every part has its outcome

    # --- liveness, failure, events --------------------------------------------------

    def _emit_block_event(self, event: AnyBlockEvent) -> None:
        self.publisher.emit(event)


def _prefix_attributes(job: pr.PrefillJob, prefix: Prefix) -> dict[str, AttributeValue]:
    """What a trace shows of a loaded prefix: how much, from where, at what cost."""
    attributes: dict[str, AttributeValue] = {
        "yb.planned_blocks": sum(plan.num_blocks for plan in job.decision.reuse),
        "yb.reused_blocks": prefix.reused_blocks,
        "yb.engine_blocks": prefix.engine_blocks,
        "yb.fetched_bytes": prefix.fetched_bytes,
        "yb.fetch_s": prefix.fetch_s,
        "yb.fetch_failures": len(prefix.failures),
    }
    for tier, tokens in prefix.tokens_by_tier.items():
        attributes[f"yb.reused_tokens.{tier}"] = tokens
    return attributes


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read a finished future's exception, so that one nobody awaits any more (a call
    abandoned with its job) is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _engine_barrier() -> None:
    """Runs on the engine thread after everything submitted before it."""
