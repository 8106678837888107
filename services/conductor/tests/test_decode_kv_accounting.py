"""A decode instance's KV room as the engine will hold it (`decode_kv_peak`).

The budget of every request there (prompt plus expected output, all at once, none
ever ending) says no room; the projection follows what each request holds now, how
it grows and when it is expected to end, and admits where the pages will be there.
A log recorded before the setting replays with the budget alone.
"""

from __future__ import annotations

from typing import Any

import msgspec
from test_calibration import _ask, _verdict
from test_placement import keys

from yb_conductor.conductor import Conductor
from yb_conductor.replay import LogRecord, replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev
from yb_core.config import ConductorConfig

BS = 16


def _decoding(c: Any, n: int, *, max_tokens: int, prompt: int = 17, first: int = 0) -> None:
    """`n` requests on d-0 (the only decode instance up), each decoding now."""
    for i in range(first, first + n):
        d = c.admit(f"w{i}", keys(1, base=100 * i), prompt=prompt, max_tokens=max_tokens)
        assert isinstance(d, ev.RequestScheduled) and d.decode_instance == "d-0"
        c.progress(d.request_id, "p-0", "prefill_started")
        c.progress(d.request_id, "p-0", "prefill_done")
        c.progress(d.request_id, "d-0", "kv_committed")


def _queued_cluster(c: Any, *, max_tokens: int, d0_blocks: int = 40, longer: int = 0) -> None:
    """d-0 full by the budgets of 20 requests decoding there (and of `longer` more
    that ask for 10,000 tokens); d-1 up later, holding a long prompt whose prefill
    keeps p-0 busy for 4.8 s, with room left for nothing else. A request now waits
    behind that prefill."""
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.decode("d-0", kv_blocks=1000)
    _decoding(c, 20, max_tokens=max_tokens)
    _decoding(c, longer, max_tokens=10_000, first=20)
    c.decode("d-0", kv_blocks=d0_blocks)  # announced again: fuller than its budgets
    c.decode("d-1", kv_blocks=302)
    long = c.admit("long", keys(300, base=50_000))  # 4,801 tokens + 10 out: 301 blocks
    assert isinstance(long, ev.RequestScheduled) and long.decode_instance == "d-1"
    c.progress("long", "p-0", "prefill_started")


def test_requests_ending_before_a_queued_one_starts_leave_it_their_pages(
    crafted: Any,
) -> None:
    # 17 + 10 tokens each: 2 blocks budgeted, 40 of d-0's 40. Ten tokens at the
    # predicted step end them 0.3 s from now; the next request's prefill waits 4.8 s.
    c = crafted(admission="none")
    _queued_cluster(c, max_tokens=10)
    assert _verdict(_ask(c, _r(10), decode_kv_peak=False)) == "decode_kv_full"
    decided = _ask(c, _r(10))
    assert isinstance(decided, ev.RequestScheduled) and decided.decode_instance == "d-0"
    assert c.admit("r", keys(1, base=99_000), prompt=17).decode_instance == "d-0"
    assert replay(c.records).divergences == []


def _r(max_tokens: int) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id="r", gateway_id="g", model="", block_size=BS,
        block_hashes=keys(1, base=99_000), prompt_tokens=17, max_tokens=max_tokens,
        slo=ev.Slo(ttft_s=100.0, tbt_s=1.0),
    )  # fmt: skip


def test_requests_still_decoding_when_it_starts_keep_their_pages_and_grow(
    crafted: Any,
) -> None:
    # Beside the 20 that end first, 10 are expected to decode for `t_d` (10 s) and
    # grow to 17 + 64 tokens (6 blocks each). When the queued request starts (4.8 s
    # from now) they hold about 4 blocks each and grow to 6 before they end, with
    # its own prompt and growth: a peak of about 64 blocks; the budget says 86.
    for blocks, verdict in ((64, "decode_kv_full"), (65, "admit")):
        c = crafted(admission="none")
        _queued_cluster(c, max_tokens=10, d0_blocks=blocks, longer=10)
        assert _verdict(_ask(c, _r(10_000), decode_kv_peak=False)) == "decode_kv_full"
        assert _verdict(_ask(c, _r(10_000))) == verdict


