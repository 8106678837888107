"""Prompts prefilled inside this instance's decode batch (piggybacking).

With `decode.piggyback` on, the instance announces `piggyback` in its `InstanceUp`,
and the conductor may plan a short prompt here (`RequestScheduled.piggyback`, with
this instance as both `prefill_instance` and `decode_instance`). The gateway then
hands the job to this instance exactly as to a prefill instance: a `PrefillJob` on
`yb.job.prefill.<its id>` (NATS request/reply). The instance:

1. validates it (`refusal`): a job of a decision that is not piggybacked, or planned
   for other instances, or with an option a decode batch cannot run (a prefill
   group's stages, the prompt's logprobs) is refused with a `JobRefused` that says
   why, never run another way;
2. loads the plan's reused blocks from the kvstores into its own pages over UCX
   (`PromptLoader`, the prefill's fetch code, `yb_dataplane.prefix_fetch`), within
   `decode.fetch_timeout_s` and the request's deadline; a fetch that fails is logged
   (`TransferFailed`) and its blocks are computed instead;
3. gives the prompt to the batcher (`DecodeBatcher.add_prompt`) with those pages:
   each decode step computes a chunk of it beside the running streams, each step
   within the TBT limit the decision was planned with, and the step that computes
   the last chunk yields the first token;
4. puts the prompt's full blocks into its host's kvstore as a prefill instance does
   (`yb_dataplane.block_upload`: all but those loaded from that kvstore, under the
   blocks' hashes, each put within `decode.transfer_timeout_s`; `store_blocks` off:
   none). The batcher keeps their pages from the step that computed the prompt
   (`keep_blocks`, handed over by that same engine call), so the upload reads them
   even after the request ended; an owned task uploads them after that step, off
   the first token's path, and gives the pages back when it is done, or when the
   instance's shutdown cancels it. A failed put is logged and counted, never the
   request's failure. The kvstore's `BlockStored` events tell the conductor, which
   offers the blocks to later requests.

Its progress is logged as a prefill's (`prefill_started` at its first chunk,
`prefill_done` with computed and reused tokens and `kv_committed` at its first token)
and every token, the first included, streams to the gateway as any decode stream
does. A cancel frees its pages wherever it is (loading or in the batch); the
instance's shutdown ends it with a 503, which the gateway may re-plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.telemetry import bind_request, get_logger, trace_carrier
from yb_dataplane.block_upload import BlockUploader, blocks_to_store, full_blocks
from yb_dataplane.prefix_fetch import BlockFetcher, Fetched, plan_runs, reusable_blocks
from yb_engine.kv_cache import OutOfPages

if TYPE_CHECKING:
    from yb_decode.service import DecodeWorker
    from yb_engine.batcher import TokenOutput

log = get_logger(__name__)


def refusal(
    job: pr.PrefillJob,
    instance_id: str,
    *,
    enabled: bool,
    draining: bool,
    max_model_len: int,
    now: float,
) -> tuple[str, bool] | None:
    """Why this instance does not take `job` into its batch, and whether another
    instance might (None: it does)."""
    decision = job.decision
    if draining:
        return "decode instance shutting down", True
    if not enabled:
        return f"decode instance {instance_id} does not prefill (decode.piggyback is off)", False
    if not decision.piggyback:
        return (
            f"decode instance {instance_id} takes only jobs the conductor planned inside "
            "its batch (this decision is not piggybacked)",
            False,
        )
    if decision.prefill_instance != instance_id or decision.decode_instance != instance_id:
        return (
            f"job is planned for {decision.prefill_instance} and {decision.decode_instance}",
            False,
        )
    if decision.prefill_stages:
        return "a prefill group's stages cannot run inside a decode batch", False
    if job.sampling.prompt_logprobs is not None:
        # A prompt's chunks in the batch keep the logits after its last token only.
        return (
            "a decode batch does not compute a prompt's logprobs (echo with logprobs): "
            "only a prefill instance does",
            False,
        )
    if job.deadline and job.deadline < now:
        return "deadline passed before the job arrived", False
    total = len(job.token_ids) - job.generated_tokens + job.sampling.max_tokens
    if total > max_model_len:
        return f"prompt plus max_tokens ({total}) exceeds {max_model_len}", False
    return None


@dataclass
class LoadedPrefix:
    """Pages holding the prompt's first `reused_blocks` blocks, loaded from the pool,
    and what the fetches did (`fetched`: failures included)."""

    pages: list[int]
    reused_blocks: int
    fetched: Fetched = field(default_factory=Fetched)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


def planned_blocks(job: pr.PrefillJob, instance_id: str, block_size: int, reuse: bool) -> int:
    """How many leading blocks the plan fetches from kvstores (the prompt's last token
    always computed). A decode instance has no page cache, so a plan that starts with
    engine blocks is not followed (0)."""
    plans = job.decision.reuse if reuse else []
    limit = reusable_blocks(len(job.token_ids), len(job.block_hashes), block_size)
    engine, runs = plan_runs(plans, instance_id, limit)
    return 0 if engine else sum(run.count for run in runs)


class PromptLoader:
    """Loads a piggybacked job's planned prefix into pages it allocated."""

    def __init__(self, instance_id: str, fetcher: BlockFetcher, block_size: int) -> None:
        self.instance_id = instance_id
        self.fetcher = fetcher
        self.block_size = block_size

    async def load(
        self, job: pr.PrefillJob, pages: Sequence[int], reuse: bool, deadline_s: float
    ) -> LoadedPrefix:
        """Fetch the plan's blocks into `pages` (one per planned block, in order). The
        prefix reaches up to the first block not loaded; the pages past it are the
        caller's to free (their receives are cancelled)."""
        limit = reusable_blocks(len(job.token_ids), len(job.block_hashes), self.block_size)
        plans = job.decision.reuse if reuse else []
        engine, runs = plan_runs(plans, self.instance_id, limit)
        if engine or not runs:
            return LoadedPrefix([], 0)
        fetched = await self.fetcher.fetch(
            job.request_id, runs, job.block_hashes, list(pages), deadline_s
        )
        reused = fetched.reaches(0)
        return LoadedPrefix(
            list(pages[:reused]),
            reused,
            fetched,
            self.fetcher.tokens_by_tier(runs, reused),
        )


