"""The Mooncake trace reader every tool shares: records, limits, and named bad lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_tools.traces import TraceError, TraceRecord, read_trace


def test_records_are_read_in_file_order_skipping_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [4, 5]}\n'
        "\n"
        '{"timestamp": 1.5, "input_length": 5, "output_length": 1}\n'
    )
    assert read_trace(path) == [
        TraceRecord(timestamp=0, input_length=600, output_length=2, hash_ids=[4, 5]),
        # A record without hash ids shares no block with any other.
        TraceRecord(timestamp=1.5, input_length=5, output_length=1, hash_ids=[]),
    ]


def test_a_limit_keeps_the_first_records_and_reads_no_further(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
    # The bad third line is past the limit: it is never parsed.
    path.write_text(good + good + "not json\n")
    assert len(read_trace(path, limit=2)) == 2
    with pytest.raises(TraceError):
        read_trace(path)


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"nope": 1}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:3"):
        read_trace(path)


def test_a_wrongly_typed_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": "long", "output_length": 1}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:1: .*input_length"):
        read_trace(path)
