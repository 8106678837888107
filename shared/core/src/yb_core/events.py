"""The scheduling log's vocabulary: every event on the `YB_EVENTS` stream.

Each event is a `msgspec.Struct` encoded as msgpack, tagged so that one decoder reads
them all (`decode_event`). Events are encoded as maps, not `array_like`: the log
outlives every process that wrote it and services are upgraded one at a time, so a
reader must accept payloads from older writers (missing fields take their defaults)
and from newer ones (unknown fields are ignored). Schemas evolve only by adding
fields with defaults, never by renaming or retyping, and `SCHEMA_VERSION` is bumped
when that happens. Token ids and text never appear here:
the log is durable and must not hold user content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

from yb_core.kv_spec import KVCacheSpec

SCHEMA_VERSION: Final = 6

Role = Literal["prefill", "decode", "kvstore", "conductor", "gateway"]
Tier = Literal["engine", "dram", "ssd"]
T = TypeVar("T")


class Event(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    kw_only=True,
    tag=True,
    tag_field="type",
):
    """Base of every logged event.

    `time` is the publisher's wall clock in seconds; the conductor uses it as its own
    clock, so replaying the log reproduces every decision. `v` is the schema version
    the publisher wrote.
    """

    v: int = SCHEMA_VERSION
    time: float = 0.0


# --- requests -----------------------------------------------------------------------


class Slo(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """Latency objectives of one request, in seconds."""

    ttft_s: float = 10.0
    tbt_s: float = 1.0


class RequestAdmitted(Event, tag="request_admitted"):
    """A gateway accepted a request and asks the conductor for a placement.

    `priority` and `slo` are those of the request's service tier, named by
    `service_tier` (the gateway's `gateway.service_tiers`; "" in a log recorded before
    tiers, when every request had the gateway's SLOs and its own priority). The
    conductor decides on the figures, never on the name: the name says, in the log,
    which tier a request was.

    `batch`: a line of a batch (the Batch API), due by `batch_deadline` (wall-clock
    seconds: the end of its batch's window, or sooner by the gateway's line timeout;
    `deadline` stays the deadline of this one attempt). It has no TTFT or TBT
    objective of its own: the conductor admits it only into capacity interactive
    traffic leaves idle (`yb_conductor.batch_admission`), and its `slo` is its tier's,
    the interactive objective it must not disturb. False in a log recorded before
    batch lines were marked (schema version 5).
    """

    request_id: str
    gateway_id: str
    model: str
    block_size: int
    block_hashes: list[int]
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    slo: Slo = msgspec.field(default_factory=Slo)
    deadline: float = 0.0
    #: It asks for its prompt's logprobs: only a whole-model prefill instance computes
    #: them (not a decode's piggybacked prefill, not a pipeline group), from the first
    #: token (a reused prefix has no logits), so it is planned and priced with no reuse.
    prompt_logprobs: bool = False
    service_tier: str = ""
    batch: bool = False
    batch_deadline: float = 0.0


class ReusePlan(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """Where a contiguous run of prefix blocks is loaded from.

    Blocks `[first_block, first_block + num_blocks)` of the prompt are read from
    `source_instance` in tier `tier`; `source_instance` may be the prefill instance
    itself (its engine cache), its host's kvstore, or a remote kvstore.
    """

    source_instance: str
    tier: Tier
    first_block: int
    num_blocks: int


class Estimates(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """The conductor's predictions behind a decision, kept so it can be explained."""

    queue_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    tbt_s: float = 0.0
    decode_batch: int = 0


class Candidate(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One prefill instance as the conductor weighed it for a request.

    `local_blocks`: the prefix it (or its host's kvstore) holds; `best_blocks`: the
    longest prefix anywhere; `option`: what the estimate assumes ("local": load the
    local prefix, "transfer": also pull the rest of the best prefix from `source`,
    "recompute": compute the whole prompt); `reuse_blocks`: the blocks that option
    reuses. `stages`: how many pipeline stages compute it when the candidate is a
    prefill group (`instance_id` is then its lead stage; 0: one instance).
    """

    instance_id: str
    option: str
    local_blocks: int = 0
    best_blocks: int = 0
    reuse_blocks: int = 0
    source: str = ""
    queue_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    stages: int = 0


class DecodeCandidate(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One decode instance as the conductor weighed it: its batch and predicted TBT."""

    instance_id: str
    batch: int = 0
    predicted_batch: int = 0
    tbt_s: float = 0.0


class Explanation(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """Why a decision came out as it did; what `yb explain` prints.

    `branch` is the path taken ("local", "transfer", "recompute", or "reject");
    `candidates` the best prefill candidates by estimated TTFT (the chosen one
    first), `decode_candidates` every decode instance considered.
    """

    branch: str = ""
    reason: str = ""
    admission: str = ""
    best_blocks: int = 0
    best_source: str = ""
    ttft_limit_s: float = 0.0
    tbt_limit_s: float = 0.0
    candidates: list[Candidate] = msgspec.field(default_factory=list)
    decode_candidates: list[DecodeCandidate] = msgspec.field(default_factory=list)


class RequestScheduled(Event, tag="request_scheduled"):
    """The conductor's placement decision for one admitted request.

    `attempt` is 0 for the decision on its admission and k for the decision on its
    k-th re-plan (`RequestReplanned`); `admitted_seq` is then the re-plan's position.
    `prefill_stages`: when the prefill runs over a prefill group, its stage
    instances in layer order (`prefill_instance` is the first); empty for one
    instance. `piggyback`: the decode instance prefills the prompt inside its batch
    (`prefill_instance` is then the decode instance), loading the `reuse` plan's
    blocks itself.
    """

    request_id: str
    gateway_id: str
    prefill_instance: str
    decode_instance: str
    reused_blocks: int = 0
    reuse: list[ReusePlan] = msgspec.field(default_factory=list)
    estimates: Estimates = msgspec.field(default_factory=Estimates)
    policy: str = ""
    admitted_seq: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    explain: Explanation | None = None
    attempt: int = 0
    prefill_stages: list[str] = msgspec.field(default_factory=list)
    piggyback: bool = False


class RequestRejected(Event, tag="request_rejected"):
    """The conductor refused a request (or one of its re-plans, `attempt` > 0), with
    the reason and the figures behind it."""

    request_id: str
    gateway_id: str
    reason: str
    retry_after_s: float = 1.0
    estimates: Estimates = msgspec.field(default_factory=Estimates)
    policy: str = ""
    admitted_seq: int = 0
    explain: Explanation | None = None
    attempt: int = 0


# The conductor's answer to one admitted request: exactly one of these per admission,
# and one per re-plan (`RequestReplanned`), told apart by `attempt`.
Decision = RequestScheduled | RequestRejected


class RequestReplanned(Event, tag="request_replanned"):
    """A gateway asks for a new plan for a request whose engine failed mid-way.

    The request continues where its client is: the new prefill's prompt is the
    original prompt plus the `generated_tokens` tokens the client already received,
    so `block_hashes` and `prompt_tokens` describe that longer prompt (the conductor
    plans reuse of its prefix from the pool as for any admission), and `max_tokens`
    is what is left to generate. `attempt` is k for the k-th re-plan (the decision
    answering it carries the same `attempt`); `replans_left` is the budget left
    after this one. `failed_instance` is the engine that failed (declared down, or
    whose failure ended the attempt): the new plan avoids it. Everything else is
    what an admission says, so that the decision needs nothing but the log.

    `batch`: the request is a line of the Batch API. It is decided as an interactive
    request of its tier (it runs already: the idle-only rule does not hold it back,
    and `as_admission` does not carry it), but its prefill still gives way to a
    higher priority as a line's does, which the conductor prices
    (`Placement.preemptible`). Absent before schema version 6.
    """

    request_id: str
    gateway_id: str
    attempt: int
    reason: str
    model: str
    block_size: int
    block_hashes: list[int]
    prompt_tokens: int
    max_tokens: int
    failed_instance: str = ""
    generated_tokens: int = 0
    replans_left: int = 0
    priority: int = 0
    slo: Slo = msgspec.field(default_factory=Slo)
    deadline: float = 0.0
    service_tier: str = ""
    batch: bool = False

    def as_admission(self) -> RequestAdmitted:
        """The admission a placement policy decides on: this request as it stands."""
        return RequestAdmitted(
            time=self.time,
            request_id=self.request_id,
            gateway_id=self.gateway_id,
            model=self.model,
            block_size=self.block_size,
            block_hashes=self.block_hashes,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            priority=self.priority,
            slo=self.slo,
            deadline=self.deadline,
            service_tier=self.service_tier,
        )


ProgressStage = Literal[
    "prefill_started",
    "prefill_done",
    "kv_committed",
    "first_token",
]


class RequestProgress(Event, tag="request_progress"):
    """A milestone of a request on an engine; lets the conductor track queues."""

    request_id: str
    instance_id: str
    stage: ProgressStage
    computed_tokens: int = 0
    reused_tokens: int = 0


RequestOutcome = Literal["completed", "failed", "cancelled", "rejected"]

#: `RequestFinished.reason` of a request a decode instance cut short for lack of KV
#: pages: its outcome is `completed` (the client has what was generated, ended by
#: length), its output shorter than it would have been.
CUT_SHORT_REASON = "kv_exhausted"


class RequestFinished(Event, tag="request_finished"):
    """An attempt of a request ended; the outcome and the measured latencies.

    A request re-planned after a failure has one per attempt that ended: the failed
    attempt's (from the engine or the gateway that saw it fail) and the last one's.
    `attempt` is the attempt it ends (`RequestScheduled.attempt`); None in logs
    written before events carried it, where it ends whatever attempt is placed.
    """

    request_id: str
    instance_id: str
    outcome: RequestOutcome
    reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    tbt_mean_s: float = 0.0
    attempt: int | None = None


class RequestCancelled(Event, tag="request_cancelled"):
    """The client went away or the gateway gave up: every instance frees the request."""

    request_id: str
    reason: str = ""


# --- prefix queries -----------------------------------------------------------------


class PrefixMatchQuery(Event, tag="prefix_match_query"):
    """Ask the conductor how much of a block chain the pool already holds."""

    query_id: str
    block_hashes: list[int]


class PrefixMatch(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """Longest cached prefix of a chain on one instance, in blocks."""

    instance_id: str
    tier: Tier
    blocks: int


class PrefixMatchAnswer(Event, tag="prefix_match_answer"):
    """The conductor's answer to a `PrefixMatchQuery`."""

    query_id: str
    matches: list[PrefixMatch] = msgspec.field(default_factory=list)


# --- KV block locations -------------------------------------------------------------


class BlockEvent(Event):
    """Base of per-instance block index updates.

    `event_id` is monotonic per (instance, epoch); `epoch` changes when the instance
    restarts. A consumer that sees a gap or a new epoch asks for a resync.
    """

    instance_id: str
    epoch: int
    event_id: int


class BlockStored(BlockEvent, tag="block_stored"):
    """Blocks became available on an instance in a tier."""

    block_hashes: list[int]
    tier: Tier
    parent_hash: int = 0


class BlockEvicted(BlockEvent, tag="block_evicted"):
    """Blocks left an instance altogether."""

    block_hashes: list[int]


class BlockMoved(BlockEvent, tag="block_moved"):
    """Blocks changed tier on the same instance (DRAM -> SSD, SSD -> DRAM)."""

    block_hashes: list[int]
    from_tier: Tier
    to_tier: Tier


class BlocksCleared(BlockEvent, tag="blocks_cleared"):
    """Everything the instance held is gone (restart, reset)."""


class ResyncRequested(Event, tag="resync_requested"):
    """A consumer lost track of an instance's blocks and asks for its full inventory."""

    instance_id: str
    requester: str
    reason: str = ""


class BlockInventory(BlockEvent, tag="block_inventory"):
    """Full block list of an instance at `event_id`; replaces what the index had."""

    dram: list[int] = msgspec.field(default_factory=list)
    ssd: list[int] = msgspec.field(default_factory=list)
    engine: list[int] = msgspec.field(default_factory=list)


# --- instances and load -------------------------------------------------------------


class InstanceUp(Event, tag="instance_up"):
    """An instance started and can be reached.

    `ucx_address` is its KV receiver's `PeerAddress` (`"ucx://host/tag/worker"`;
    empty for instances without a data plane); `host` groups instances that share a
    kvstore.

    A prefill instance that is one stage of a prefill group (chunked pipeline
    parallelism) names its `group`, the layers it holds, `[layer_start, layer_end)` of
    the model's `num_layers`, and the group's chunk size in tokens (`chunk_tokens`).
    The group serves requests once live stages cover every layer; the stage holding
    layer 0 leads it (the job goes there). Empty `group`: a whole-model instance.

    A decode instance with `piggyback` takes prompts into its batch: it prefills them
    in chunks inside its decode steps (SARATHI's chunked prefill), loading their
    cached prefix from the pool itself.

    An engine's KV cache holds `kv_capacity_blocks` blocks of `kv_block_bytes` bytes
    each (one block's KV across the layers it holds); `kv_spec` says what one token's
    KV is (parts, heads, numbers, dtype, layers: `yb_core.kv_spec`), which the
    conductor prices transfers with.

    `tensor_parallel` is how many devices (ranks) the instance spans, each holding its
    share of the heads and of their KV; `transfer_lanes` how many independent data-plane
    endpoints its KV moves over at once (1: every rank's pages go through one).
    """

    instance_id: str
    role: Role
    host: str
    model: str = ""
    ucx_address: str = ""
    block_size: int = 0
    kv_capacity_blocks: int = 0
    max_batch_size: int = 0
    attention_backend: str = ""
    epoch: int = 0
    metrics_address: str = ""
    group: str = ""
    layer_start: int = 0
    layer_end: int = 0
    num_layers: int = 0
    chunk_tokens: int = 0
    piggyback: bool = False
    kv_block_bytes: int = 0
    kv_spec: KVCacheSpec | None = None
    tensor_parallel: int = 1
    transfer_lanes: int = 1


class InstanceDown(Event, tag="instance_down"):
    """An instance stopped (announced) or was declared dead (heartbeat timeout)."""

    instance_id: str
    reason: str = ""


class InstanceDraining(Event, tag="instance_draining"):
    """An engine instance stops taking new work: it finishes what it holds by
    `deadline` (wall clock), hands what is left then to other instances through the
    re-plan path, and stops (`InstanceDown`).

    The instance publishes it itself when told to stop (a signal from its pool's
    actuator, `docker stop`, Kubernetes), so the conductor places nothing more there
    from this point of the log on. Its blocks in the kvstores stay: they belong to
    the host's pool, not to the engine.
    """

    instance_id: str
    reason: str = ""
    deadline: float = 0.0


class LoadReport(Event, tag="load_report"):
    """Periodic load of one instance; also serves as its heartbeat."""

    instance_id: str
    role: Role
    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    last_step_s: float = 0.0
    dram_blocks: int = 0
    ssd_blocks: int = 0


class LoadPrediction(Event, tag="load_prediction"):
    """The conductor's prediction of a decode instance's batch at a future time.

    Published with the decision for `request_id` under the `predicted` admission
    policy: `at_time` is when that request's prefill is expected to end.
    """

    instance_id: str
    at_time: float
    predicted_batch: int
    predicted_tbt_s: float
    request_id: str = ""
    current_batch: int = 0


class ReplicationPlanned(Event, tag="replication_planned"):
    """The conductor asks a kvstore to copy a hot prefix from another host's kvstore.

    `block_hashes` is the prefix (in chain order) that `source_instance` holds and
    `target_instance` should fetch and store; `demand` is the number of requests
    that wanted it in the conductor's demand window. The target logs `BlockStored`
    when it has the copy, which is how the index learns of it.
    """

    source_instance: str
    target_instance: str
    block_hashes: list[int]
    demand: int = 0
    reason: str = ""


class ConductorConfigured(Event, tag="conductor_configured"):
    """The settings the conductor decides with from this point of the log on.

    Published by a conductor when it becomes the active one. The conductor's fold
    adopts it where it stands in the log, so a replay anywhere decides with exactly
    the settings and cost model the live conductor had, not with the replaying
    operator's. Both are JSON text: readers of another version drop what they do
    not know instead of failing on the whole event.

    `behaviour_version` is the conductor's behaviour version
    (`yb_conductor.compat.BEHAVIOUR_VERSION`); 0, a record made before versions
    existed. It says what a setting the record lacks stands for: the value that
    reproduces that conductor, or today's default.
    """

    instance_id: str
    settings_json: str
    cost_model_json: str = ""
    software: str = ""
    behaviour_version: int = 0


# --- data plane ---------------------------------------------------------------------


class TransferFailed(Event, tag="transfer_failed"):
    """A KV transfer failed; the conductor re-plans around the peer."""

    request_id: str
    source_instance: str
    target_instance: str
    reason: str


# --- retention ----------------------------------------------------------------------


class RetentionPlanned(Event, tag="retention_planned"):
    """The conductor's advice to one kvstore on which blocks to keep and which to let
    go first (`yb_conductor.retention`).

    Decided with the placement of `request_id`, from what the conductor has seen of
    each block's prefix (how many requests used it and its chain's head, how long
    apart, what share of such blocks are used again) and of where copies are.
    `reuse`: blocks expected to be used again, each to count `reuse_s` seconds (the
    same position) older than it is: the later and the less likely its next use, the
    more. The store evicts the oldest so counted first (an unmarked block counts its
    own age: LRU). `demote`: copies of a prefix another kvstore holds, first
    to leave DRAM (to SSD where there is one). `drop`: no reuse predicted: the first
    to leave, dropped rather than written to SSD. A block not held yet (the request's
    own, stored when its prefill ends) takes the advice when it arrives. The store
    follows advice only when it must make room: nothing is evicted on the advice
    alone. `needed`: blocks of this store that the placed request will read when its
    prefill starts: the last to leave, until read or for `needed_s` seconds (the
    predicted wait, with slack), so a queued request finds the prefix it was placed
    for.
    """

    instance_id: str
    request_id: str = ""
    reuse: list[int] = msgspec.field(default_factory=list)
    reuse_s: list[float] = msgspec.field(default_factory=list)
    demote: list[int] = msgspec.field(default_factory=list)
    drop: list[int] = msgspec.field(default_factory=list)
    reason: str = ""
    needed: list[int] = msgspec.field(default_factory=list)
    needed_s: float = 0.0


# --- the planner ----------------------------------------------------------------------

PoolRole = Literal["prefill", "decode"]


class PoolForecast(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """What the planner saw over its window and expects `lead_s` ahead: requests per
    second, and the mean prompt, computed (prompt less reused) and output tokens of a
    request."""

    window_s: float = 0.0
    lead_s: float = 0.0
    arrival_rate: float = 0.0
    forecast_rate: float = 0.0
    prompt_tokens: float = 0.0
    computed_tokens: float = 0.0
    output_tokens: float = 0.0


class PoolSize(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One pool as the planner sized it: the instances serving (`current`, neither
    starting nor draining), starting and draining; how many the forecast needs
    (fractional, before headroom is rounded up); and the target it decided."""

    role: PoolRole
    current: int = 0
    starting: int = 0
    draining: int = 0
    needed: float = 0.0
    target: int = 0
    #: Why the target is not simply what is needed (held for hysteresis, capped by
    #: the budget, kept at the minimum); empty when it is.
    held_by: str = ""


class PoolAction(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One step for the actuator: `add` an instance to `role`'s pool, `drain` one of
    it (`instance_id`), or `move` one (`instance_id`) into `role` (a drain and a
    restart in the other role)."""

    action: Literal["add", "drain", "move"]
    role: PoolRole
    instance_id: str = ""


class PoolPlanned(Event, tag="pool_planned"):
    """The planner's decision on the pools' sizes (`yb_conductor.planner`): what it
    forecast, each pool's size and target, and the actions that carry it out (none
    when the pools are as they should be: then only logged when the target changed).

    Published by the active conductor; replay recomputes it from the log before it
    as it does placements, and `yb replay --set planner_*` asks what other planner
    settings would have decided.
    """

    planner_id: str
    forecast: PoolForecast
    pools: list[PoolSize]
    actions: list[PoolAction] = msgspec.field(default_factory=list)
    max_instances: int = 0
    reason: str = ""


AnyEvent = (
    RequestAdmitted
    | RequestScheduled
    | RequestRejected
    | RequestReplanned
    | RequestProgress
    | RequestFinished
    | RequestCancelled
    | PrefixMatchQuery
    | PrefixMatchAnswer
    | BlockStored
    | BlockEvicted
    | BlockMoved
    | BlocksCleared
    | ResyncRequested
    | BlockInventory
    | InstanceUp
    | InstanceDown
    | InstanceDraining
    | LoadReport
    | LoadPrediction
    | ReplicationPlanned
    | ConductorConfigured
    | TransferFailed
    | RetentionPlanned
    | PoolPlanned
)


class StrictDecoder(Generic[T]):
    """A msgpack decoder for one type whose only failures are msgspec's own errors.

    msgspec lets a `UnicodeDecodeError` through when a tag or key holds invalid UTF-8;
    a reader of the wire must see every malformed message as `msgspec.DecodeError`, so
    that one `except` refuses it and the process lives.
    """

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        """Decode, or raise `msgspec.DecodeError` / `msgspec.ValidationError`."""
        try:
            return self._decoder.decode(data)
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"invalid UTF-8 in message: {exc}") from exc


_encoder = msgspec.msgpack.Encoder()
_decoder: StrictDecoder[AnyEvent] = StrictDecoder(AnyEvent)


def encode_event(event: AnyEvent) -> bytes:
    """Serialize an event for the wire."""
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Parse an event; raises `msgspec.ValidationError`/`DecodeError` on bad input."""
    return _decoder.decode(data)


def instance_down_subject(instance_id: str) -> str:
    """The subject of the verdicts on one instance (`subject_for` of its `InstanceDown`)."""
    return subject_for(InstanceDown(instance_id=instance_id, reason=""))


def subject_for(event: AnyEvent) -> str:
    """The stream subject an event is published on.

    Subjects are `yb.ev.<group>.<type>[.<key>]`: consumers filter by group (a gateway
    follows only `yb.ev.decision.<its id>.>`, an engine only `yb.ev.req.cancelled`),
    and the stream captures them all with `yb.ev.>`.
    """
    tag = type(event).__struct_config__.tag
    match event:
        case RequestScheduled() | RequestRejected():
            return f"yb.ev.decision.{subject_token(event.gateway_id)}.{tag}"
        case LoadPrediction():
            return f"yb.ev.decision.prediction.{subject_token(event.instance_id)}"
        case ReplicationPlanned():
            return f"yb.ev.decision.replication.{subject_token(event.target_instance)}"
        case RetentionPlanned():
            return f"yb.ev.decision.retention.{subject_token(event.instance_id)}"
        case BlockEvent():
            return f"yb.ev.block.{tag}.{subject_token(event.instance_id)}"
        case ResyncRequested():
            return f"yb.ev.block.{tag}.{subject_token(event.instance_id)}"
        case InstanceUp() | InstanceDown() | InstanceDraining() | LoadReport():
            return f"yb.ev.instance.{tag}.{subject_token(event.instance_id)}"
        case PoolPlanned():
            return f"yb.ev.decision.pool.{subject_token(event.planner_id)}"
        case RequestReplanned():
            # A re-plan is an admission of the request's continuation: it travels
            # with the admissions (one subject for the conductor's admissions, one
            # permission for the gateway's publishes).
            return f"yb.ev.req.{RequestAdmitted.__struct_config__.tag}"
        case PrefixMatchQuery() | PrefixMatchAnswer():
            return f"yb.ev.prefix.{tag}"
        case TransferFailed():
            return f"yb.ev.transfer.{tag}"
        case ConductorConfigured():
            return f"yb.ev.conductor.{tag}.{subject_token(event.instance_id)}"
        case _:
            return f"yb.ev.req.{tag}"


def decision_subjects(gateway_id: str) -> str:
    """The filter that matches every decision addressed to one gateway."""
    return f"yb.ev.decision.{subject_token(gateway_id)}.>"


def message_id_for(event: AnyEvent) -> str:
    """A de-duplication id: republishing the same event yields the same id.

    JetStream drops a second publish with the same `Nats-Msg-Id` inside its duplicate
    window, so a retried publish never appears twice in the log.
    """
    cls = type(event)
    format_id = _MESSAGE_ID_FORMATS.get(cls)
    if format_id is None:
        format_id = _MESSAGE_ID_FORMATS[cls] = _message_id_format(cls)
    return format_id(event)


# The id's format for each event class, chosen once per class: the conductor asks for
# one with every decision, and a chain of class tests per call costs more than the id.
_MESSAGE_ID_FORMATS: dict[type, Callable[[Any], str]] = {}


def _message_id_format(cls: type) -> Callable[[Any], str]:
    """How `message_id_for` writes the id of an event of class `cls`."""
    tag = cls.__struct_config__.tag  # type: ignore[attr-defined]

    def periodic(e: Any) -> str:
        # Periodic events are distinct occurrences; time makes them unique per
        # publisher and stable across a retry of the same object.
        return f"{tag}:{getattr(e, 'instance_id', '')}:{e.time!r}"

    if issubclass(cls, BlockEvent):
        return lambda e: f"{tag}:{e.instance_id}:{e.epoch}:{e.event_id}"
    if issubclass(cls, (RequestScheduled, RequestRejected)):
        return lambda e: (
            f"{tag}:{e.request_id}:{e.attempt}" if e.attempt else f"{tag}:{e.request_id}"
        )
    if issubclass(cls, RequestReplanned):
        return lambda e: f"{tag}:{e.request_id}:{e.attempt}"
    if issubclass(cls, RequestFinished):
        # Each attempt ends once on each instance that ends it: an id of the request
        # alone made the log drop the end of a re-planned request's last attempt as a
        # copy of its failed first one.
        return lambda e: (
            f"{tag}:{e.request_id}"
            if e.attempt is None
            else f"{tag}:{e.request_id}:{e.attempt}:{e.instance_id}"
        )
    if issubclass(cls, (RequestAdmitted, RequestCancelled)):
        return lambda e: f"{tag}:{e.request_id}"
    if issubclass(cls, RequestProgress):
        return lambda e: f"{tag}:{e.request_id}:{e.instance_id}:{e.stage}"
    if issubclass(cls, LoadPrediction):
        # `at_time` tells a re-plan's prediction from the first plan's.
        return lambda e: (
            f"{tag}:{e.request_id}:{e.instance_id}:{e.at_time!r}" if e.request_id else periodic(e)
        )
    if issubclass(cls, ReplicationPlanned):
        return lambda e: (
            f"{tag}:{e.target_instance}:{e.block_hashes[-1] if e.block_hashes else 0}:{e.time!r}"
        )
    if issubclass(cls, RetentionPlanned):
        # One per kvstore per decision; a re-plan's decision comes at another time.
        return lambda e: f"{tag}:{e.instance_id}:{e.request_id}:{e.time!r}"
    return periodic


def subject_token(name: str) -> str:
    """`name` made safe as one NATS subject token ('.', '*', '>' and blanks replaced)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "_"
