"""Every decoder on every wire refuses malformed input with its typed error, nothing else.

Property tests (hypothesis) feed arbitrary bytes, arbitrary msgpack values and mutated
valid messages to the event decoder, the point-to-point protocol decoders and the UCX
frame decoder. A decoder may accept (a well-formed message) or refuse with its
documented error; any other exception would crash the process that reads the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yb_core import events as ev
from yb_core import protocol as pr
from yb_dataplane.transport import wire

MSGPACK_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

DECODERS: dict[str, tuple[Callable[[bytes], Any], tuple[type[Exception], ...]]] = {
    "event": (ev.decode_event, MSGPACK_ERRORS),
    "prefill_job": (pr.job_decoder.decode, MSGPACK_ERRORS),
    "job_reply": (pr.job_reply_decoder.decode, MSGPACK_ERRORS),
    "decode_control": (pr.decode_control_decoder.decode, MSGPACK_ERRORS),
    "decode_reply": (pr.decode_reply_decoder.decode, MSGPACK_ERRORS),
    "token_chunk": (pr.token_decoder.decode, MSGPACK_ERRORS),
    "resend": (pr.resend_decoder.decode, MSGPACK_ERRORS),
    "resend_reply": (pr.resend_reply_decoder.decode, MSGPACK_ERRORS),
    "ucx_frame": (lambda b: wire.decode_frame(bytearray(b)), (wire.FrameError,)),
}

# One well-formed message per wire, as its sender builds it.
ORIGINALS: dict[str, Any] = {
    "event": ev.RequestAdmitted(
        request_id="r",
        gateway_id="g",
        model="m",
        block_size=16,
        block_hashes=[1, 2],
        prompt_tokens=40,
        max_tokens=8,
        time=1.5,
    ),
    "prefill_job": pr.PrefillJob(
        request_id="r",
        token_ids=[1, 2, 3],
        block_hashes=[],
        sampling=pr.SamplingParams(),
        decision=ev.RequestScheduled(
            request_id="r", gateway_id="g", prefill_instance="p", decode_instance="d", time=2.5
        ),
        token_subject="yb.tok.g.r",
        deadline=1.0,
    ),
    "job_reply": pr.JobAccepted(request_id="r", instance_id="p"),
    "decode_control": pr.StartDecode(request_id="r", first_token=1, prompt_tokens=3),
    "decode_reply": pr.DecodeAck(request_id="r", ok=True),
    "token_chunk": pr.TokenChunk(request_id="r", seq=0, token_ids=[5], text="x"),
    "resend": pr.ResendTokens(request_id="r", from_seq=3),
    "resend_reply": pr.TokensResent(
        request_id="r", state="streaming", first_seq=0, next_seq=9, resent=6
    ),
    "ucx_frame": wire.Commit(1, "r"),
}


def _encode(name: str, message: Any) -> bytes:
    if name == "event":
        return ev.encode_event(message)
    if name == "ucx_frame":
        return bytes(wire.encode_frame(message))
    return pr.encode(message)


VALID: dict[str, bytes] = {name: _encode(name, m) for name, m in ORIGINALS.items()}

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=20,
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _refused_or_accepted(name: str, data: bytes) -> None:
    decode, errors = DECODERS[name]
    with contextlib.suppress(errors):
        decode(data)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_valid_messages_decode_to_the_originals(name: str) -> None:
    decode, _ = DECODERS[name]
    decoded = decode(VALID[name])
    assert type(decoded) is type(ORIGINALS[name])
    assert decoded == ORIGINALS[name]


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_are_refused_cleanly(name: str, data: bytes) -> None:
    _refused_or_accepted(name, data)


@pytest.mark.parametrize("name", sorted(n for n in DECODERS if n != "ucx_frame"))
@FUZZ
@given(value=msgpack_values)
def test_wrong_shapes_and_types_are_refused_cleanly(name: str, value: Any) -> None:
    _refused_or_accepted(name, msgspec.msgpack.encode(value))


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(position=st.integers(min_value=0), byte=st.integers(0, 255), cut=st.booleans())
def test_mutated_valid_messages_are_refused_cleanly(
    name: str, position: int, byte: int, cut: bool
) -> None:
    data = bytearray(VALID[name])
    index = position % len(data)
    if cut:
        del data[index:]
    else:
        data[index] = byte
    _refused_or_accepted(name, bytes(data))


def test_an_event_with_a_wrong_field_type_names_the_field() -> None:
    bad = msgspec.msgpack.encode(
        {"type": "load_report", "instance_id": "p", "role": "prefill", "queued_requests": "many"}
    )
    with pytest.raises(msgspec.ValidationError, match="queued_requests"):
        ev.decode_event(bad)
