"""The prefill engine service.

It takes jobs from gateways (`yb.job.prefill.<id>`, core NATS request/reply), queues
them, and runs them one at a time on its engine: reserve pages on the decode instance
the conductor chose, load the prefix the decision says to reuse (from this engine's
own page cache, this host's kvstore or another host's, `reuse.PrefixLoader`), compute
the rest of the prompt in chunks while streaming every page (the loaded prefix
included) to that instance over UCX layer by layer, commit, and hand the request over
with its first token. Then the prompt's full blocks stay in the engine's page cache
(announced as tier "engine" block events) and the ones computed here are put into the
host's kvstore in the background (`uploads.BlockUploader`). Every step has a
deadline; a failure ends the request with an error on its token stream and a
`RequestFinished(failed)` event, and frees what it held; a failed prefix fetch only
costs its recompute (and a `TransferFailed` event).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.block_events import AnyBlockEvent, BlockEventPublisher, BlockLog
from yb_core.bus import Bus, BusError
from yb_core.config import YbConfig
from yb_core.failpoints import Failpoints
from yb_core.instance import CancellationFollower, Presence
from yb_core.service import Service
from yb_core.telemetry import (
    bind_request,
    extract_context,
    get_logger,
    trace_carrier,
    trace_id_hex,
    tracer,
)
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress, TransferError
from yb_engine.host import EngineGauges, EngineHost
from yb_engine.kv_cache import OutOfPages
from yb_prefill.prefix_cache import PrefixCache
from yb_prefill.reuse import Prefix, PrefixLoader
from yb_prefill.streaming import LayerStreamer
from yb_prefill.uploads import BlockUploader

log = get_logger(__name__)
_tracer = tracer(__name__)

MAX_QUEUE = 256


class JobFailed(Exception):
    """A job that cannot complete; `status` is the HTTP status the client should see."""

    def __init__(self, reason: str, status: int = 503) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass
class QueuedJob:
    """A job waiting for the engine."""

    job: pr.PrefillJob
    trace_headers: dict[str, str]
    enqueued_at: float = field(default_factory=time.monotonic)


class PrefillService(Service):
    """Runs prefill jobs on one engine and streams their KV to decode instances."""

    role = "prefill"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg)
        self.engine = EngineHost(cfg, cfg.prefill, self.instance_id)
        self.gauges = EngineGauges(self.metrics)
        self.sender = KVSender()
        self.receiver = KVReceiver(cfg.prefill.ucx_host, cfg.prefill.ucx_port)
        self.receiver.export_metrics(self.metrics)
        self.block_log = BlockLog(self.instance_id)
        self.publisher: BlockEventPublisher | None = None
        self.peers: PeerDirectory | None = None
        self.cache: PrefixCache | None = None
        self.loader: PrefixLoader | None = None
        self.uploader: BlockUploader | None = None
        self.bus: Bus | None = None
        self.presence: Presence | None = None
        self.cancellations: CancellationFollower | None = None
        self._queue: asyncio.Queue[QueuedJob] = asyncio.Queue(maxsize=MAX_QUEUE)
        self._queued_tokens = 0
        self._running: str | None = None
        self._cancelled: dict[str, str] = {}
        self._draining = False
        self._subscription: object | None = None
        # Test-only fault injection: inert unless YB_FAILPOINTS arms it.
        self.failpoints = Failpoints.from_text(cfg.failpoints, self.instance_id)
        self._m_prefill = Histogram(
            "yb_prefill_seconds",
            "Prefill time per request (compute and KV streaming)",
            registry=self.metrics,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self._m_jobs = Counter(
            "yb_prefill_jobs_total", "Jobs by outcome", ["outcome"], registry=self.metrics
        )
        self._m_tokens = Counter(
            "yb_prefill_tokens_total", "Prompt tokens computed", registry=self.metrics
        )
        self._m_reused = Counter(
            "yb_prefill_reused_tokens_total",
            "Prompt tokens whose KV was reused, by where it came from",
            ["source"],
            registry=self.metrics,
        )
        self._m_fetch = Histogram(
            "yb_prefill_prefix_fetch_seconds",
            "Time to pull a planned prefix from kvstores",
            registry=self.metrics,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
        )
        self._m_fetch_failures = Counter(
            "yb_prefill_prefix_fetch_failures_total",
            "Planned prefix fetches that failed (recomputed instead)",
            registry=self.metrics,
        )
        self._m_puts = Counter(
            "yb_prefill_block_puts_total",
            "Blocks put into the host's kvstore, by outcome",
            ["outcome"],
            registry=self.metrics,
        )
        self._m_cached = Gauge(
            "yb_prefill_engine_cache_blocks",
            "Blocks kept in the engine's own pages",
            registry=self.metrics,
        )

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model, subscribe to jobs and announce the instance."""
        self.serve_metrics()
        self.bus = await self.connect_bus()
        await self.engine.load()
        assert self.engine.cache is not None
        assert self.engine.allocator is not None
        self.gauges.follow(self.engine.allocator, self.engine.cache.num_pages)
        pcfg = self.cfg.prefill
        self.cache = PrefixCache(
            self.engine.allocator,
            min(pcfg.prefix_cache_pages, self.engine.cache.num_pages),
            self.block_log,
            self._emit_block_event,
        )
        # Idle, the engine holds exactly its cached blocks: any page used beyond them
        # is held for a request (which is how a leak shows).
        cache = self.cache
        self._m_cached.set_function(lambda: len(cache))
        self.publisher = BlockEventPublisher(self.bus, self.block_log, self.cache.inventory)
        await self.publisher.open()
        self.cache.open()  # a new epoch: whatever an earlier life cached is gone
        self.peers = PeerDirectory(self.bus)
        await self.peers.open()
        self.receiver.set_peer_check(self.peers.knows_worker)
        address = await self.receiver.start()
        self.loader = PrefixLoader(
            self.instance_id, self.cache, self.engine.cache, self.peers, self.receiver, self.sender
        )
        self.uploader = BlockUploader(
            self.cache, self.engine.cache, self.sender, deadline_s=pcfg.transfer_timeout_s
        )
        self.cancellations = CancellationFollower(self.bus, self._on_cancel)
        await self.cancellations.start()
        self._subscription = await self.bus.subscribe(
            pr.prefill_job_subject(self.instance_id), cb=self._on_job
        )
        self.presence = Presence(
            self.bus,
            ev.InstanceUp(
                instance_id=self.instance_id,
                role="prefill",
                host=self.cfg.host,
                model=self.cfg.model.name,
                ucx_address=address.to_wire(),
                block_size=self.cfg.model.block_size,
                kv_capacity_blocks=self.engine.cache.num_pages,
                max_batch_size=1,
                epoch=self.block_log.epoch,
                attention_backend=self.engine.attention_backend,
                metrics_address=self.metrics_address,
            ),
            self._load_report,
            self.cfg.prefill.load_report_interval_s,
        )
        await self.presence.announce()
        self.tasks.spawn("block-events", self.publisher.run_publisher())
        self.tasks.spawn("resyncs", self.publisher.run_resyncs())
        self.tasks.spawn("peers", self.peers.run())
        self.tasks.spawn("worker", self._worker())
        self.tasks.spawn("presence", self.presence.run())
        self.tasks.spawn("cancellations", self.cancellations.run())

    async def stop(self) -> None:
        """Refuse new jobs, fail queued ones, stop the engine, retire; idempotent."""
        self._draining = True
        if self.presence is not None:
            await self.presence.retire("stopped")
            self.presence = None
        await self.tasks.shutdown()
        while not self._queue.empty():
            queued = self._queue.get_nowait()
            await self._fail(queued.job, JobFailed("prefill instance shutting down"))
        if self.cancellations is not None:
            await self.cancellations.close()
        await self.receiver.close()
        await self.sender.close()
        self.engine.close()
        if self.bus is not None:
            bus, self.bus = self.bus, None
            await bus.close()

    # --- intake ---------------------------------------------------------------------

    async def _on_job(self, msg: Msg) -> None:
        try:
            job = pr.job_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("malformed_job", error=str(exc))
            await self._reply(
                msg,
                pr.JobRefused(
                    request_id="",
                    instance_id=self.instance_id,
                    reason=f"malformed job: {exc}",
                    retryable=False,
                ),
            )
            return
        reason = ""
        if self._draining:
            reason = "prefill instance shutting down"
        elif self._queue.full():
            reason = "prefill queue full"
        elif job.decision.prefill_instance != self.instance_id:
            reason = f"job is planned for {job.decision.prefill_instance}"
        elif job.deadline and job.deadline < time.time():
            reason = "deadline passed before the job arrived"
        if reason:
            self._m_jobs.labels("refused").inc()
            await self._reply(
                msg,
                pr.JobRefused(
                    request_id=job.request_id, instance_id=self.instance_id, reason=reason
                ),
            )
            return
        self._queued_tokens += len(job.token_ids)
        # The trace context comes in the NATS headers (the job's copy is the fallback).
        headers = trace_carrier(msg.headers) or dict(job.trace_headers)
        self._queue.put_nowait(QueuedJob(job, headers))
        self.gauges.queue.set(self._queue.qsize())
        await self._reply(
            msg,
            pr.JobAccepted(
                request_id=job.request_id,
                instance_id=self.instance_id,
                queue_position=self._queue.qsize(),
            ),
        )

    async def _reply(self, msg: Msg, reply: pr.JobReply) -> None:
        with contextlib.suppress(Exception):
            await msg.respond(pr.encode(reply))

    def _on_cancel(self, request_id: str, reason: str) -> None:
        self._cancelled[request_id] = reason or "cancelled"
        # Bound the memory of cancellations for requests this instance never saw.
        if len(self._cancelled) > 10_000:
            for key in list(self._cancelled)[:5_000]:
                del self._cancelled[key]

    # --- the engine loop ------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            queued = await self._queue.get()
            self.gauges.queue.set(self._queue.qsize())
            job = queued.job
            self._queued_tokens -= len(job.token_ids)
            self._running = job.request_id
            self.gauges.batch.set(1)
            try:
                with bind_request(job.request_id):
                    await self._run(job, queued.trace_headers)
            except asyncio.CancelledError:
                await self._fail(job, JobFailed("prefill instance shutting down"))
                raise
            finally:
                self._running = None
                self.gauges.batch.set(0)

    async def _run(self, job: pr.PrefillJob, trace_headers: dict[str, str]) -> None:
        ctx = extract_context(trace_headers)
        log.info(
            "prefill_started",
            prompt_tokens=len(job.token_ids),
            decode=job.decision.decode_instance,
            trace_id=trace_id_hex(trace_headers),
        )
        with _tracer.start_as_current_span("prefill", context=ctx) as span:
            span.set_attribute("yb.request_id", job.request_id)
            span.set_attribute("yb.prompt_tokens", len(job.token_ids))
            started = time.monotonic()
            try:
                await self._prefill(job, span)
            except JobFailed as exc:
                self._m_jobs.labels("failed").inc()
                await self._fail(job, exc)
                return
            except TransferError as exc:
                self._m_jobs.labels("failed").inc()
                await self._publish(
                    ev.TransferFailed(
                        request_id=job.request_id,
                        source_instance=self.instance_id,
                        target_instance=job.decision.decode_instance,
                        reason=str(exc),
                    )
                )
                await self._fail(job, JobFailed(f"KV transfer to decode failed: {exc}"))
                return
            except Exception as exc:
                # One job's bug or bad input (the engine refusing a prompt, say) ends
                # that job, not the worker: a crashed worker takes every queued job
                # and the whole instance with it. Its pages were given back on the
                # way out of `_prefill`.
                log.exception("prefill_crashed", error=repr(exc))
                self._m_jobs.labels("failed").inc()
                await self._fail(job, JobFailed(f"prefill failed: {exc}", status=500))
                return
            self._m_jobs.labels("completed").inc()
            self._m_prefill.observe(time.monotonic() - started)

    async def _prefill(self, job: pr.PrefillJob, span: trace.Span) -> None:
        assert self.bus is not None
        assert self.engine.cache is not None
        assert self.engine.allocator is not None
        assert self.engine.runner is not None
        self._check_alive(job)
        t_start = time.monotonic()
        decode_id = job.decision.decode_instance
        await self._publish(
            ev.RequestProgress(
                request_id=job.request_id, instance_id=self.instance_id, stage="prefill_started"
            )
        )
        remaining = self._remaining(job)
        transfer_deadline = min(remaining, self.cfg.prefill.transfer_timeout_s)
        # 1. Room on the decode instance, before any compute is spent.
        reserve = pr.ReserveKV(
            request_id=job.request_id,
            prefill_instance=self.instance_id,
            num_tokens=len(job.token_ids),
            sampling=job.sampling,
            token_subject=job.token_subject,
            deadline=job.deadline,
            prompt_token_ids=job.token_ids,
            trace_headers=job.trace_headers,
            ttft_started=job.decision.time,
        )
        reply = await self._decode_request(decode_id, reserve, transfer_deadline)
        if isinstance(reply, pr.ReserveRefused):
            raise JobFailed(f"decode instance {decode_id} refused: {reply.reason}")
        if not isinstance(reply, pr.KVReserved):
            raise JobFailed(f"unexpected reply from decode instance: {type(reply).__name__}")
        cache = self.engine.cache
        num_pages = cache.pages_for(len(job.token_ids))
        if (reply.num_pages, reply.num_layers, reply.page_nbytes, reply.block_size) != (
            num_pages,
            cache.num_layers,
            cache.page_nbytes,
            cache.block_size,
        ):
            await self._abort_reservation(decode_id, job.request_id, "layout mismatch")
            raise JobFailed(
                f"decode KV layout {reply.num_pages}x{reply.num_layers}x{reply.page_nbytes}B "
                f"does not match prefill's {num_pages}x{cache.num_layers}x{cache.page_nbytes}B",
                status=500,
            )
        # 2. Pages here, the planned prefix loaded into them.
        assert self.loader is not None and self.cache is not None
        n = len(job.token_ids)
        plans = job.decision.reuse if self.cfg.prefill.reuse else []
        try:
            await self._failpoint(job, "prefill.load")
            self._check_alive(job)
            prefix = await self.loader.load(
                job.request_id,
                n,
                job.block_hashes,
                plans,
                min(transfer_deadline, self.cfg.prefill.fetch_timeout_s),
            )
        except OutOfPages as exc:
            await self._abort_reservation(decode_id, job.request_id, "prefill out of pages")
            raise JobFailed(f"prefill instance out of KV pages: {exc}") from exc
        except BaseException:
            await self._abort_reservation(decode_id, job.request_id, "prefill failed")
            raise
        cached_tokens = prefix.reused_blocks * cache.block_size
        t_loaded = time.monotonic()
        computed = False
        try:
            await self._account_prefix(job, prefix, span)
            # 3. Compute the rest with layer-wise streaming (the loaded prefix first),
            # then commit.
            streamer = LayerStreamer(
                asyncio.get_running_loop(),
                self.sender,
                PeerAddress.parse(reply.ucx_address),
                job.request_id,
                cache,
                prefix.block_table,
                n,
                cached_tokens,
                transfer_deadline,
                reply.breaks,
            )
            streamer.start()
            streamer.queue_prefix(prefix.reused_blocks)
            try:
                first_token = await self._compute_with_holds(
                    job, prefix.block_table, cached_tokens, streamer
                )
                computed = True
                t_computed = time.monotonic()
                await self._failpoint(job, "prefill.commit")
                self._check_alive(job)
                await streamer.finish()
            except BaseException:
                await streamer.abort()
                raise
        except BaseException:
            await self._abort_reservation(decode_id, job.request_id, "prefill failed")
            raise
        finally:
            await self._keep_blocks(job, prefix, computed)
        self._m_tokens.inc(n - cached_tokens)
        span.set_attribute("yb.pages_sent", streamer.pages_sent)
        # 4. Hand the request over; decode verifies the commit before admitting it.
        start = pr.StartDecode(
            request_id=job.request_id,
            first_token=first_token,
            prompt_tokens=n,
            reused_tokens=cached_tokens,
        )
        ack = await self._decode_request(decode_id, start, transfer_deadline)
        if not isinstance(ack, pr.DecodeAck) or not ack.ok:
            reason = ack.reason if isinstance(ack, pr.DecodeAck) else type(ack).__name__
            raise JobFailed(f"decode instance did not start the request: {reason}")
        await self._publish(
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
            prompt_tokens=n,
            reused_tokens=cached_tokens,
            fetch_s=round(prefix.fetch_s, 4),
            # Where the time went: reserve on decode and load the prefix, compute (with
            # streaming alongside), the streaming left after compute plus the hand-over.
            load_s=round(t_loaded - t_start, 4),
            compute_s=round(t_computed - t_loaded, 4),
            tail_s=round(t_done - t_computed, 4),
        )

    async def _account_prefix(self, job: pr.PrefillJob, prefix: Prefix, span: trace.Span) -> None:
        """Metrics, trace attributes and `TransferFailed` events for a loaded prefix."""
        for tier, tokens in prefix.tokens_by_tier.items():
            self._m_reused.labels(tier).inc(tokens)
        if prefix.fetched_bytes:
            self._m_fetch.observe(prefix.fetch_s)
        span.set_attribute("yb.reused_blocks", prefix.reused_blocks)
        span.set_attribute("yb.engine_blocks", prefix.engine_blocks)
        for failure in prefix.failures:
            self._m_fetch_failures.inc()
            await self._publish(
                ev.TransferFailed(
                    request_id=job.request_id,
                    source_instance=failure.source,
                    target_instance=self.instance_id,
                    reason=f"prefix blocks {failure.first}..{failure.first + failure.count - 1}: "
                    f"{failure.reason}",
                )
            )

    async def _keep_blocks(self, job: pr.PrefillJob, prefix: Prefix, computed: bool) -> None:
        """After a prefill: cache its full blocks, upload the new ones, free the rest."""
        assert self.cache is not None and self.uploader is not None and self.peers is not None
        cache = self.cache
        if not computed:
            # The pages hold garbage or half a prompt: give them back, but only once the
            # engine thread is done with them (a cancelled call may still be running;
            # the engine runs its calls in order).
            try:
                await self.engine.call(_engine_barrier)
            except RuntimeError:
                return  # the engine is shut down: so is the process, pages and all
            self._loader_release(prefix)
            return
        bs = self.engine.cache.block_size if self.engine.cache else 1
        full = min(len(job.block_hashes), len(job.token_ids) // bs)
        first = prefix.engine_blocks
        keys = list(job.block_hashes[first:full])
        spare = cache.adopt(keys, prefix.block_table[first:full])
        cache.free(spare + prefix.block_table[max(full, first) :])
        cache.release(prefix.engine_keys)
        prefix.engine_keys = []
        store = self.peers.kvstore_on(self.cfg.host)
        if not self.cfg.prefill.store_blocks or store is None:
            cache.release(keys)
        else:
            # Blocks this host's kvstore gave us are there already; the rest go there
            # (those pulled from another host: a replica on this one).
            upload = [
                job.block_hashes[i]
                for i in range(first, full)
                if prefix.loaded_from.get(i) != store.instance_id
            ]
            uploading = set(upload)
            cache.release([k for k in keys if k not in uploading])
            if upload:
                address = self.peers.address(store.instance_id)
                self.tasks.spawn(f"upload:{job.request_id}", self._upload(address, upload))

    def _loader_release(self, prefix: Prefix) -> None:
        assert self.loader is not None and self.cache is not None
        self.loader.release(prefix)

    async def _upload(self, address: PeerAddress | None, keys: list[int]) -> None:
        """Owned background task: put blocks into the host's kvstore; never raises."""
        assert self.uploader is not None
        try:
            result = await self.uploader.upload(address, keys)
        except Exception as exc:  # a crash here must not take the service down
            log.exception("block_upload_crashed", error=repr(exc))
            return
        for outcome in ("stored", "duplicate", "failed", "skipped"):
            count = getattr(result, outcome)
            if count:
                self._m_puts.labels(outcome).inc(count)

    async def _compute_with_holds(
        self, job: pr.PrefillJob, pages: list[int], cached: int, streamer: LayerStreamer
    ) -> int:
        """`_compute` on the engine thread; with failpoint `prefill.chunk` armed at k,
        in two calls (chunks before k, then the rest: the same chunk boundaries) with
        the hold between them, so the engine thread is never the one that waits."""
        k = self.failpoints.count("prefill.chunk")
        split = cached + k * self.cfg.prefill.chunk_size if k is not None else len(job.token_ids)
        if split < len(job.token_ids):
            if split > cached:
                await self.engine.call(self._compute_part, job, pages, cached, split, streamer)
                cached = split
            await self._failpoint(job, "prefill.chunk")
            self._check_alive(job)
        return await self.engine.call(self._compute, job, pages, cached, streamer)

    async def _failpoint(self, job: pr.PrefillJob, point: str) -> None:
        """Hold the job at `point` if a test armed it; a cancel or the request's
        deadline ends the hold (the caller's `_check_alive` then fails the job)."""
        if self.failpoints.count(point) is None:
            return
        rid = job.request_id
        await self.failpoints.hold(
            point, rid, cancelled=lambda: rid in self._cancelled or self._remaining(job) <= 0
        )

    def _compute_part(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        num_cached_tokens: int,
        end: int,
        streamer: LayerStreamer,
    ) -> None:
        """Engine thread: compute the KV of tokens [num_cached_tokens, end) only."""
        runner = self.engine.runner
        assert runner is not None
        runner.prefill(
            job.token_ids[:end],
            pages,
            num_cached_tokens=num_cached_tokens,
            chunk_size=self.cfg.prefill.chunk_size,
            layer_hook=streamer.on_layer,
        )

    def _compute(
        self,
        job: pr.PrefillJob,
        pages: list[int],
        num_cached_tokens: int,
        streamer: LayerStreamer,
    ) -> int:
        """Engine thread: run the prefill over the uncached suffix, sample the first token."""
        from yb_engine.sampling import Sampler, new_generator

        runner = self.engine.runner
        assert runner is not None
        logits = runner.prefill(
            job.token_ids,
            pages,
            num_cached_tokens=num_cached_tokens,
            chunk_size=self.cfg.prefill.chunk_size,
            layer_hook=streamer.on_layer,
        )
        (token,) = Sampler().sample(logits[None], [job.sampling], [new_generator(job.sampling)])
        return int(token)

    def _emit_block_event(self, event: AnyBlockEvent) -> None:
        assert self.publisher is not None
        self.publisher.emit(event)

    async def _decode_request(
        self, decode_id: str, message: pr.DecodeControl, timeout_s: float
    ) -> pr.DecodeReply:
        assert self.bus is not None
        try:
            msg = await self.bus.request(
                pr.decode_control_subject(decode_id), pr.encode(message), timeout_s=timeout_s
            )
        except BusError as exc:
            raise JobFailed(f"decode instance {decode_id} unreachable: {exc}") from exc
        try:
            return pr.decode_reply_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise JobFailed(f"malformed reply from decode instance: {exc}", 502) from exc

    async def _abort_reservation(self, decode_id: str, request_id: str, reason: str) -> None:
        with contextlib.suppress(JobFailed):
            await self._decode_request(
                decode_id, pr.AbortReservation(request_id=request_id, reason=reason), 2.0
            )

    def _check_alive(self, job: pr.PrefillJob) -> None:
        if job.request_id in self._cancelled:
            raise JobFailed(f"cancelled: {self._cancelled[job.request_id]}", status=499)
        if self._remaining(job) <= 0:
            raise JobFailed("request deadline passed during prefill", status=504)

    @staticmethod
    def _remaining(job: pr.PrefillJob) -> float:
        return job.deadline - time.time() if job.deadline else 600.0

    async def _fail(self, job: pr.PrefillJob, exc: JobFailed) -> None:
        """End a request that never reached decode: an error chunk and an event."""
        log.warning("prefill_failed", request_id=job.request_id, reason=exc.reason)
        if self.bus is None:
            return
        chunk = pr.TokenChunk(
            request_id=job.request_id,
            seq=0,
            finished=True,
            finish_reason="error",
            error=exc.reason,
            error_status=exc.status,
            prompt_tokens=len(job.token_ids),
        )
        with contextlib.suppress(BusError):
            await self.bus.publish_core(job.token_subject, pr.encode(chunk))
        outcome: ev.RequestOutcome = "cancelled" if exc.status == 499 else "failed"
        await self._publish(
            ev.RequestFinished(
                request_id=job.request_id,
                instance_id=self.instance_id,
                outcome=outcome,
                reason=exc.reason,
                prompt_tokens=len(job.token_ids),
            )
        )

    async def _publish(self, event: ev.AnyEvent) -> None:
        if self.bus is not None:
            await self.bus.try_publish(event)

    def _load_report(self) -> ev.LoadReport:
        allocator = self.engine.allocator
        cache = self.engine.cache
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="prefill",
            queued_requests=self._queue.qsize(),
            queued_tokens=self._queued_tokens,
            running_requests=1 if self._running else 0,
            kv_used_blocks=allocator.num_used if allocator else 0,
            kv_total_blocks=cache.num_pages if cache else 0,
        )


def _engine_barrier() -> None:
    """Runs on the engine thread after everything submitted before it."""
