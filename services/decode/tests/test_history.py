"""`TokenHistory`: what decode keeps for resends, and that it stays bounded."""

from __future__ import annotations

from yb_decode.history import CHUNK_OVERHEAD, TokenHistory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fill(history: TokenHistory, request_id: str, count: int, size: int = 10) -> None:
    for seq in range(count):
        history.record(request_id, f"yb.tok.gw.{request_id}", seq, bytes([seq % 256]) * size)


def test_a_live_stream_keeps_every_chunk_in_order() -> None:
    history = TokenHistory()
    fill(history, "r1", 5)
    kept = history.get("r1")
    assert kept is not None and not kept.finished
    assert (kept.subject, kept.first_seq, kept.next_seq) == ("yb.tok.gw.r1", 0, 5)
    assert kept.since(3) == [bytes([3]) * 10, bytes([4]) * 10]
    assert kept.since(0) == kept.since(-1) and len(kept.since(0)) == 5
    assert kept.since(5) == []
    assert history.get("r2") is None


def test_a_finished_stream_is_kept_for_the_retention_then_forgotten() -> None:
    clock = Clock()
    history = TokenHistory(retention_s=30.0, clock=clock)
    fill(history, "r1", 3)
    history.finish("r1")
    clock.now += 29.0
    kept = history.get("r1")
    assert kept is not None and kept.finished and kept.next_seq == 3
    clock.now += 2.0
    assert history.get("r1") is None
    assert history.nbytes == 0 and len(history) == 0


def test_memory_stays_bounded_finished_streams_first() -> None:
    per_chunk = 10 + CHUNK_OVERHEAD
    history = TokenHistory(max_bytes=10 * per_chunk, max_finished=2)
    fill(history, "old", 4)
    history.finish("old")
    fill(history, "live", 8)
    # Over the budget: the finished stream went first, the live one is whole.
    assert history.get("old") is None
    kept = history.get("live")
    assert kept is not None and (kept.first_seq, kept.next_seq) == (0, 8)
    # Still growing: its oldest chunks go, and `first_seq` says so.
    fill_more = [bytes([9]) * 10] * 4
    for seq, payload in enumerate(fill_more, start=8):
        history.record("live", "yb.tok.gw.live", seq, payload)
    assert (kept.first_seq, kept.next_seq) == (2, 12)
    assert history.nbytes == 10 * per_chunk
    # Finished streams are bounded in number too, the oldest going first.
    history = TokenHistory(max_finished=2)
    for rid in ("a", "b", "c"):
        fill(history, rid, 1)
        history.finish(rid)
    assert [history.get(r) is not None for r in ("a", "b", "c")] == [False, True, True]


def test_a_chunk_out_of_line_restarts_the_history() -> None:
    history = TokenHistory()
    fill(history, "r1", 3)
    history.record("r1", "yb.tok.gw.r1", 7, b"x")
    kept = history.get("r1")
    assert kept is not None and (kept.first_seq, kept.next_seq) == (7, 8)
    assert history.nbytes == 1 + CHUNK_OVERHEAD