def test_without_requests_ending_first_the_budget_decides(crafted: Any) -> None:
    # Every request there decodes past the queued one's start: the budget's verdict
    # stands, though the projected peak (about 124 of 125 blocks) would fit.
    c = crafted(admission="none")
    _queued_cluster(c, max_tokens=10_000, d0_blocks=125)
    assert _verdict(_ask(c, _r(10_000), decode_kv_peak=False)) == "decode_kv_full"
    assert _verdict(_ask(c, _r(10_000))) == "decode_kv_full"


def test_a_request_past_its_expected_end_keeps_its_pages(crafted: Any) -> None:
    c = crafted(admission="none")
    _queued_cluster(c, max_tokens=10)
    # The 20 were expected to end by 1.3 s; none has by 2.0.
    c.at(2.0).feed(ev.LoadReport(instance_id="p-0", role="prefill", running_requests=1))
    assert _verdict(_ask(c, _r(10))) == "decode_kv_full"


def test_what_the_instance_reports_beyond_the_projection_is_added(crafted: Any) -> None:
    # 20 requests of one block's prompt (15 tokens): projected to hold 20 blocks now.
    # A queued request of 20 blocks fits the projection (they end before it starts)
    # until d-0 reports holding 40: the 20 it misses count against the room.
    c = crafted(admission="none")
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.decode("d-0", kv_blocks=40)
    _decoding(c, 20, max_tokens=10, prompt=15)
    c.decode("d-1", kv_blocks=302)
    c.admit("long", keys(300, base=50_000))
    c.progress("long", "p-0", "prefill_started")
    r = ev.RequestAdmitted(
        request_id="r", gateway_id="g", model="", block_size=BS,
        block_hashes=keys(20, base=99_000), prompt_tokens=20 * BS - 1, max_tokens=10,
        slo=ev.Slo(ttft_s=100.0, tbt_s=1.0),
    )  # fmt: skip
    assert _verdict(_ask(c, r)) == "admit"
    for _ in range(10):  # at once: nothing generated yet, by the projection
        c.feed(
            ev.LoadReport(instance_id="d-0", role="decode", kv_used_blocks=40, kv_total_blocks=40)
        )
    assert c.c.state.instances["d-0"].kv_unprojected_blocks > 19.0
    assert _verdict(_ask(c, r)) == "decode_kv_full"
    assert replay(c.records).divergences == []


def _without_setting(records: list[LogRecord]) -> list[LogRecord]:
    """The log as a conductor from before `decode_kv_peak` recorded it: its
    `ConductorConfigured` without the field, and without a behaviour version."""
    out = []
    for rec in records:
        event = rec.event
        if isinstance(event, ev.ConductorConfigured):
            raw = msgspec.json.decode(event.settings_json.encode())
            assert raw.pop("decode_kv_peak") is False
            event = msgspec.structs.replace(
                event, settings_json=msgspec.json.encode(raw).decode(), behaviour_version=0
            )
        out.append(LogRecord(seq=rec.seq, event=event, subject=rec.subject))
    return out


def test_an_old_log_replays_with_the_budget_and_a_new_one_with_the_projection(
    crafted: Any,
) -> None:
    assert ConductorConfig().decode_kv_peak is True
    assert recorded_settings('{"policy": "mooncake"}').decode_kv_peak is False
    assert recorded_settings('{"decode_kv_peak": true}').decode_kv_peak is True

    def recorded(peak: bool) -> list[LogRecord]:
        c = crafted(admission="none", decode_kv_peak=peak)
        _queued_cluster(c, max_tokens=10)
        d = c.admit("r", keys(1, base=99_000), prompt=17)
        assert isinstance(d, ev.RequestRejected) != peak
        return c.records

    def diverges(records: list[LogRecord], peak: bool) -> bool:
        forced = Conductor(overrides={"decode_kv_peak": peak})
        return bool(replay(records, strict=False, conductor=forced).divergences)

    old = _without_setting(recorded(False))
    assert replay(old).divergences == []
    assert diverges(old, True)  # the log tells the two rules apart
    new = recorded(True)
    assert replay(new).divergences == []
    assert diverges(new, False)
