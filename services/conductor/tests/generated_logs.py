"""Generated event logs for property tests: a plan of steps, a live conductor, a log.

`steps` is a hypothesis strategy of cluster happenings (admissions with shared
prefixes, block stores and evictions with occasional gaps, progress, completions,
cancellations, heartbeats and silences, instances going down, settings changing);
`live_log(plan)` runs a live conductor over them and, as a real conductor does,
appends each decision to the log a few events after its admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from yb_conductor.conductor import Conductor
from yb_conductor.replay import LogRecord
from yb_conductor.settings import configured_event
from yb_core import events as ev
from yb_core.config import ConductorConfig

PREFILLS = [("p0", "h0"), ("p1", "h1"), ("p2", "h1")]
KVSTORES = [("kv0", "h0"), ("kv1", "h1")]
DECODES = ["d0", "d1"]
HOLDERS = ["kv0", "kv1", "p0", "p1"]
EVERYONE = [name for name, _ in PREFILLS + KVSTORES] + DECODES


@dataclass(frozen=True)
class Admit:
    chain: list[int]
    extra_tokens: int
    priority: int


@dataclass(frozen=True)
class Blocks:
    holder: str
    chain: list[int]
    evict: bool
    ssd: bool
    skip_id: bool  # leave a gap in the holder's event ids


@dataclass(frozen=True)
class Progress:
    which: int
    stage: ev.ProgressStage


@dataclass(frozen=True)
class Finish:
    which: int
    cancelled: bool


@dataclass(frozen=True)
class Tick:
    seconds: float
    everyone_reports: bool  # else only decode instances: the rest fall silent


@dataclass(frozen=True)
class Down:
    instance: str


@dataclass(frozen=True)
class Configure:
    admission: str
    sharing: str


@dataclass(frozen=True)
class Flush:
    decisions: int  # how many pending decisions reach the log now


Step = Admit | Blocks | Progress | Finish | Tick | Down | Configure | Flush

chains = st.lists(st.integers(0, 4), max_size=8).map(
    lambda xs: [1000 * (i + 1) + x for i, x in enumerate(xs)]
)
steps: st.SearchStrategy[Step] = st.one_of(
    st.builds(Admit, chains, st.integers(1, 300), st.integers(-2, 1)),
    st.builds(
        Blocks,
        st.sampled_from(HOLDERS),
        chains,
        st.booleans(),
        st.booleans(),
        st.integers(0, 9).map(lambda n: n == 0),
    ),
    st.builds(
        Progress,
        st.integers(0, 30),
        st.sampled_from(["prefill_started", "prefill_done", "kv_committed"]),
    ),
    st.builds(Finish, st.integers(0, 30), st.booleans()),
    st.builds(Tick, st.floats(0.0, 20.0), st.booleans()),
    st.builds(Down, st.sampled_from(EVERYONE)),
    st.builds(
        Configure,
        st.sampled_from(["none", "early", "predicted"]),
        st.sampled_from(["none", "host", "all"]),
    ),
    st.builds(Flush, st.integers(0, 3)),
)


# Hot-prefix replication on, with a low bar, so that it is exercised too; engines
# that share a host's compute (p1 and p2 on h1) price each other in.
HOT = {"hot_replicas": 2, "hot_demand": 2, "hot_window_s": 30.0}


def live_log(plan: list[Step]) -> list[LogRecord]:
    """Run a live conductor over the plan and return the log it leaves."""
    live = Conductor(cfg=ConductorConfig(compute_sharing="host", **HOT))  # type: ignore[arg-type]
    log: list[LogRecord] = []
    pending: list[ev.AnyEvent] = []
    clock = [1.0]
    event_ids: dict[str, int] = {}
    admitted: list[str] = []

    def emit(event: ev.AnyEvent) -> None:
        if not event.time:
            event.time = clock[0]
        log.append(LogRecord(seq=len(log) + 1, event=event))
        pending.extend(live.apply(len(log), event))

    def flush(n: int) -> None:
        for _ in range(min(n, len(pending))):
            emit(pending.pop(0))

    emit(configured_event(live.cfg, live.policy.cost, "c"))
    for name, host in PREFILLS:
        emit(ev.InstanceUp(instance_id=name, role="prefill", host=host))
    for name, host in KVSTORES:
        emit(ev.InstanceUp(instance_id=name, role="kvstore", host=host))
    for name in DECODES:
        emit(ev.InstanceUp(instance_id=name, role="decode", host="hd", kv_capacity_blocks=200))
    for step in plan:
        match step:
            case Admit(chain, extra, priority):
                rid = f"r{len(admitted)}"
                admitted.append(rid)
                emit(
                    ev.RequestAdmitted(
                        request_id=rid,
                        gateway_id="g",
                        model="",
                        block_size=16,
                        block_hashes=chain,
                        prompt_tokens=len(chain) * 16 + extra,
                        max_tokens=extra,
                        priority=priority,
                        slo=ev.Slo(ttft_s=3.0, tbt_s=0.09),
                    )
                )
            case Blocks(holder, chain, evict, ssd, skip_id):
                event_ids[holder] = event_ids.get(holder, 0) + (2 if skip_id else 1)
                eid = event_ids[holder]
                if evict:
                    emit(
                        ev.BlockEvicted(
                            instance_id=holder, epoch=1, event_id=eid, block_hashes=chain
                        )
                    )
                else:
                    tier: ev.Tier = (
                        "ssd" if ssd else ("engine" if holder.startswith("p") else "dram")
                    )
                    emit(
                        ev.BlockStored(
                            instance_id=holder, epoch=1, event_id=eid, block_hashes=chain, tier=tier
                        )
                    )
            case Progress(which, stage) if admitted:
                rid = admitted[which % len(admitted)]
                emit(ev.RequestProgress(request_id=rid, instance_id="x", stage=stage))
            case Finish(which, cancelled) if admitted:
                rid = admitted[which % len(admitted)]
                if cancelled:
                    emit(ev.RequestCancelled(request_id=rid))
                else:
                    emit(
                        ev.RequestFinished(
                            request_id=rid,
                            instance_id="d",
                            outcome="completed",
                            output_tokens=5,
                            tbt_mean_s=0.02,
                            ttft_s=0.3,
                        )
                    )
            case Tick(seconds, everyone):
                clock[0] += seconds
                for name in EVERYONE if everyone else DECODES:
                    role: ev.Role = "decode" if name in DECODES else "prefill"
                    emit(ev.LoadReport(instance_id=name, role=role))
            case Down(instance):
                emit(ev.InstanceDown(instance_id=instance))
            case Configure(admission, sharing):
                cfg = ConductorConfig(
                    admission=admission,  # type: ignore[arg-type]
                    compute_sharing=sharing,  # type: ignore[arg-type]
                    **HOT,  # type: ignore[arg-type]
                )
                emit(configured_event(cfg, live.policy.cost, "c", time=clock[0]))
            case Flush(n):
                flush(n)
            case _:
                pass
    flush(len(pending))
    assert live.divergences == []
    return log
