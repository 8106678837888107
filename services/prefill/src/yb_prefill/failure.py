"""How a prefill instance ends a request that never reached decode."""

from __future__ import annotations

import contextlib

from yb_core import protocol as pr
from yb_core.bus import Bus, BusError
from yb_core.outbox import Outbox
from yb_core.telemetry import get_logger

log = get_logger(__name__)


async def fail_job(
    bus: Bus, outbox: Outbox, instance_id: str, job: pr.PrefillJob, exc: pr.JobFailed
) -> None:
    """The error chunk on the request's token stream and `RequestFinished` on the log
    (`protocol.failed_job`)."""
    log.warning("prefill_failed", request_id=job.request_id, reason=exc.reason)
    chunk, finished = pr.failed_job(job, exc, instance_id)
    with contextlib.suppress(BusError):
        await bus.publish_core(job.token_subject, pr.encode(chunk))
    outbox.put(finished)
