"""Crafted cluster states for the conductor's unit tests.

`Crafted` feeds a conductor the events a cluster would log — instances, block
stores, admissions, progress — and, like the live service, appends each decision to
the log right after its admission, so every test is also a small recorded log
(`records`) that must replay to the same decisions.

The cost model is chosen for round numbers: with 16-token blocks, prefilling a
block costs 16 ms, loading one from local DRAM 0.5 ms, from a remote host 1 ms,
and a decode step 10 ms + 1 ms per sequence.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# The test modules import `generated_logs` (the replay property tests' log generator)
# from beside this file.
sys.path.insert(0, str(Path(__file__).parent))

from yb_conductor.conductor import Conductor, Output
from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost, TransferCost
from yb_conductor.replay import LogRecord
from yb_conductor.settings import configured_event
from yb_core import events as ev
from yb_core.config import ConductorConfig

BS = 16
MB_PER_BLOCK = BS * 65536  # kv_bytes_per_token * block_size = 1 MiB

ROUND = CostModel(
    name="round",
    kv_bytes_per_token=65536,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.001, per_context_token_s=0.0),
    transfer=TransferCost(
        setup_s=0.0,
        dram_local_gbps=MB_PER_BLOCK / 0.0005 / 1e9,
        dram_remote_gbps=MB_PER_BLOCK / 0.001 / 1e9,
        ssd_local_gbps=MB_PER_BLOCK / 0.004 / 1e9,
        ssd_remote_gbps=MB_PER_BLOCK / 0.005 / 1e9,
    ),
)


class Crafted:
    """A conductor and the log that built its state."""

    ROUND = ROUND

    def __init__(self, cost: CostModel = ROUND, **settings: Any) -> None:
        settings.setdefault("admission", "predicted")
        self.cfg = ConductorConfig(**settings)
        self.cost = cost
        self.c = Conductor(cfg=self.cfg, cost=cost)
        self.records: list[LogRecord] = []
        self.t = 1.0
        self._event_ids: dict[str, int] = {}
        # As the live service does: the settings go into the log first, so a replay
        # of `records` decides with the same cost model.
        self.feed(configured_event(self.cfg, cost, "conductor-test"))

    def feed(self, event: ev.AnyEvent) -> list[Output]:
        """Log an event (at the current time unless it has one) and its outputs."""
        if not event.time:
            event.time = self.t
        outputs = self._log(event)
        for out in outputs:
            self._log(out)
        return outputs

    def _log(self, event: ev.AnyEvent) -> list[Output]:
        seq = len(self.records) + 1
        self.records.append(LogRecord(seq=seq, event=event))
        return self.c.apply(seq, event)

    def at(self, t: float) -> Crafted:
        """Move the clock (the next events carry this time)."""
        self.t = t
        return self

    # --- instances ---------------------------------------------------------------------

    def prefill(self, name: str, host: str) -> None:
        self.feed(ev.InstanceUp(instance_id=name, role="prefill", host=host, max_batch_size=1))

    def decode(self, name: str, host: str = "h-d", kv_blocks: int = 0) -> None:
        self.feed(
            ev.InstanceUp(
                instance_id=name,
                role="decode",
                host=host,
                max_batch_size=64,
                kv_capacity_blocks=kv_blocks,
            )
        )

    def kvstore(self, name: str, host: str) -> None:
        self.feed(ev.InstanceUp(instance_id=name, role="kvstore", host=host, epoch=1))
        self.feed(ev.BlocksCleared(instance_id=name, epoch=1, event_id=self._next(name)))

    def hosts(self, n: int, decodes: int = 1) -> None:
        """n hosts with prefill-i and kv-i each, and `decodes` decode instances."""
        for i in range(n):
            self.kvstore(f"kv-{i}", f"h{i}")
            self.prefill(f"p-{i}", f"h{i}")
        for j in range(decodes):
            self.decode(f"d-{j}")

    def _next(self, name: str) -> int:
        self._event_ids[name] = self._event_ids.get(name, 0) + 1
        return self._event_ids[name]

    def store(self, instance: str, chain: list[int], tier: ev.Tier = "dram") -> None:
        self.feed(
            ev.BlockStored(
                instance_id=instance,
                epoch=1,
                event_id=self._next(instance),
                block_hashes=chain,
                tier=tier,
            )
        )

    # --- requests ----------------------------------------------------------------------

    def admit(
        self,
        rid: str,
        chain: list[int] | None = None,
        *,
        prompt: int | None = None,
        max_tokens: int = 10,
        priority: int = 0,
        ttft_slo: float = 10.0,
        tbt_slo: float = 1.0,
        prompt_logprobs: bool = False,
    ) -> ev.Decision:
        chain = chain or []
        outputs = self.feed(
            ev.RequestAdmitted(
                request_id=rid,
                gateway_id="g",
                model="",
                block_size=BS,
                block_hashes=chain,
                prompt_tokens=prompt if prompt is not None else len(chain) * BS + 1,
                max_tokens=max_tokens,
                priority=priority,
                slo=ev.Slo(ttft_s=ttft_slo, tbt_s=tbt_slo),
                prompt_logprobs=prompt_logprobs,
            )
        )
        decisions = [o for o in outputs if isinstance(o, ev.Decision)]
        assert len(decisions) == 1, outputs
        return decisions[0]

    def progress(self, rid: str, instance: str, stage: ev.ProgressStage) -> None:
        self.feed(ev.RequestProgress(request_id=rid, instance_id=instance, stage=stage))

    def finish(
        self,
        rid: str,
        instance: str,
        output_tokens: int = 10,
        tbt: float = 0.01,
        reason: str = "",
    ) -> None:
        self.feed(
            ev.RequestFinished(
                request_id=rid,
                instance_id=instance,
                outcome="completed",
                reason=reason,
                output_tokens=output_tokens,
                tbt_mean_s=tbt,
                ttft_s=0.1,
            )
        )


@pytest.fixture
def crafted() -> type[Crafted]:
    """The `Crafted` class (tests build one per scenario, with their settings)."""
    return Crafted
