"""The prefill engine service.

It takes jobs from gateways (`yb.job.prefill.<id>`, core NATS request/reply), queues
them, and runs them one at a time on its engine: reserve pages on the decode instance
the conductor chose, load the prefix the decision says to reuse (from this engine's
own page cache, this host's kvstore or another host's, `reuse.PrefixLoader`), compute
the rest of the prompt in chunks while streaming every page (the loaded prefix
included) to that instance over UCX layer by layer, commit, and hand the request over
with its first token (`worker.PrefillWorker`). Then the prompt's full blocks stay in
the engine's page cache (announced as tier "engine" block events) and the ones
computed here are put into the host's kvstore in the background
(`yb_dataplane.block_upload`). Every step has a deadline; a failure ends the request
with an error on its token stream and a `RequestFinished(failed)` event, and frees what it
held; a failed prefix fetch only costs its recompute (and a `TransferFailed` event).

Told to stop, it drains first (`prefill.drain_timeout_s`, the shell's stop step 0):
it refuses the jobs the conductor decided after its `InstanceDraining` and runs those
it holds (queued, computing, finishing, and jobs decided before the drain that are
still on their way), and the uploads of their blocks to the kvstore; what is still
queued at the deadline fails with a 503, which the gateway re-plans elsewhere.

An instance configured as a stage of a prefill group (`prefill.group`, `stage` of
`stages`) loads only its share of the layers and runs the group's requests with the
other stages instead (`stage.StageWorker`).

The bus, presence, cancellations, peers, the UCX transport and the shutdown order are
the data-plane shell's (`yb_dataplane.worker.WorkerShell`).
"""

from __future__ import annotations

from yb_core.config import YbConfig
from yb_dataplane.worker import WorkerContext, WorkerShell
from yb_engine.host import EngineGauges, EngineHost, StageHost
from yb_prefill.stage import StageWorker
from yb_prefill.worker import PrefillMetrics, PrefillWorker


class PrefillService(WorkerShell[PrefillWorker | StageWorker]):
    """Runs prefill jobs on one engine and streams their KV to decode instances."""

    role = "prefill"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg, cfg.prefill, cfg.prefill.drain_timeout_s)
        # Registered now, so /metrics shows them while the model loads.
        self.metrics = PrefillMetrics(self.registry)
        self.gauges = EngineGauges(self.registry)

    async def build(self, context: WorkerContext) -> PrefillWorker | StageWorker:
        """Load the model (a stage: its layers); the worker runs on it."""
        section = self.cfg.prefill
        if section.group:
            host = await StageHost.load(self.cfg, section, section.stage, section.stages)
            return StageWorker(context, host, self.metrics, self.gauges)
        engine = await EngineHost.load(self.cfg, self.cfg.prefill, self.instance_id)
        return PrefillWorker(context, engine, self.metrics, self.gauges)
