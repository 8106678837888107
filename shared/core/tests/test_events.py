"""Events: every type round-trips through the one decoder; bad bytes are refused."""

from __future__ import annotations

import msgspec
import pytest

from yb_core import events as ev


def _samples() -> list[ev.AnyEvent]:
    return [
        ev.RequestAdmitted(
            request_id="r1",
            gateway_id="g",
            model="m",
            block_size=16,
            block_hashes=[1, 2],
            prompt_tokens=40,
            max_tokens=8,
            priority=-1,
            slo=ev.Slo(ttft_s=120.0, tbt_s=2.0),
            service_tier="flex",
        ),
        ev.RequestScheduled(
            request_id="r1",
            gateway_id="g",
            prefill_instance="p0",
            decode_instance="d0",
            reuse=[ev.ReusePlan(source_instance="kv0", tier="dram", first_block=0, num_blocks=2)],
            explain=ev.Explanation(
                branch="transfer",
                best_blocks=2,
                candidates=[ev.Candidate(instance_id="p0", option="transfer", ttft_s=0.5)],
                decode_candidates=[ev.DecodeCandidate(instance_id="d0", batch=1, tbt_s=0.02)],
            ),
        ),
        ev.RequestRejected(
            request_id="r2",
            gateway_id="g",
            reason="overloaded",
            explain=ev.Explanation(branch="reject", reason="tbt_slo: too slow"),
        ),
        ev.RequestProgress(request_id="r1", instance_id="p0", stage="prefill_done"),
        ev.RequestFinished(request_id="r1", instance_id="d0", outcome="completed"),
        ev.RequestCancelled(request_id="r1"),
        ev.PrefixMatchQuery(query_id="q", block_hashes=[1]),
        ev.PrefixMatchAnswer(query_id="q"),
        ev.BlockStored(instance_id="kv0", epoch=1, event_id=1, block_hashes=[1], tier="dram"),
        ev.BlockEvicted(instance_id="kv0", epoch=1, event_id=2, block_hashes=[1]),
        ev.BlockMoved(
            instance_id="kv0",
            epoch=1,
            event_id=3,
            block_hashes=[1],
            from_tier="dram",
            to_tier="ssd",
        ),
        ev.BlocksCleared(instance_id="kv0", epoch=1, event_id=4),
        ev.ResyncRequested(instance_id="kv0", requester="conductor"),
        ev.BlockInventory(instance_id="kv0", epoch=1, event_id=4, dram=[1]),
        ev.InstanceUp(instance_id="p0", role="prefill", host="h"),
        ev.InstanceDown(instance_id="p0"),
        ev.InstanceDraining(instance_id="d0", reason="stopping", deadline=1_700_000_020.0),
        ev.LoadReport(instance_id="p0", role="prefill"),
        ev.LoadPrediction(instance_id="d0", at_time=1.0, predicted_batch=3, predicted_tbt_s=0.1),
        ev.ReplicationPlanned(
            source_instance="kv0", target_instance="kv1", block_hashes=[1, 2], demand=9
        ),
        ev.ConductorConfigured(instance_id="c0", settings_json="{}", cost_model_json="{}"),
        ev.TransferFailed(request_id="r1", source_instance="p0", target_instance="d0", reason="x"),
        ev.RetentionPlanned(
            instance_id="kv0", request_id="r1", reuse=[1], reuse_s=[2.5], demote=[2], drop=[3]
        ),
        ev.PoolPlanned(
            planner_id="c0",
            forecast=ev.PoolForecast(window_s=180.0, arrival_rate=2.5, forecast_rate=3.0),
            pools=[
                ev.PoolSize(role="prefill", current=2, needed=2.7, target=3),
                ev.PoolSize(role="decode", current=2, needed=0.9, target=2, held_by="hysteresis"),
            ],
            actions=[ev.PoolAction(action="add", role="prefill")],
            max_instances=8,
            reason="forecast: ...",
        ),
        ev.RequestReplanned(
            request_id="r",
            gateway_id="g",
            attempt=1,
            reason="decode instance declared down",
            failed_instance="decode-0",
            model="m",
            block_size=16,
            block_hashes=[1, 2],
            prompt_tokens=40,
            generated_tokens=8,
            max_tokens=8,
            replans_left=0,
        ),
    ]


def test_every_event_type_round_trips() -> None:
    samples = _samples()
    # One sample per member of the union: a new event type must be added here too.
    assert {type(e) for e in samples} == set(ev.AnyEvent.__args__)
    for event in samples:
        decoded = ev.decode_event(ev.encode_event(event))
        assert decoded == event
        assert ev.subject_for(event).startswith("yb.ev.")
        assert ev.message_id_for(event) == ev.message_id_for(decoded)


def test_schema_version_travels_and_old_payloads_decode() -> None:
    event = ev.InstanceDown(instance_id="p0")
    assert ev.decode_event(ev.encode_event(event)).v == ev.SCHEMA_VERSION
    # An older writer that lacks an optional field, and a newer one that adds a field
    # this reader does not know, both decode: services are upgraded one at a time.
    older = msgspec.msgpack.encode({"type": "instance_down", "instance_id": "p0"})
    assert ev.decode_event(older) == ev.InstanceDown(instance_id="p0", reason="")
    newer = msgspec.msgpack.encode(
        {"type": "instance_down", "v": 2, "instance_id": "p0", "added_later": [1]}
    )
    assert ev.decode_event(newer) == ev.InstanceDown(v=2, instance_id="p0")


def test_an_admission_logged_before_tiers_names_none() -> None:
    older = msgspec.msgpack.encode(
        {
            "type": "request_admitted",
            "request_id": "r1",
            "gateway_id": "g",
            "model": "m",
            "block_size": 16,
            "block_hashes": [1],
            "prompt_tokens": 17,
            "max_tokens": 8,
            "priority": 3,
        }
    )
    admitted = ev.decode_event(older)
    assert isinstance(admitted, ev.RequestAdmitted)
    assert (admitted.service_tier, admitted.priority) == ("", 3)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode(["no_such_event", 1]), msgspec.msgpack.encode({"a": 1})],
)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        ev.decode_event(payload)


def test_decisions_are_routed_to_their_gateway() -> None:
    scheduled = _samples()[1]
    assert ev.subject_for(scheduled) == "yb.ev.decision.g.request_scheduled"
    odd = ev.InstanceUp(instance_id="a.b*c", role="decode", host="h")
    assert ev.subject_for(odd) == "yb.ev.instance.instance_up.a_b_c"


def test_load_predictions_are_deduplicated_per_request() -> None:
    # Two predictions at the same event time for different requests must both be
    # stored; a retried publish of one of them must not.
    a = ev.LoadPrediction(
        instance_id="d0", at_time=2.0, predicted_batch=3, predicted_tbt_s=0.1, request_id="a"
    )
    b = ev.LoadPrediction(
        instance_id="d0", at_time=2.0, predicted_batch=4, predicted_tbt_s=0.1, request_id="b"
    )
    assert ev.message_id_for(a) != ev.message_id_for(b)
    assert ev.message_id_for(a) == ev.message_id_for(ev.decode_event(ev.encode_event(a)))


def test_decisions_written_before_explanations_existed_still_decode() -> None:
    old = msgspec.msgpack.encode(
        {
            "type": "request_scheduled",
            "request_id": "r",
            "gateway_id": "g",
            "prefill_instance": "p0",
            "decode_instance": "d0",
        }
    )
    decoded = ev.decode_event(old)
    assert isinstance(decoded, ev.RequestScheduled) and decoded.explain is None
