"""Mooncake's request-trace format and its reader, for every tool that replays a trace.

A trace is JSON lines, one request each: `timestamp` (milliseconds since the start of
the trace), `input_length` and `output_length` (tokens), and `hash_ids`, one id per
512-token block of the prompt, chained like prefix blocks (equal ids at equal
positions mean equal prefixes). `yb bench` turns records into prompts, `yb sim` into
simulated arrivals, and `tracelog` into a recorded conductor log.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

# Mooncake's traces count 512 tokens per hash id.
TRACE_BLOCK_TOKENS = 512


class TraceRecord(msgspec.Struct, frozen=True, gc=False):
    """One line of a Mooncake trace. `hash_ids` may be empty: the prompt shares nothing."""

    timestamp: float  # milliseconds since the start of the trace
    input_length: int
    output_length: int
    hash_ids: list[int] = msgspec.field(default_factory=list)


class TraceError(ValueError):
    """A trace line that is not a Mooncake trace record."""


def read_trace(path: Path | str, limit: int = 0) -> list[TraceRecord]:
    """The trace's records in file order (the first `limit`, when positive).

    Blank lines are skipped; a line that is not a record raises `TraceError` naming
    the file and the line number.
    """
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[TraceRecord] = []
    with Path(path).open("rb") as f:
        for number, line in enumerate(f, 1):
            if limit > 0 and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                records.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{number}: {exc}") from exc
    return records
