"""Prompts prefilled inside this instance's decode batch (piggybacking).

With `decode.piggyback` on, the instance announces `piggyback` in its `InstanceUp`,
and the conductor may plan a short prompt here (`RequestScheduled.piggyback`, with
this instance as both `prefill_instance` and `decode_instance`). The gateway then
hands the job to this instance exactly as to a prefill instance: a `PrefillJob` on
`yb.job.prefill.<its id>` (NATS request/reply). The instance:

1. validates it (`refusal`): a job of a decision that is not piggybacked, or planned
   for other instances, or with an option a decode batch cannot run (a prefill
   group's stages) is refused with a `JobRefused` that says why, never run another
   way;
2. loads the plan's reused blocks from the kvstores into its own pages over UCX
   (`PromptLoader`, the prefill's fetch code, `yb_dataplane.prefix_fetch`), within
   `decode.fetch_timeout_s` and the request's deadline; a fetch that fails is logged
   (`TransferFailed`) and its blocks are computed instead;
3. gives the prompt to the batcher (`DecodeBatcher.add_prompt`) with those pages:
   each decode step computes a chunk of it beside the running streams, each step
   within the TBT limit the decision was planned with, and the step that computes
   the last chunk yields the first token.

Its progress is logged as a prefill's (`prefill_started` at its first chunk,
`prefill_done` with computed and reused tokens and `kv_committed` at its first token)
and every token, the first included, streams to the gateway as any decode stream
does. A cancel frees its pages wherever it is (loading or in the batch); the
instance's shutdown ends it with a 503, which the gateway may re-plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from yb_core import protocol as pr
from yb_dataplane.prefix_fetch import BlockFetcher, Fetched, plan_runs, reusable_blocks


class JobFailed(Exception):
    """A piggybacked job that cannot finish; `status` is what its client is told."""

    def __init__(self, reason: str, status: int = 503) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


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
    events say."""

    job: pr.PrefillJob
    cached_tokens: int
    started: bool = False
