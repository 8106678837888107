"""What a simulation is run with: the cluster, the engines' limits, the SLOs."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from yb_conductor.cost_model import CostModel
from yb_core.config import EvictionPolicyName

DecodeAdmission = Literal["engine", "reject", "queue"]
EvictionName = EvictionPolicyName
EVICTIONS: tuple[EvictionName, ...] = get_args(EvictionPolicyName)


class SimParams(msgspec.Struct, kw_only=True, frozen=True):
    """One simulated cluster and workload.

    Host `i` runs prefill instance `prefill-i` and kvstore `kvstore-i` (a DRAM pool
    of `pool_tokens`, evicting by `eviction`); decode instances run on hosts of their
    own. `block_size` 0 takes the cost model's (or the trace's 512). `bandwidth_gbps`
    0 keeps the cost model's host-to-host bandwidth; otherwise it replaces it for the
    conductor's estimates and the simulated transfers alike. `decode_kv_tokens` 0 takes
    the cost model's `decode.kv_capacity_tokens` (or 1M tokens).

    `decode_admission` is what a decode instance does without room. `"engine"` (the
    default) does what Yuebing's decode service does: the request's KV is reserved
    when its prefill starts (`ReserveKV`) and refused there when it does not fit;
    a request whose KV arrives at a full batch is parked, its KV in its pages, until
    a slot frees (priority, then arrival), as the engine's batcher parks it; the TBT
    is never a reason to refuse. `"reject"` is the paper's baseline: the KV is
    reserved at the prefill's start as well, but a full batch or a step time beyond
    the TBT SLO with the request rejects it when its KV arrives, after its prefill
    was paid for. `"queue"` judges the KV room on arrival too and waits for any room.
    A parked request's wait counts in its TBT (its first token was reported when its
    KV arrived). A request whose prefill has not started `request_timeout_s` after
    arrival is cancelled.

    `max_tokens` is what each request asks for (the client's cap, all the gateway and
    conductor know); the trace's `output_length` is when the engine actually stops.
    0 passes the trace's output length itself, which tells the conductor more than
    production ever does.

    `prefill_groups` forms prefill groups (chunked pipeline parallelism) out of the
    first prefill instances, in order: `[2, 2]` makes prefill-0 and -1 one group of two
    pipeline stages, prefill-2 and -3 another; the rest stay whole-model instances.
    Each group splits `model_layers` as evenly as it can (earlier stages take the
    extra layers) and cuts prompts into chunks of `chunk_tokens`. A group's stages
    keep their hosts; what the group computes goes into its first stage's host pool.
    A whole-model instance pauses a batch line's prefill for work of a higher
    priority (with the conductor's `batch_preemption`, the default) once the layer it
    is computing ends, as the engines hold a call between two layers: one
    `model_layers`-th of a chunk of `preempt_tokens` (512, the engines'
    `prefill.chunk_size`) later at most. A group never pauses one.

    `piggyback`: the decode instances take prompts into their batch (the conductor
    sends one there when its TTFT is lower than through the prefill pool); each then
    shares a host with a kvstore (decode j with kvstore j mod `prefill`), whose pool
    gets the full blocks of the prompts it prefills.

    `priority_mix` maps a priority to its share of the requests (shares are
    normalized; empty: every request at priority 0). Each request's priority is
    drawn from it with a generator of its own seeded by `seed`, so a mix changes
    nothing else a run draws. Larger runs earlier: prefill queues and decode
    admission order by priority, then arrival, and the results break down by it.

    `prefill_tp` and `decode_tp`: the tensor-parallel degree (devices) of each
    prefill and each decode instance (0: the profile's own, `tensor_parallel.degree`
    of the cost model). Each is timed by the cost model at its degree
    (`CostModel.at_degree`), announces it (`InstanceUp.tensor_parallel`), and moves
    KV over as many lanes per device as the profile's instance (`lanes_at`); a decode
    instance's KV room is the profile's at its degree unless `decode_kv_tokens` sets
    it. `pool_tokens` is the pool of a host of one profile instance's devices: a
    prefill instance of another degree gets its share of it (`pool_tokens_at`), so
    that clusters of equal device counts have equal pools.

    `hosts`: hosts with a kvstore (0: one per prefill instance). Host `i` is where
    prefill instance `prefill-i` runs when it is up; the pools stay up whatever runs.

    Elastic pools: with the conductor's `planner` on (a setting), `prefill` and
    `decode` are the instances up at the start, and the planner's actions are
    carried out: an added instance comes up `start_s` after the decision (what
    loading a model takes), a drained one stops once it holds nothing, and a moved
    one is drained and then started in the other role. `max_instances` (0: `prefill`
    plus `decode`) bounds the instances the planner may hold and is its budget.
    Instance-hours count every instance from its start to its stop (starting and
    draining included: it holds its devices).

    `batch_lines`: a backlog of that many Batch API lines queued at t = 0, each due
    `batch_window_s` later (`yb_tools.sim.batch`), at most `batch_concurrency` of
    them tried or run at once (the gateways' `batch_concurrency` together; 0: all);
    the run's figures stay those of the interactive requests, the backlog's are
    `Simulation.batch_result`.
    """

    prefill: int = 8
    decode: int = 8
    profile: str = "llama2-70b-a800"
    block_size: int = 0
    pool_tokens: int = 3_000_000
    eviction: EvictionName = "lru"
    bandwidth_gbps: float = 0.0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    speedup: float = 1.0
    decode_kv_tokens: int = 0
    decode_max_batch: int = 256
    max_tokens: int = 1024
    decode_admission: DecodeAdmission = "engine"
    request_timeout_s: float = 600.0
    report_interval_s: float = 1.0
    sample_interval_s: float = 5.0
    jitter: float = 0.0
    seed: int = 0
    limit: int = 0
    priority_mix: dict[int, float] = msgspec.field(default_factory=dict)
    prefill_groups: list[int] = msgspec.field(default_factory=list)
    piggyback: bool = False
    chunk_tokens: int = 2048
    preempt_tokens: int = 512
    model_layers: int = 80
    prefill_tp: int = 0
    decode_tp: int = 0
    hosts: int = 0
    max_instances: int = 0
    start_s: float = 60.0
    batch_lines: int = 0
    batch_window_s: float = 3600.0
    batch_concurrency: int = 0

    def degrees(self, cost: CostModel) -> tuple[int, int]:
        """The prefill and decode instances' tensor-parallel degrees under `cost`."""
        own = cost.tensor_parallel.degree
        return self.prefill_tp or own, self.decode_tp or own

    def devices(self, cost: CostModel) -> int:
        """Devices the cluster's engines span (kvstores hold none)."""
        prefill_tp, decode_tp = self.degrees(cost)
        return self.prefill * prefill_tp + self.decode * decode_tp

    def pool_tokens_at(self, cost: CostModel) -> int:
        """The pool of each prefill instance's host: `pool_tokens` in proportion to its
        devices against the profile's instance."""
        prefill_tp, _ = self.degrees(cost)
        return self.pool_tokens * prefill_tp // cost.tensor_parallel.degree

    def check_degrees(self) -> None:
        """ValueError for a degree below 0."""
        if self.prefill_tp < 0 or self.decode_tp < 0:
            raise ValueError("a tensor-parallel degree is a count of devices, 1 or more")

    def check_groups(self) -> None:
        """ValueError when `prefill_groups` does not fit the cluster (or chunks of
        less than a token pause batch lines)."""
        if self.preempt_tokens < 1:
            raise ValueError("preempt_tokens must be at least 1")
        if not self.prefill_groups:
            return
        if any(size < 2 for size in self.prefill_groups):
            raise ValueError("a prefill group needs at least 2 stages")
        if sum(self.prefill_groups) > self.prefill:
            raise ValueError(
                f"prefill groups of {'+'.join(map(str, self.prefill_groups))} stages need "
                f"more than the {self.prefill} prefill instances"
            )
        if max(self.prefill_groups) > self.model_layers:
            raise ValueError(f"more stages than the model's {self.model_layers} layers")
        if self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")


def lanes_at(cost: CostModel, degree: int) -> int:
    """Transfer lanes of a simulated instance of `degree` devices: the profile's lanes
    per device (its ranks move their own pages, as a GPU instance's do), at least 1."""
    tp = cost.tensor_parallel
    return max(1, tp.transfer_lanes * degree // tp.degree)


def stage_layers(stages: int, layers: int) -> list[tuple[int, int]]:
    """`[start, end)` of each of `stages` stages over `layers` layers, as even as they
    can be (the first ones take the extra layers)."""
    base, extra = divmod(layers, stages)
    spans = []
    start = 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def parse_groups(text: str) -> list[int]:
    """`"2,2"` -> `[2, 2]` ("" -> []); ValueError names the part that does not parse."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"prefill groups are stage counts, comma-separated, not {part!r}")
        sizes.append(int(part))
    return sizes


def parse_priority_mix(text: str) -> dict[int, float]:
    """`"1:0.2,0:0.8"` -> `{1: 0.2, 0: 0.8}` (priority:share, comma-separated; "" ->
    {}). ValueError names the part that does not parse."""
    mix: dict[int, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        priority, sep, share = part.partition(":")
        try:
            if not sep:
                raise ValueError
            mix[int(priority)] = float(share)
        except ValueError:
            raise ValueError(f"priority mix wants priority:share, got {part!r}") from None
    return mix
