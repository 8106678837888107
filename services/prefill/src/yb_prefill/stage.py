"""A prefill instance that is one stage of a prefill group (chunked pipeline parallelism).

Each stage of a group holds a contiguous share of the model's layers (`StageHost`:
only those layers' weights, and KV pages of those layers only). The group runs one
request at a time, all its stages together:

1. The lead (the stage holding layer 0) takes the group's jobs from gateways, as a
   whole-model instance does, in its queue's order. For one job it takes pages for
   the prompt, reserves decode's pages (`ReserveKV`: every layer, as from one
   instance) and loads the planned prefix of its own layers, all at once.
2. It sends every other stage a `StageJob` (core NATS request/reply on
   `yb.job.stage.<id>`): each takes pages, loads its layers of the planned prefix
   from the kvstores, and answers `StageReady` with how many blocks it loaded. The
   request starts after the shortest of those prefixes, so every stage holds the KV
   of every position before the first chunk.
3. The lead cuts the rest of the prompt into `chunk_size`-token chunks and runs them
   through its layers; each chunk's hidden states go to the next stage over UCX
   (`yb_dataplane.activations`, into the next stage's receiver), which computes its
   layers and passes them on, so stage 2 computes chunk k while the lead computes
   chunk k+1 (`yb_engine.stages.serve_stage_request`). Every stage streams its own
   layers' pages into decode's reservation as the chunks fill them; the last stage
   commits it once every stage before it has closed the request complete (each does
   only after its pages were sent), and sends the logits after the prompt back to
   the lead.
4. The lead samples the first token from them, exactly as a whole-model instance
   does, and hands the request over to decode (`StartDecode`, as a control message:
   the commit, which could carry it, is the last stage's and comes before the
   logits do).
5. The prompt's full blocks after the planned prefix go into the kvstore of the
   lead's host: a put holds every layer of a block, so each stage sends its layers
   into the same put reservation (`StageJob.puts`, ids the lead chose), each before
   it closes the request complete, and the last stage commits them after its own
   (`serve_stage_request`'s `blocks`). A put that fails leaves the block out of the
   pool, nothing more.

A stage failing (its process dies, a transfer breaks, a deadline) aborts the request
along the chain: a stage whose neighbour's connection broke fails at once
(`PeerUnreachable`), and closes the request downstream as aborted, so the stages after
it end too. The lead then gives decode's reservation back, tells the stages it sent
the job (`StageAbort`), and fails the job with a 503 error chunk, which the gateway
re-plans (`gateway.replan_budget`) like any prefill failure before the first token;
the conductor plans nothing more on the group until its live stages cover every layer
again. Every wait is bounded by the request's deadline and `transfer_timeout_s`.

What a stage does not do (a whole-model instance does): keep blocks in its own page
cache, copy blocks it reused from another host's kvstore to its own host, batch
several short prompts, or compute a prompt's logprobs (the lead refuses such a job).
A prefix in the kvstore is fetched by each stage for its own layers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import BusError
from yb_core.failpoints import Failpoints
from yb_core.outbox import Outbox
from yb_core.telemetry import (
    bind_request,
    extract_context,
    get_logger,
    tracer,
    wall_time_ns,
)
from yb_dataplane.activations import ActivationReceiver, ActivationSender, ReservationTarget
from yb_dataplane.prefix_fetch import BlockFetcher, FetchRun, plan_runs, reusable_blocks
from yb_dataplane.transport import PeerAddress, TransferError
from yb_dataplane.transport.blocks import PutId
from yb_dataplane.worker import Capacity, Worker, WorkerContext, decided_before
from yb_engine.choice_sampling import Sampled, sample_first_tokens
from yb_engine.host import EngineGauges, StageHost
from yb_engine.kv_cache import OutOfPages
from yb_engine.stages import (
    HiddenHeader,
    UpstreamFailed,
    chunk_spans,
    hidden_bytes,
    hidden_from_buffer,
    serve_stage_request,
)
from yb_engine.tensor_parallel import transfer_cuts
from yb_prefill.decode_link import DecodeLink
from yb_prefill.failure import JobOwner
from yb_prefill.job_queue import JobQueue, Liveness, QueuedJob, refusal, respond, take_job
from yb_prefill.worker import MAX_QUEUE, PrefillMetrics

log = get_logger(__name__)
_tracer = tracer(__name__)


@dataclass(frozen=True, slots=True)
class _Puts:
    """The prompt's blocks a group puts into a kvstore (`StageJob.puts`)."""

    address: str = ""
    first: int = 0
    request_ids: list[str] = field(default_factory=list)


