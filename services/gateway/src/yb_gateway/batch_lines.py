"""A batch's input file read line by line, and its output and error files written.

The input is JSONL, one request a line, in OpenAI's format:
`{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
Reading it is a pure function of the file, the batch's endpoint and the served
model, so a gateway that resumes a batch finds the same lines at the same indices
(blank lines are skipped and not counted). A line is refused, on its own, when:

- it is not a JSON object with exactly those four fields (`invalid_json_line`,
  `invalid_line`), or its method is not POST (`invalid_method`);
- its `url` is not the batch's endpoint (`invalid_url`);
- its body names a model this cluster does not serve (`model_not_found`) or asks for
  a stream (`stream_unsupported`: a batch answer is whole);
- its `custom_id` was used by an earlier line (`duplicate_custom_id`).

A refused line goes to the error file and never fails the batch. Everything else in
the body is checked when the line runs, exactly as the HTTP endpoint checks it, and a
400 then is the line's response. Only a file that holds no line, or more than
`gateway.batch_max_lines`, fails the whole batch.

Output and error files are JSONL in input order, each line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`:
lines answered 200 go to the output file; lines refused, answered with an error
status, or never run (the batch was cancelled or expired first) to the error file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from yb_gateway.batch_store import BatchError, LineError, LineResult

#: The endpoints a batch may name, and how the request path calls each.
ENDPOINTS: dict[str, str] = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
}
_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A line that will run: its position, its id, and its body as JSON."""

    index: int
    custom_id: str
    body: bytes


@dataclass(frozen=True, slots=True)
class ParsedInput:
    """An input file read: the lines to run and those refused, by index."""

    lines: list[BatchLine]
    refused: list[LineResult]

    @property
    def total(self) -> int:
        """Every line of the file (but blank ones)."""
        return len(self.lines) + len(self.refused)


def line_id(batch_id: str, index: int) -> str:
    """The id of a line's entry in the output or error file (stable across runs)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def parse_input(
    data: bytes, batch_id: str, endpoint: str, model: str, max_lines: int
) -> ParsedInput | BatchError:
    """Read a batch's input file; a `BatchError` when the whole file is refused."""
    raw_lines = [(n, line) for n, line in enumerate(data.splitlines(), start=1) if line.strip()]
    if not raw_lines:
        return BatchError(code="empty_file", message="The input file has no request lines.")
    if len(raw_lines) > max_lines:
        return BatchError(
            code="too_many_lines",
            message=f"The input file has {len(raw_lines)} request lines; at most {max_lines} "
            "are served in one batch (gateway.batch_max_lines).",
        )
    lines: list[BatchLine] = []
    refused: list[LineResult] = []
    seen: set[str] = set()
    for index, (number, raw) in enumerate(raw_lines):
        custom_id, problem, body = _check(raw, number, endpoint, model)
        if problem is None and custom_id in seen:
            problem = LineError(
                code="duplicate_custom_id",
                message=f"Line {number}: custom_id {custom_id!r} is used by an earlier line; "
                "each line's custom_id must be unique in the batch.",
            )
        if custom_id is not None:
            seen.add(custom_id)
        if problem is not None:
            refused.append(
                LineResult(
                    index=index, id=line_id(batch_id, index), custom_id=custom_id, error=problem
                )
            )
        else:
            assert custom_id is not None
            lines.append(BatchLine(index=index, custom_id=custom_id, body=body))
    return ParsedInput(lines=lines, refused=refused)


def _check(
    raw: bytes, number: int, endpoint: str, model: str
) -> tuple[str | None, LineError | None, bytes]:
    """A line's custom_id (when it has one), why it is refused (None: it runs), and
    its body as JSON."""
    try:
        line = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return None, LineError(code="invalid_json_line", message=f"Line {number}: {exc}"), b""
    if not isinstance(line, dict):
        return None, _invalid(number, "a line must be a JSON object"), b""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _invalid(number, "`custom_id` must be a non-empty string"), b""
    unknown = sorted(set(line) - _LINE_FIELDS)
    missing = sorted(_LINE_FIELDS - set(line))
    if unknown or missing:
        what = [
            f"unknown field(s) {unknown}" if unknown else "",
            f"missing {missing}" if missing else "",
        ]
        return custom_id, _invalid(number, "; ".join(w for w in what if w)), b""
    if line["method"] != "POST":
        message = f"Line {number}: method {line['method']!r}; batch lines are POST requests."
        return custom_id, LineError(code="invalid_method", message=message), b""
    url = line["url"]
    if url != endpoint:
        served = (
            f"this batch's endpoint is {endpoint}"
            if url in ENDPOINTS
            else (f"this server runs batches of {', '.join(ENDPOINTS)}")
        )
        message = f"Line {number}: url {url!r} is not served here; {served}."
        return custom_id, LineError(code="invalid_url", message=message), b""
    body: Any = line["body"]
    if not isinstance(body, dict):
        return custom_id, _invalid(number, "`body` must be a JSON object"), b""
    if body.get("model") != model:
        message = (
            f"Line {number}: the model `{body.get('model')}` does not exist; this server "
            f"serves `{model}`."
        )
        return custom_id, LineError(code="model_not_found", message=message), b""
    if body.get("stream"):
        message = f"Line {number}: `stream: true`; a batch line's answer is whole, not streamed."
        return custom_id, LineError(code="stream_unsupported", message=message), b""
    return custom_id, None, msgspec.json.encode(body)


def _invalid(number: int, why: str) -> LineError:
    return LineError(code="invalid_line", message=f"Line {number}: {why}.")


class _Response(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class _OutputLine(msgspec.Struct):
    id: str
    custom_id: str | None
    response: _Response | None
    error: LineError | None


_encode = msgspec.json.Encoder().encode


def render_results(results: Iterable[LineResult]) -> tuple[bytes, bytes]:
    """The output file and the error file of a batch (JSONL, in the order given)."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for result in results:
        response = None
        if result.status_code is not None:
            response = _Response(
                status_code=result.status_code,
                request_id=result.request_id or "",
                body=result.body,
            )
        line = _encode(_OutputLine(result.id, result.custom_id, response, result.error))
        (output if result.ok else errors).append(line + b"\n")
    return b"".join(output), b"".join(errors)
