"""How a prefill instance ends a request that never reached decode, and what its two
workers (whole model, `worker.py`; a group's lead, `stage.py`) do alike with the jobs
they own (`JobOwner`)."""

from __future__ import annotations

import contextlib

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus, BusError
from yb_core.config import YbConfig
from yb_core.failpoints import Failpoints
from yb_core.outbox import Outbox
from yb_core.telemetry import get_logger
from yb_prefill.job_queue import JobQueue, Liveness

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


class JobOwner:
    """A prefill worker's handling of the jobs it took, the same for the whole-model
    worker and a group's lead: their events logged in order off the job's path, a
    job ended with an error chunk and `RequestFinished`, a job held where a test armed
    a failpoint, and at shutdown the outcomes flushed and the jobs still queued
    failed. The worker sets the attributes below."""

    instance_id: str
    cfg: YbConfig
    bus: Bus
    outbox: Outbox
    liveness: Liveness
    failpoints: Failpoints
    _queue: JobQueue

    async def settle(self) -> None:
        """Log the progress and outcomes of the jobs done so far."""
        await self.outbox.flush(self.cfg.nats.request_timeout_s)

    async def release(self) -> None:
        """Fail the jobs still queued (the running ones failed when their tasks were
        cancelled), and log what they left to say."""
        while not self._queue.empty():
            queued = self._queue.get_nowait()
            await self._fail(queued.job, pr.JobFailed("prefill instance shutting down"))
        await self.outbox.flush(self.cfg.nats.request_timeout_s)

    async def failpoint(self, job: pr.PrefillJob, point: str) -> None:
        """Hold the job at `point` if a test armed it; a cancel or the request's
        deadline ends the hold (the caller's `liveness.check` then fails the job)."""
        if self.failpoints.count(point) is None:
            return
        rid = job.request_id
        await self.failpoints.hold(point, rid, cancelled=lambda: self.liveness.over(job))

    async def _fail(self, job: pr.PrefillJob, exc: pr.JobFailed) -> None:
        """End a request that never reached decode: an error chunk and an event."""
        await fail_job(self.bus, self.outbox, self.instance_id, job, exc)

    def _log_event(self, event: ev.AnyEvent) -> None:
        self.outbox.put(event)