class _PromptChunks:
    """The lead's inbound side: the prompt's token ids, chunk by chunk, as the first
    stage takes them (`yb_engine.stages.ChunkSource`). Before each chunk it checks the
    job is still wanted, and holds at the test failpoint `prefill.chunk`."""

    def __init__(
        self,
        worker: StageWorker,
        job: pr.PrefillJob,
        spans: Sequence[tuple[int, int]],
    ) -> None:
        self._worker = worker
        self._job = job
        self._spans = spans
        self._ids = torch.tensor(job.token_ids, dtype=torch.int64)

    async def receive(
        self, request_id: str, chunk_index: int, *, deadline_s: float
    ) -> tuple[HiddenHeader, Any]:
        del deadline_s
        job = self._job
        if chunk_index == self._worker.failpoints.count("prefill.chunk"):
            await self._worker.failpoint(job, "prefill.chunk")
        self._worker.liveness.check(job)
        start, end = self._spans[chunk_index]
        piece = self._ids[start:end]
        header = HiddenHeader.of(
            piece,
            request_id=request_id,
            chunk_index=chunk_index,
            start=start,
            prompt_len=len(job.token_ids),
        )
        return header, hidden_bytes(piece)

    async def wait_closed(self, request_id: str, *, deadline_s: float) -> bool:
        del request_id, deadline_s
        return True

    def forget(self, request_id: str) -> None:
        del request_id


