"""How a prefill instance ends a request that never reached decode."""

from __future__ import annotations

import contextlib

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus, BusError
from yb_core.outbox import Outbox
from yb_core.telemetry import get_logger

log = get_logger(__name__)


async def fail_job(
    bus: Bus, outbox: Outbox, instance_id: str, job: pr.PrefillJob, exc: pr.JobFailed
) -> None:
    """An error chunk on the request's token stream (its status tells the gateway
    whether to re-plan), and `RequestFinished` on the log."""
    log.warning("prefill_failed", request_id=job.request_id, reason=exc.reason)
    prompt_tokens = len(job.token_ids) - job.generated_tokens
    chunk = pr.TokenChunk(
        request_id=job.request_id,
        seq=0,
        finished=True,
        finish_reason="error",
        error=exc.reason,
        error_status=exc.status,
        prompt_tokens=prompt_tokens,
        attempt=job.attempt,
    )
    with contextlib.suppress(BusError):
        await bus.publish_core(job.token_subject, pr.encode(chunk))
    outcome: ev.RequestOutcome = "cancelled" if exc.status == 499 else "failed"
    outbox.put(
        ev.RequestFinished(
            request_id=job.request_id,
            instance_id=instance_id,
            outcome=outcome,
            reason=exc.reason,
            prompt_tokens=prompt_tokens,
        )
    )