@dataclass
class Piggybacked:
    """A piggybacked prompt in the batch, until its first token: what its progress
    events say, and the kvstore its full blocks go into once computed (empty:
    none)."""

    job: pr.PrefillJob
    cached_tokens: int
    store: str = ""
    started: bool = False


@dataclass
class KeptBlocks:
    """A computed prompt's pages the batcher keeps for their upload, by block key
    (the uploader's `HeldBlocks`). The batcher gets them back together once the
    upload has ended (`PiggybackJobs._store`), so a put's own release has nothing
    to do."""

    pages: dict[int, int]

    def page_of(self, key: int) -> int:
        return self.pages[key]

    def release(self, keys: Sequence[int]) -> None:
        pass


@dataclass
class Loading:
    """A piggybacked job whose prefix is being loaded, and why it is being given up
    (None: it is not; `silent`: replaced by a newer attempt, nobody is told)."""

    job: pr.PrefillJob
    task: asyncio.Task[None]
    why: pr.JobFailed | None = None
    silent: bool = False


@dataclass
class _Held:
    """What a piggybacked job holds while it loads: its pages, until the batcher owns
    them with the prompt (`in_batch`). Changed only on the engine thread."""

    pages: list[int] = field(default_factory=list)
    in_batch: bool = False


class PiggybackJobs:
    """The piggybacked jobs of one decode instance (see the module docstring): those
    loading their prefix (`loading`) and the prompts in the batch until their first
    token (`prompts`); the uploads of computed prompts' blocks are tasks of the
    worker's (`store`). Their streams are the worker's, as any other."""

    def __init__(self, host: DecodeWorker, fetcher: BlockFetcher, uploader: BlockUploader) -> None:
        self.host = host
        self.loader = PromptLoader(host.instance_id, fetcher, host.engine.cache.block_size)
        self.uploader = uploader
        self.loading: dict[str, Loading] = {}
        self.prompts: dict[str, Piggybacked] = {}
        # The uploads of computed prompts' blocks under way (a drain waits for them:
        # the pool gets the blocks).
        self.uploads: set[asyncio.Task[None]] = set()

    def cancel(self, request_id: str, reason: str) -> bool:
        """Give up a job whose prefix is loading (False: none is); its task frees the
        pages and tells the gateway."""
        loading = self.loading.get(request_id)
        if loading is None:
            return False
        if loading.why is None:
            loading.why = pr.JobFailed(f"cancelled: {reason or 'cancelled'}", status=499)
            loading.task.cancel()
        return True

    async def on_job(self, msg: Msg) -> None:
        """Take a job the conductor planned inside this batch, or refuse it (see
        `yb_decode.piggyback`); once accepted, its prefix loads in a task of its own."""
        try:
            job = pr.job_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("malformed_job", error=str(exc))
            malformed = pr.JobRefused(
                request_id="",
                instance_id=self.host.instance_id,
                reason=f"malformed job: {exc}",
                retryable=False,
            )
            await self._reply(msg, malformed)
            return
        rid = job.request_id
        refused = refusal(
            job,
            self.host.instance_id,
            enabled=self.host.piggyback,
            draining=self.host.refuses_job(job),
            max_model_len=self.host.cfg.model.max_model_len,
            now=time.time(),
        )
        if refused is None and (older := await self.host.replace_older_attempt(rid, job.attempt)):
            refused = older, False
        if refused is not None:
            reason, retryable = refused
            log.info("job_refused", request_id=rid, reason=reason)
            self.host.metrics.prompts.labels("refused").inc()
            await self._reply(
                msg,
                pr.JobRefused(
                    request_id=rid,
                    instance_id=self.host.instance_id,
                    reason=reason,
                    retryable=retryable,
                ),
            )
            return
        headers = trace_carrier(msg.headers) or dict(job.trace_headers)
        task = self.host.tasks.spawn(f"prompt:{rid}", self._take_prompt(job, headers))
        self.loading[rid] = Loading(job, task)
        self.host.metrics.prompts.labels("accepted").inc()
        await self._reply(msg, pr.JobAccepted(request_id=rid, instance_id=self.host.instance_id))

    async def _reply(self, msg: Msg, reply: pr.JobReply) -> None:
        with contextlib.suppress(Exception):
            await msg.respond(pr.encode(reply))

    async def _take_prompt(self, job: pr.PrefillJob, trace_headers: dict[str, str]) -> None:
        """Load the planned prefix, then hand the prompt to the batcher. A cancel, the
        deadline, a full engine or the instance's shutdown fails the job with its
        error chunk (a cancel from a newer attempt silently); its pages are freed on
        every way out, wherever it was."""
        rid = job.request_id
        started_ns = time.time_ns()
        dcfg = self.host.cfg.decode
        block_size = self.host.engine.cache.block_size
        held = _Held()
        try:
            with bind_request(rid):
                planned = planned_blocks(job, self.host.instance_id, block_size, dcfg.reuse)
                await self._settled(self._allocate, held, planned)
                left = job.deadline - time.time() if job.deadline else dcfg.fetch_timeout_s
                deadline_s = max(0.0, min(left, dcfg.fetch_timeout_s))
                prefix = await self.loader.load(job, held.pages, dcfg.reuse, deadline_s)
                # Blocks past the first one not loaded are computed in fresh pages.
                await self._settled(self._keep, held, prefix.reused_blocks)
                self._account_prefix(job, prefix)
                if job.deadline and job.deadline < time.time():
                    raise pr.JobFailed(
                        "request deadline passed while its prefix loaded", status=504
                    )
                cached = prefix.reused_blocks * block_size
                limit = job.decision.explain.tbt_limit_s if job.decision.explain else 0.0
                armed = self.host.failpoints.count("decode.prompt") is not None
                store, keep = self._blocks_to_store(job, prefix)
                await self._settled(self._add_prompt, job, held, cached, limit, armed, keep)
                del self.loading[rid]
                self.host.open_prompt_stream(job, trace_headers, cached, started_ns)
                self.prompts[rid] = Piggybacked(job, cached, store)
                if armed:
                    self.host.tasks.spawn(
                        f"hold:{rid}", self.host.hold(self.host.batcher, rid, "decode.prompt")
                    )
                self.host.wake()
        except asyncio.CancelledError:
            loading = self.loading.pop(rid, None)
            await self._give_back(rid, held)
            if loading is not None and loading.silent:
                return  # a newer attempt replaced it: nobody is told
            why = loading.why if loading is not None else None
            await self.fail_job(job, why or pr.JobFailed("decode instance shutting down"))
            if why is None:
                raise  # the shutdown's cancel, not one of this request
        except (pr.JobFailed, OutOfPages, ValueError) as exc:
            self.loading.pop(rid, None)
            await self._give_back(rid, held)
            if isinstance(exc, OutOfPages):
                exc = pr.JobFailed(f"decode instance out of KV pages: {exc}")
            elif isinstance(exc, ValueError):
                exc = pr.JobFailed(f"decode instance cannot run the prompt: {exc}", status=500)
            await self.fail_job(job, exc)
        except Exception as exc:  # one job's bug must not take the instance down
            log.exception("piggyback_crashed", request_id=rid, error=repr(exc))
            self.loading.pop(rid, None)
            await self._give_back(rid, held)
            await self.fail_job(job, pr.JobFailed(f"decode instance failed the prompt: {exc}", 500))

    async def _settled(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` on the engine thread, run to its end even when the caller is
        cancelled meanwhile (then the cancel is raised after it): what it did to the
        pages is always known."""
        done = self.host.engine.submit(fn, *args)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            await asyncio.wait({done})
            raise

    def _allocate(self, held: _Held, count: int) -> None:
        """Engine thread: pages for the blocks a job fetches (OutOfPages: none)."""
        held.pages = self.host.engine.allocator.allocate(count) if count else []

    def _keep(self, held: _Held, count: int) -> None:
        """Engine thread: keep the first `count` pages (the loaded prefix), free the rest."""
        self.host.engine.allocator.free(held.pages[count:])
        held.pages = held.pages[:count]

    def _blocks_to_store(self, job: pr.PrefillJob, prefix: LoadedPrefix) -> tuple[str, list[int]]:
        """The kvstore of this host and the prompt's full blocks that go there once
        computed, as a prefill instance's go (`yb_dataplane.block_upload`): all but
        those loaded from that kvstore. None (an empty id) with `store_blocks` off or
        no kvstore on this host."""
        store = self.host.peers.kvstore_on(self.host.cfg.host)
        if not self.host.cfg.decode.store_blocks or store is None:
            return "", []
        bs = self.host.engine.cache.block_size
        full = full_blocks(len(job.token_ids), len(job.block_hashes), bs)
        return store.instance_id, blocks_to_store(
            0, full, prefix.fetched.loaded_from, store.instance_id
        )

    def _add_prompt(
        self,
        job: pr.PrefillJob,
        held: _Held,
        cached: int,
        tbt_limit_s: float,
        park: bool,
        keep: list[int],
    ) -> None:
        """Engine thread: the prompt into the batch with its loaded pages, its steps
        within the TBT limit its decision was planned with, the pages of blocks `keep`
        kept for their upload once computed; held out of the steps when a test armed
        `decode.prompt` (in this same call, so no step takes a chunk first)."""
        batcher = self.host.batcher
        if tbt_limit_s > 0:
            batcher.tbt_slo_s = tbt_limit_s
        batcher.add_prompt(
            job.request_id,
            job.token_ids,
            job.sampling,
            cached_pages=held.pages,
            num_cached_tokens=cached,
            generated_tokens=job.generated_tokens,
            priority=job.priority,
            keep_blocks=keep,
        )
        held.pages, held.in_batch = [], True
        if park:
            batcher.park(job.request_id)

    async def _give_back(self, request_id: str, held: _Held) -> None:
        """Free what a job that cannot go on holds: its pages, or its place in the
        batch (reporting nothing there: the job's own error chunk says why)."""
        with contextlib.suppress(RuntimeError):  # the engine is shut down: so is all
            if held.in_batch:
                await self.host.engine.call(self.host.batcher.discard, request_id)
            elif held.pages:
                await self.host.engine.call(self.host.free, held.pages)
        held.pages, held.in_batch = [], False

    def _account_prefix(self, job: pr.PrefillJob, prefix: LoadedPrefix) -> None:
        """Metrics and `TransferFailed` events for a loaded prefix."""
        for tier, tokens in prefix.tokens_by_tier.items():
            self.host.metrics.reused.labels(tier).inc(tokens)
        for failure in prefix.fetched.failures:
            self.host.log_event(
                ev.TransferFailed(
                    request_id=job.request_id,
                    source_instance=failure.source,
                    target_instance=self.host.instance_id,
                    reason=f"prefix blocks {failure.first}..{failure.first + failure.count - 1}: "
                    f"{failure.reason}",
                )
            )

    def store(self, kept: dict[str, dict[int, int]]) -> None:
        """Upload the blocks of the prompts a step computed (their pages kept by the
        batcher by block index, `DecodeBatcher.take_kept`), each in an owned task of
        its own, off the first token's path. Called before `progress` forgets the
        prompts. Each block is named by the hash at its index in the request's
        prompt (an attempt that replaced this one meanwhile has the same prompt,
        extended: the same hashes there)."""
        for rid, blocks in kept.items():
            prompt = self.prompts.get(rid)
            hashes = prompt.job.block_hashes if prompt is not None else []
            store = (
                prompt.store if prompt is not None and all(i < len(hashes) for i in blocks) else ""
            )
            keys = [hashes[i] for i in blocks] if store else []
            pages = list(blocks.values())
            task = self.host.tasks.spawn(f"store:{rid}", self._store(store, keys, pages))
            self.uploads.add(task)
            task.add_done_callback(self.uploads.discard)

    async def _store(self, store: str, keys: list[int], pages: list[int]) -> None:
        """Owned task: put blocks `keys` (in `pages`) into kvstore `store` (empty:
        none), each put within `decode.transfer_timeout_s`, then give the pages back
        to the batcher (also when cancelled: the instance's shutdown). Never raises: a
        failed put only means the pool does not get that block."""
        try:
            if store:
                address = self.host.peers.address(store)
                result = await self.uploader.upload(
                    address, keys, KeptBlocks(dict(zip(keys, pages, strict=True)))
                )
                for outcome, count in result.counts().items():
                    self.host.metrics.puts.labels(outcome).inc(count)
        except Exception as exc:  # one upload's bug must not take the instance down
            log.exception("block_upload_crashed", error=repr(exc))
        finally:
            with contextlib.suppress(RuntimeError):  # the engine is shut down: so is all
                await self._settled(self.host.batcher.release_kept, pages)

    def progress(self, outputs: list[TokenOutput]) -> None:
        """Log the piggybacked prompts' progress as a prefill's: `prefill_started` at
        their first chunk, `prefill_done` and `kv_committed` at their first token."""
        firsts = {o.request_id for o in outputs if o.token_id is not None}
        ended = {o.request_id for o in outputs if o.finished}
        for rid, prompt in list(self.prompts.items()):
            if rid in firsts:
                del self.prompts[rid]
                self._prompt_started(prompt)
                self._prompt_done(prompt)
            elif rid in ended:
                del self.prompts[rid]  # aborted before its first token
            elif not prompt.started:
                with contextlib.suppress(KeyError):  # aborted meanwhile
                    if self.host.batcher.prompt_chunks(rid):
                        self._prompt_started(prompt)

    def _prompt_started(self, prompt: Piggybacked) -> None:
        if prompt.started:
            return
        prompt.started = True
        job = prompt.job
        log.info("prefill_started", request_id=job.request_id, piggyback=True)
        self.host.log_event(
            ev.RequestProgress(
                request_id=job.request_id,
                instance_id=self.host.instance_id,
                stage="prefill_started",
            )
        )

    def _prompt_done(self, prompt: Piggybacked) -> None:
        job, cached = prompt.job, prompt.cached_tokens
        rid = job.request_id
        n = len(job.token_ids)
        log.info(
            "prefill_done", request_id=rid, piggyback=True, prompt_tokens=n, reused_tokens=cached
        )
        self.host.log_event(
            ev.RequestProgress(
                request_id=rid,
                instance_id=self.host.instance_id,
                stage="prefill_done",
                computed_tokens=n - cached,
                reused_tokens=cached,
            )
        )
        self.host.log_event(
            ev.RequestProgress(
                request_id=rid,
                instance_id=self.host.instance_id,
                stage="kv_committed",
                computed_tokens=n - job.generated_tokens,
                reused_tokens=cached,
            )
        )

    async def fail_job(self, job: pr.PrefillJob, exc: pr.JobFailed) -> None:
        """End a piggybacked job that never reached the batch: an error chunk (a 503
        the gateway may re-plan) and an event."""
        rid = job.request_id
        log.warning("piggyback_failed", request_id=rid, reason=exc.reason)
        self.host.metrics.prompts.labels("failed").inc()
        chunk, finished = pr.failed_job(job, exc, self.host.instance_id)
        await self.host.emit(rid, job.token_subject, chunk)
        self.host.history.finish(rid)
        self.host.log_event(finished)