class StageWorker(JobOwner, Worker):
    """One stage of a prefill group: the lead's job queue (stage 0), or the stage side
    of its lead's requests (see the module docstring)."""

    # KV to decode, prefix fetches from kvstores, hidden states to the other stages.
    preconnect_roles = frozenset({"decode", "kvstore", "prefill"})

    def __init__(
        self,
        context: WorkerContext,
        host: StageHost,
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
        self.host = host
        self.metrics = metrics
        self.decode = DecodeLink(context.bus)
        self.outbox = Outbox(context.bus)
        arch = host.stage.config
        self.layer_range = host.stage.layer_range
        self.is_lead = self.layer_range.is_first
        self.num_layers = arch.num_layers
        # This instance's receiver carries the group's hidden states (a prefill engine
        # has no other use for unsolicited reservations); requests are known by id.
        self.activations = ActivationReceiver(
            context.receiver, HiddenHeader, request_deadline_s=600.0, queue_requests=False
        )
        self.fetcher = BlockFetcher(
            self.instance_id,
            host.cache,
            context.peers,
            context.receiver,
            context.sender,
            # A pooled block holds every layer: the stage asks for its own only.
            model_layers=arch.num_layers,
            layers=range(self.layer_range.start, self.layer_range.end),
        )
        gauges.kv_total.set(host.cache.num_pages)
        allocator = host.allocator
        gauges.kv_used.set_function(lambda: allocator.num_used)
        self.gauges = gauges
        self._queue = JobQueue(maxsize=MAX_QUEUE)
        # The lead: the job running. Another stage: the requests it serves, by id.
        self._running: str | None = None
        self._serving: dict[str, asyncio.Task[None]] = {}
        self.liveness = Liveness()
        self._draining = False
        # While it drains: where its `InstanceDraining` is in the log (0: refuse all).
        self._drain_seq = 0
        self.failpoints = Failpoints.from_text(cfg.failpoints, self.instance_id)

    # --- lifecycle ------------------------------------------------------------------

    def capacity(self) -> Capacity:
        return Capacity(
            kv_capacity_blocks=self.host.cache.num_pages,
            kv_block_bytes=self.host.kv.page_nbytes,
            kv_spec=self.host.cache.spec,
            max_batch_size=1,
            attention_backend=self.host.runner.backend.name,
            group=self.pcfg.group,
            layer_start=self.layer_range.start,
            layer_end=self.layer_range.end,
            num_layers=self.num_layers,
            chunk_tokens=self.pcfg.chunk_size,
        )

    async def serve(self) -> None:
        await self.bus.subscribe(
            pr.prefill_stage_subject(self.instance_id), cb=self._on_stage_control
        )
        if self.is_lead:
            await self.bus.subscribe(pr.prefill_job_subject(self.instance_id), cb=self._on_job)
            self.tasks.spawn("worker", self._run_queue())
        self.tasks.spawn("outbox", self.outbox.run())

    def refuse_work(self) -> None:
        self._draining = True
        self._drain_seq = 0

    def drain(self, logged_seq: int) -> None:
        """The lead takes the group's jobs decided before the drain was logged; another
        stage serves its lead's stage jobs while it drains (the lead sends only the
        group's, and the conductor plans nothing more on a group with a stage
        draining), and refuses them once it stops."""
        self.refuse_work()
        self._drain_seq = logged_seq

    def holds_work(self) -> bool:
        return self._running is not None or bool(self._serving) or not self._queue.empty()

    async def close(self) -> None:
        self.host.close()

    def load_report(self) -> ev.LoadReport:
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="prefill",
            queued_requests=self._queue.qsize(),
            queued_tokens=self._queue.queued_tokens,
            running_requests=int(self._running is not None) + len(self._serving),
            kv_used_blocks=self.host.allocator.num_used,
            kv_total_blocks=self.host.cache.num_pages,
        )

    def on_cancel(self, request_id: str, reason: str) -> None:
        """Noted for the lead's checks between chunks. The lead alone ends a cancelled
        request (it aborts the chain, whose other stages then end it and free their
        pages), so that the request ends as cancelled: a stage ending it first would
        reach the lead as an aborted chain, before the lead heard of the cancel."""
        self.liveness.cancel(request_id, reason)

    # --- the lead: intake -----------------------------------------------------------

    async def _on_job(self, msg: Msg) -> None:
        if await take_job(msg, self.instance_id, self._queue, self._refusal) is not None:
            self.gauges.queue.set(self._queue.qsize())

    def _refusal(self, job: pr.PrefillJob) -> str:
        """Why the lead will not queue `job` ('' if it will)."""
        stages = job.decision.prefill_stages
        stopping = self._draining and not decided_before(job.decision, self._drain_seq)
        reason = refusal(job, self.instance_id, self._queue, draining=stopping)
        if not reason and (len(stages) < 2 or stages[0] != self.instance_id):
            reason = (
                f"{self.instance_id} is the lead of prefill group {self.pcfg.group!r}: it "
                "runs only requests planned on the group"
            )
        if not reason and job.sampling.prompt_logprobs is not None:
            # The last stage sends back the logits after the prompt only.
            reason = (
                f"prefill group {self.pcfg.group!r} does not compute a prompt's logprobs "
                "(echo with logprobs): only a whole-model prefill instance does"
            )
        if reason:
            self.metrics.jobs.labels("refused").inc()
        return reason

    # --- the lead: one job at a time ------------------------------------------------

    async def _run_queue(self) -> None:
        """The group's jobs one at a time, each through every stage."""
        while True:
            queued = await self._queue.get()
            self.gauges.queue.set(self._queue.qsize())
            self._running = queued.job.request_id
            self.gauges.batch.set(1)
            try:
                with bind_request(queued.job.request_id):
                    await self._run_job(queued)
            finally:
                self._running = None
                self.gauges.batch.set(0)

    async def _run_job(self, queued: QueuedJob) -> None:
        """One job, traced, its outcome counted and a failure reported."""
        job = queued.job
        ctx = extract_context(queued.trace_headers)
        with _tracer.start_as_current_span(
            "prefill",
            context=ctx,
            kind=trace.SpanKind.CONSUMER,
            start_time=wall_time_ns(queued.enqueued_at),
        ) as span:
            if span.is_recording():
                span.set_attributes(
                    {
                        "yb.request_id": job.request_id,
                        "yb.prompt_tokens": len(job.token_ids),
                        "yb.decode_instance": job.decision.decode_instance,
                        "yb.prefill_stages": len(job.decision.prefill_stages),
                    }
                )
            started = time.monotonic()
            try:
                await self._lead(job)
            except asyncio.CancelledError:
                await self._fail(job, pr.JobFailed("prefill instance shutting down"))
                raise
            except pr.JobFailed as exc:
                self.metrics.jobs.labels("failed").inc()
                await self._fail(job, exc)
                return
            except (TransferError, UpstreamFailed) as exc:
                self.metrics.jobs.labels("failed").inc()
                self._log_event(
                    ev.TransferFailed(
                        request_id=job.request_id,
                        source_instance=self.instance_id,
                        target_instance=job.decision.decode_instance,
                        reason=f"prefill group: {exc}",
                    )
                )
                await self._fail(job, pr.JobFailed(f"prefill group failed: {exc}"))
                return
            except Exception as exc:
                log.exception("prefill_crashed", error=repr(exc))
                self.metrics.jobs.labels("failed").inc()
                await self._fail(job, pr.JobFailed(f"prefill failed: {exc}", status=500))
                return
            self.metrics.jobs.labels("completed").inc()
            self.metrics.prefill.observe(time.monotonic() - started)

    async def _lead(self, job: pr.PrefillJob) -> None:
        """Pages, reservation and prefix; the other stages ready; the chunks through
        the group; the first token; the hand-over (the module docstring's steps)."""
        self.liveness.check(job)
        rid, n = job.request_id, len(job.token_ids)
        stages = job.decision.prefill_stages
        self._log_event(
            ev.RequestProgress(
                request_id=rid, instance_id=self.instance_id, stage="prefill_started"
            )
        )
        wait_s = min(self.liveness.remaining_s(job), self.pcfg.transfer_timeout_s)
        try:
            pages = self.host.allocator.allocate(self.host.cache.pages_for(n))
        except OutOfPages as exc:
            raise pr.JobFailed(f"prefill instance out of KV pages: {exc}") from exc
        sent_to: list[str] = []
        reserved: pr.KVReserved | None = None
        try:
            loading = asyncio.ensure_future(
                self._load_prefix(rid, n, job.block_hashes, job.decision.reuse, pages)
            )
            try:
                reserved = await self._reserve(job, wait_s)
                own_blocks, runs = await loading
            finally:
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)
            puts = self._planned_puts(job)
            asking = [
                asyncio.ensure_future(
                    self._ask_stage(job, reserved, puts, stages, i, wait_s, sent_to)
                )
                for i in range(1, len(stages))
            ]
            try:
                replies = await asyncio.gather(*asking)
            finally:
                for task in asking:
                    task.cancel()
                await asyncio.gather(*asking, return_exceptions=True)
            reused = min([own_blocks, *replies])
            cached = reused * self.host.cache.block_size
            for tier, tokens in self.fetcher.tokens_by_tier(runs, reused).items():
                self.metrics.reused.labels(tier).inc(tokens)
            logits = await self._run_chunks(job, stages, reserved, puts, pages, cached, wait_s)
            first = await self.host.call(self._sample_first, job, logits)
            start = pr.StartDecode(
                request_id=rid,
                first_token=first[0].token_id,
                prompt_tokens=n - job.generated_tokens,
                reused_tokens=cached,
                first_tokens=[s.token_id for s in first] if len(first) > 1 else [],
                first_logprobs=[s.logprob for s in first if s.logprob is not None],
            )
            await self.decode.start(job.decision.decode_instance, start, wait_s)
        except BaseException as exc:
            reason = str(exc) or type(exc).__name__
            for stage in sent_to:
                with contextlib.suppress(BusError):
                    await self.bus.publish_core(
                        pr.prefill_stage_subject(stage),
                        pr.encode(pr.StageAbort(request_id=rid, reason=reason)),
                    )
            if reserved is not None:
                await self.decode.abort(job.decision.decode_instance, rid, "prefill failed")
            raise
        finally:
            await self._free(pages)
        self.metrics.tokens.inc(n - cached)
        self._log_event(
            ev.RequestProgress(
                request_id=rid,
                instance_id=self.instance_id,
                stage="prefill_done",
                computed_tokens=n - cached,
                reused_tokens=cached,
            )
        )
        log.info("group_prefill_done", prompt_tokens=n, reused_tokens=cached, stages=len(stages))

    async def _reserve(self, job: pr.PrefillJob, wait_s: float) -> pr.KVReserved:
        """Decode's pages for every layer of the prompt, laid out as one instance's
        (cut at a tensor-parallel decode instance's runs of heads)."""
        up = self.peers.get(job.decision.decode_instance)
        cuts = transfer_cuts(self.host.stage.config, 1, up.tensor_parallel if up else 1)
        return await self.decode.reserve_for(
            job,
            self.instance_id,
            self.host.cache,
            self.num_layers,
            wait_s,
            head_cuts=cuts if len(cuts) > 2 else None,
        )

    def _planned_puts(self, job: pr.PrefillJob) -> _Puts:
        """The prompt's full blocks the group puts into the lead's host's kvstore: those
        after the prefix the decision planned to reuse (a block it planned is in the
        pool already; one whose fetch fails and is recomputed too)."""
        store = self.peers.kvstore_on(self.cfg.host)
        address = None if store is None else self.peers.address(store.instance_id)
        if not self.pcfg.store_blocks or address is None:
            return _Puts()
        cache = self.host.cache
        full = min(len(job.block_hashes), len(job.token_ids) // cache.block_size)
        engine, runs = plan_runs(job.decision.reuse, self.instance_id, full)
        first = engine + sum(run.count for run in runs)
        rids = [
            PutId(job.block_hashes[i], self.num_layers, cache.page_nbytes).request_id()
            for i in range(first, full)
        ]
        return _Puts(address.to_wire(), first, rids)

    def _block_sinks(self, puts: _Puts) -> list[tuple[int, ReservationTarget]]:
        """One put reservation per block to store (see `serve_stage_request`)."""
        if not puts.request_ids:
            return []
        store = PeerAddress.parse(puts.address)
        return [
            (puts.first + k, ReservationTarget(self.sender, store, rid))
            for k, rid in enumerate(puts.request_ids)
        ]

    async def _ask_stage(
        self,
        job: pr.PrefillJob,
        reserved: pr.KVReserved,
        puts: _Puts,
        stages: Sequence[str],
        index: int,
        wait_s: float,
        sent_to: list[str],
    ) -> int:
        """Send stage `index` of `stages` its `StageJob`; the blocks it loaded."""
        stage = stages[index]
        last = index == len(stages) - 1
        message = pr.StageJob(
            request_id=job.request_id,
            lead_instance=self.instance_id,
            next_instance=self.instance_id if last else stages[index + 1],
            last=last,
            prompt_len=len(job.token_ids),
            deadline=job.deadline,
            decode_instance=job.decision.decode_instance,
            decode_address=reserved.ucx_address,
            num_pages=reserved.num_pages,
            head_cuts=reserved.head_cuts,
            block_hashes=job.block_hashes,
            reuse=job.decision.reuse if self.pcfg.reuse else [],
            trace_headers=job.trace_headers,
            store_address=puts.address,
            first_put=puts.first,
            puts=puts.request_ids,
        )
        sent_to.append(stage)
        try:
            msg = await self.bus.request(
                pr.prefill_stage_subject(stage), pr.encode(message), timeout_s=wait_s
            )
            reply = pr.stage_reply_decoder.decode(msg.data)
        except (BusError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise pr.JobFailed(f"stage {stage} of the prefill group unreachable: {exc}") from exc
        if isinstance(reply, pr.StageRefused):
            raise pr.JobFailed(f"stage {stage} of the prefill group refused: {reply.reason}")
        return reply.reused_blocks

    async def _run_chunks(
        self,
        job: pr.PrefillJob,
        stages: Sequence[str],
        reserved: pr.KVReserved,
        puts: _Puts,
        pages: list[int],
        cached: int,
        wait_s: float,
    ) -> torch.Tensor:
        """The prompt after `cached` through the group; the logits the last stage
        sends back."""
        rid, n = job.request_id, len(job.token_ids)
        spans = chunk_spans(n, cached, self.pcfg.chunk_size)
        next_stage = await self._address(stages[1], wait_s)
        decode = ReservationTarget(self.sender, PeerAddress.parse(reserved.ucx_address), rid)
        serving = asyncio.ensure_future(
            serve_stage_request(
                self.host.runner,
                rid,
                pages,
                _PromptChunks(self, job, spans),
                ActivationSender[HiddenHeader](self.sender, next_stage),
                wait_s=wait_s,
                kv=decode,
                blocks=self._block_sinks(puts),
                compute=self.host.call,
                kv_cuts=reserved.head_cuts,
            )
        )
        # The logits come after the whole pipeline: bounded by the request's deadline.
        whole_s = max(wait_s, self.liveness.remaining_s(job))
        answer = asyncio.ensure_future(
            self.activations.receive(rid, len(spans) - 1, deadline_s=whole_s)
        )
        try:
            # Either failing ends the request: the chain is aborted from here on.
            done, _ = await asyncio.wait({serving, answer}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            await serving
            header, payload = await answer
            if not await self.activations.wait_closed(rid, deadline_s=wait_s):
                raise UpstreamFailed(f"the last stage aborted {rid}")
            return hidden_from_buffer(header, payload.data, "cpu")
        finally:
            for task in (serving, answer):
                task.cancel()
            await asyncio.gather(serving, answer, return_exceptions=True)
            self.activations.forget(rid)

    def _sample_first(self, job: pr.PrefillJob, logits: torch.Tensor) -> list[Sampled]:
        """Each choice's first token, with the code every engine samples with."""
        k = job.generated_tokens
        return sample_first_tokens(
            logits,
            job.sampling,
            job.token_ids[len(job.token_ids) - k :] if k else [],
            tokenizer=self.host.stage.tokenizer,
            eos_token_ids=self.host.stage.config.eos_token_ids,
        )

    # --- every stage but the lead ---------------------------------------------------

    async def _on_stage_control(self, msg: Msg) -> None:
        try:
            control = pr.stage_control_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("malformed_stage_job", error=str(exc))
            await respond(
                msg, pr.StageRefused(request_id="", instance_id=self.instance_id, reason=str(exc))
            )
            return
        if isinstance(control, pr.StageAbort):
            serving = self._serving.get(control.request_id)
            if serving is not None:
                log.info("stage_aborted", request_id=control.request_id, reason=control.reason)
                serving.cancel()
            return
        job = control
        if reason := self._stage_refusal(job):
            await respond(
                msg,
                pr.StageRefused(
                    request_id=job.request_id, instance_id=self.instance_id, reason=reason
                ),
            )
            return
        try:
            pages = self.host.allocator.allocate(self.host.cache.pages_for(job.prompt_len))
        except OutOfPages as exc:
            await respond(
                msg,
                pr.StageRefused(
                    request_id=job.request_id,
                    instance_id=self.instance_id,
                    reason=f"out of KV pages: {exc}",
                ),
            )
            return
        task = self.tasks.spawn(f"stage:{job.request_id}", self._serve_stage(job, pages, msg))
        self._serving[job.request_id] = task
        task.add_done_callback(lambda _: self._serving.pop(job.request_id, None))

    def _stage_refusal(self, job: pr.StageJob) -> str:
        """Why this stage will not serve `job` ('' if it will)."""
        if self._draining and not self._drain_seq:
            return "prefill instance shutting down"
        if self.is_lead:
            return f"{self.instance_id} leads its group: it sends stage jobs, it takes none"
        if job.request_id in self._serving:
            return f"{job.request_id} is served here already"
        lead = self.peers.get(job.lead_instance)
        if lead is None or lead.group != self.pcfg.group:
            return f"{job.lead_instance} does not lead prefill group {self.pcfg.group!r}"
        if job.deadline and job.deadline < time.time():
            return "deadline passed before the stage job arrived"
        return ""

    async def _serve_stage(self, job: pr.StageJob, pages: list[int], msg: Msg) -> None:
        """Load this stage's prefix, answer `StageReady`, then serve the request's
        chunks; the pages are given back however it ends. Owned by the supervisor:
        it never raises (the lead hears of a failure through the chain)."""
        rid = job.request_id
        remaining = job.deadline - time.time() if job.deadline else 600.0
        wait_s = max(0.0, min(remaining, self.pcfg.transfer_timeout_s))
        try:
            with bind_request(rid):
                try:
                    reused, _ = await self._load_prefix(
                        rid, job.prompt_len, job.block_hashes, job.reuse, pages
                    )
                    next_stage = await self._address(job.next_instance, wait_s)
                except (TransferError, pr.JobFailed) as exc:
                    await respond(
                        msg,
                        pr.StageRefused(
                            request_id=rid, instance_id=self.instance_id, reason=str(exc)
                        ),
                    )
                    return
                await respond(
                    msg,
                    pr.StageReady(
                        request_id=rid, instance_id=self.instance_id, reused_blocks=reused
                    ),
                )
                decode = ReservationTarget(self.sender, PeerAddress.parse(job.decode_address), rid)
                puts = _Puts(job.store_address, job.first_put, job.puts)
                failed = await serve_stage_request(
                    self.host.runner,
                    rid,
                    pages,
                    self.activations,
                    ActivationSender[HiddenHeader](self.sender, next_stage),
                    wait_s=wait_s,
                    kv=decode,
                    commit_kv=job.last,
                    blocks=self._block_sinks(puts),
                    compute=self.host.call,
                    kv_cuts=job.head_cuts,
                )
                if job.last:
                    # The last stage commits the puts: their outcome is its to count
                    # (a block held already counts as failed).
                    self.metrics.puts.labels("stored").inc(len(job.puts) - failed)
                    self.metrics.puts.labels("failed").inc(failed)
                log.info(
                    "stage_served",
                    prompt_tokens=job.prompt_len,
                    last=job.last,
                    blocks_put=len(job.puts),
                    puts_failed=failed,
                )
        except asyncio.CancelledError:
            log.info("stage_cancelled", request_id=rid)
        except Exception as exc:
            # The request's end: the stages after this one were told (aborted), the
            # lead fails the job; this stage only frees what it held.
            log.warning("stage_failed", request_id=rid, error=repr(exc))
        finally:
            self.activations.forget(rid)
            await self._free(pages)

    # --- shared ---------------------------------------------------------------------

    async def _free(self, pages: list[int]) -> None:
        """Give pages back once the stage's thread has finished whatever was queued
        on it (a chunk of a request that failed meanwhile may still be writing them)."""
        try:
            await self.host.call(_stage_barrier)
        except RuntimeError:
            return  # the thread is shut down: so is the process, pages and all
        self.host.allocator.free(pages)

    async def _load_prefix(
        self,
        request_id: str,
        prompt_len: int,
        block_hashes: Sequence[int],
        plans: Sequence[ev.ReusePlan],
        pages: list[int],
    ) -> tuple[int, list[FetchRun]]:
        """This stage's layers of the planned prefix, into `pages`: the blocks loaded
        in a row from the first (a failed fetch is recomputed: a shorter prefix), and
        the fetches planned."""
        if not self.pcfg.reuse or not plans:
            return 0, []
        limit = reusable_blocks(prompt_len, len(block_hashes), self.host.cache.block_size)
        engine, runs = plan_runs(plans, self.instance_id, limit)
        if engine:
            return 0, []  # a stage caches nothing: a plan naming its engine is stale
        fetched = await self.fetcher.fetch(
            request_id, runs, block_hashes, pages, self.pcfg.fetch_timeout_s
        )
        if fetched.fetched_bytes:
            self.metrics.fetch.observe(fetched.fetch_s)
        for failure in fetched.failures:
            self.metrics.fetch_failures.inc()
            self._log_event(
                ev.TransferFailed(
                    request_id=request_id,
                    source_instance=failure.source,
                    target_instance=self.instance_id,
                    reason=f"prefix blocks {failure.first}..{failure.first + failure.count - 1}"
                    f" (stage): {failure.reason}",
                )
            )
        return fetched.reaches(0), runs

    async def _address(self, instance_id: str, wait_s: float) -> PeerAddress:
        """The UCX address of another stage (waiting briefly for its announcement)."""
        address = self.peers.address(instance_id)
        if address is None:
            await self.peers.wait_for(instance_id, min(wait_s, 2.0))
            address = self.peers.address(instance_id)
        if address is None:
            raise pr.JobFailed(f"stage {instance_id} of the prefill group is not up")
        return address


def _stage_barrier() -> None:
    """Runs on the stage's thread after everything submitted before it."""
