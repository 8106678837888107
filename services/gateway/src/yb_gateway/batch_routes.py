"""OpenAI's `/v1/files` and `/v1/batches`, as the official `openai` client calls them.

Files: upload (multipart, `purpose` `batch`), retrieve, content, delete, list.
Batches: create, retrieve, list, cancel. What each stores is `batch_store`'s; the
work is `batches.BatchWorker`'s. Everything is refused that this server does not do,
rather than ignored: another purpose, `expires_after`, a window other than `24h`, an
endpoint other than `/v1/chat/completions` and `/v1/completions`,
`output_expires_after`. An upload over `gateway.batch_max_file_bytes` is a 400
(`file_too_large`), after its body is read to the end (a client still sending would
not see an earlier answer). A file an unfinished batch reads cannot be deleted.

While the gateway has no bus, these routes answer 503 (`batch_store_unavailable`),
as do the generation routes.

The routes are left out of the OpenAPI document (`include_in_schema=False`): their
shapes are OpenAI's, documented in docs/batch.md.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.openapi.spec import SecurityRequirement
from litestar.status_codes import HTTP_200_OK
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header

from yb_core.config import YbConfig
from yb_gateway.batch_lines import ENDPOINTS
from yb_gateway.batch_store import (
    JS_ERRORS,
    TERMINAL,
    BatchObject,
    BatchStore,
    FileObject,
)
from yb_gateway.errors import ApiError, invalid_request, unavailable
from yb_gateway.runner import decode_body

#: A batch's window: the only one OpenAI offers, and the only one served.
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600
#: What a multipart body may carry beside the file (boundaries, headers, `purpose`).
_FORM_SLACK_BYTES = 64 * 1024
_FIELD_BYTES = 1024
_METADATA_KEYS = 16
#: How far past the limit an upload is still read (to answer it, not to keep it).
_DRAIN_FACTOR = 4

T = TypeVar("T")
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class FileDeleted(msgspec.Struct, kw_only=True):
    """What deleting a file answers."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileList(msgspec.Struct, kw_only=True):
    """A page of files."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchList(msgspec.Struct, kw_only=True):
    """A page of batches, newest first."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class BatchApi:
    """What the routes do, for one gateway: its store (None while the bus is down)
    and its worker, woken when a batch is created or cancelled here."""

    def __init__(
        self,
        cfg: YbConfig,
        stores: Callable[[], Awaitable[BatchStore | None]],
        wake: Callable[[], None],
    ) -> None:
        self._cfg = cfg
        self._stores = stores
        self._wake = wake

    async def _store(self) -> BatchStore:
        try:
            store = await self._stores()
        except JS_ERRORS as exc:
            raise _store_down(repr(exc)) from exc
        if store is None:
            raise _store_down("the event bus (NATS) is not connected")
        return store

    # --- files ----------------------------------------------------------------------

    async def upload(self, request: Request[Any, Any, Any]) -> FileObject:
        """Store an uploaded batch input file."""
        limit = self._cfg.gateway.batch_max_file_bytes
        form = await _read_form(request, limit)
        if form.too_large:
            raise invalid_request(
                f"The file has more than {limit} bytes, this server's limit "
                "(gateway.batch_max_file_bytes).",
                param="file",
                code="file_too_large",
            )
        unknown = sorted(set(form.fields) - {"purpose"})
        if unknown:
            name = unknown[0]
            if name.startswith("expires_after"):
                raise invalid_request(
                    "Unsupported parameter: `expires_after`; files are kept until deleted.",
                    param="expires_after",
                    code="unsupported_parameter",
                )
            raise invalid_request(
                f"Unknown parameter: `{name}`.", param=name, code="unknown_parameter"
            )
        purpose = form.fields.get("purpose")
        if purpose is None:
            raise invalid_request("Missing `purpose`.", param="purpose")
        if purpose != "batch":
            raise invalid_request(
                f"Unsupported purpose {purpose!r}: this server stores files for the Batch API "
                "only (`purpose: batch`).",
                param="purpose",
                code="unsupported_value",
            )
        if form.filename is None or form.data is None:
            raise invalid_request("Missing `file` (a multipart file part).", param="file")
        data = bytes(form.data)
        filename = form.filename
        record = FileObject(
            id=f"file-{_new_id()}",
            bytes=len(data),
            created_at=int(time.time()),
            filename=filename,
            purpose="batch",
        )
        store = await self._store()
        await _call(store.put_file(record, data))
        return record

    async def retrieve_file(self, file_id: str) -> FileObject:
        """A file's record."""
        _check_id("File", file_id, "file_id")
        store = await self._store()
        record = await _call(store.get_file(file_id))
        if record is None:
            raise _not_found("File", file_id, "file_id")
        return record

    async def file_content(self, file_id: str) -> bytes:
        """A file's bytes."""
        _check_id("File", file_id, "file_id")
        store = await self._store()
        data = await _call(store.file_bytes(file_id))
        if data is None or await _call(store.get_file(file_id)) is None:
            raise _not_found("File", file_id, "file_id")
        return data

    async def delete_file(self, file_id: str) -> FileDeleted:
        """Delete a file, unless an unfinished batch reads it."""
        _check_id("File", file_id, "file_id")
        store = await self._store()
        for batch in await _call(store.list_batches()):
            if batch.input_file_id == file_id and batch.status not in TERMINAL:
                raise invalid_request(
                    f"The file is the input of batch {batch.id}, which is {batch.status}; "
                    "cancel the batch or wait for it to end.",
                    param="file_id",
                    code="file_in_use",
                )
        if not await _call(store.delete_file(file_id)):
            raise _not_found("File", file_id, "file_id")
        return FileDeleted(id=file_id)

    async def list_files(
        self, after: str | None, limit: int, order: str, purpose: str | None
    ) -> FileList:
        """A page of files by creation (`order` `desc`, the newest first, or `asc`)."""
        store = await self._store()
        files = [f for f in await _call(store.list_files()) if purpose in (None, f.purpose)]
        files.sort(key=lambda f: (f.created_at, f.id), reverse=order == "desc")
        page, more = _page(files, after, limit)
        return FileList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=more,
        )

    # --- batches --------------------------------------------------------------------

    async def create_batch(self, raw: bytes) -> BatchObject:
        """A new batch, `validating` until a worker takes it."""
        body = decode_body(raw, BatchCreateRequest)
        if body.completion_window != COMPLETION_WINDOW:
            raise invalid_request(
                f"Unsupported completion_window {body.completion_window!r}: only "
                f"{COMPLETION_WINDOW!r} is served.",
                param="completion_window",
                code="unsupported_value",
            )
        if body.endpoint not in ENDPOINTS:
            raise invalid_request(
                f"Unsupported endpoint {body.endpoint!r}: batches here run "
                f"{' and '.join(ENDPOINTS)}.",
                param="endpoint",
                code="unsupported_value",
            )
        if body.output_expires_after is not None:
            raise invalid_request(
                "Unsupported parameter: `output_expires_after`; output files are kept "
                "until deleted.",
                param="output_expires_after",
                code="unsupported_parameter",
            )
        _check_metadata(body.metadata)
        _check_id("File", body.input_file_id, "input_file_id")
        store = await self._store()
        source = await _call(store.get_file(body.input_file_id))
        if source is None:
            raise _not_found("File", body.input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise invalid_request(
                f"The file {source.id} has purpose {source.purpose!r}; a batch reads a file "
                "uploaded with purpose `batch`.",
                param="input_file_id",
            )
        now = int(time.time())
        batch = BatchObject(
            id=f"batch_{_new_id()}",
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + WINDOW_S,
            metadata=body.metadata,
            model=self._cfg.model.name,
        )
        await _call(store.create_batch(batch))
        self._wake()
        return batch

    async def retrieve_batch(self, batch_id: str) -> BatchObject:
        """A batch as it stands."""
        _check_id("Batch", batch_id, "batch_id")
        store = await self._store()
        batch = await _call(store.get_batch(batch_id))
        if batch is None:
            raise _not_found("Batch", batch_id, "batch_id")
        return batch

    async def list_batches(self, after: str | None, limit: int) -> BatchList:
        """A page of batches, the newest first."""
        store = await self._store()
        batches = sorted(await _call(store.list_batches()), key=lambda b: b.id, reverse=True)
        page, more = _page(batches, after, limit)
        return BatchList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=more,
        )

    async def cancel_batch(self, batch_id: str) -> BatchObject:
        """Ask for a batch to stop: `cancelling` until its worker has written what
        was done, then `cancelled`. Cancelling one that is cancelled already is no
        change; one that is done otherwise (or finalizing) is a 400."""
        _check_id("Batch", batch_id, "batch_id")
        store = await self._store()
        refused: list[str] = []

        def cancelling(batch: BatchObject) -> BatchObject | None:
            refused.clear()
            if batch.status in ("cancelling", "cancelled"):
                return None
            if batch.status not in ("validating", "in_progress"):
                refused.append(batch.status)
                return None
            return msgspec.structs.replace(
                batch, status="cancelling", cancelling_at=int(time.time())
            )

        batch = await _call(store.update_batch(batch_id, cancelling))
        if batch is None:
            raise _not_found("Batch", batch_id, "batch_id")
        if refused:
            raise invalid_request(
                f"Batch {batch_id} is {refused[0]}: it cannot be cancelled.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        self._wake()
        return batch


class BatchView(Protocol):
    """What the routes read of their gateway, each time one is called."""

    @property
    def batches(self) -> BatchApi:
        """The Batch API of the gateway."""
        ...


def batch_handlers(
    gw: BatchView, cfg: YbConfig, security: list[SecurityRequirement] | None
) -> list[HTTPRouteHandler]:
    """The route handlers of `/v1/files` and `/v1/batches`."""
    common: dict[str, Any] = {"tags": ["openai"], "security": security, "include_in_schema": False}

    @post(
        "/v1/files",
        status_code=HTTP_200_OK,
        # The handler counts the bytes itself, so that a file over the limit is a 400
        # in OpenAI's format rather than litestar's 413.
        request_max_body_size=None,
        **common,
    )
    async def upload_file(request: Request[Any, Any, Any]) -> FileObject:
        """Upload a batch input file (multipart: `file`, `purpose`)."""
        return await gw.batches.upload(request)

    @get("/v1/files", **common)
    async def list_files(request: Request[Any, Any, Any]) -> FileList:
        """The stored files (`after`, `limit`, `order`, `purpose`)."""
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_request(f"`order` is {order!r}; `asc` or `desc`.", param="order")
        return await gw.batches.list_files(
            query.get("after"),
            _limit(query.get("limit"), 10_000, 10_000),
            order,
            query.get("purpose"),
        )

    @get("/v1/files/{file_id:str}", **common)
    async def retrieve_file(request: Request[Any, Any, Any]) -> FileObject:
        """One file's record."""
        return await gw.batches.retrieve_file(request.path_params["file_id"])

    @get("/v1/files/{file_id:str}/content", **common)
    async def file_content(request: Request[Any, Any, Any]) -> Response[bytes]:
        """One file's bytes."""
        data = await gw.batches.file_content(request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream")

    @delete("/v1/files/{file_id:str}", status_code=HTTP_200_OK, **common)
    async def delete_file(request: Request[Any, Any, Any]) -> FileDeleted:
        """Delete a file."""
        return await gw.batches.delete_file(request.path_params["file_id"])

    @post(
        "/v1/batches",
        status_code=HTTP_200_OK,
        request_max_body_size=cfg.gateway.max_body_bytes,
        **common,
    )
    async def create_batch(request: Request[Any, Any, Any]) -> BatchObject:
        """Create a batch from an uploaded file."""
        return await gw.batches.create_batch(await request.body())

    @get("/v1/batches", **common)
    async def list_batches(request: Request[Any, Any, Any]) -> BatchList:
        """The batches, the newest first (`after`, `limit`)."""
        query = request.query_params
        return await gw.batches.list_batches(
            query.get("after"), _limit(query.get("limit"), 20, 100)
        )

    @get("/v1/batches/{batch_id:str}", **common)
    async def retrieve_batch(request: Request[Any, Any, Any]) -> BatchObject:
        """One batch."""
        return await gw.batches.retrieve_batch(request.path_params["batch_id"])

    @post("/v1/batches/{batch_id:str}/cancel", status_code=HTTP_200_OK, **common)
    async def cancel_batch(request: Request[Any, Any, Any]) -> BatchObject:
        """Cancel a batch."""
        return await gw.batches.cancel_batch(request.path_params["batch_id"])

    return [
        upload_file,
        list_files,
        retrieve_file,
        file_content,
        delete_file,
        create_batch,
        list_batches,
        retrieve_batch,
        cancel_batch,
    ]


# --- helpers --------------------------------------------------------------------------


@dataclass(slots=True)
class _Form:
    """A multipart body read: its text fields, and its file part's name and bytes
    (`too_large`: the file passed the limit, its bytes were not kept)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    data: bytearray | None = None
    too_large: bool = False


async def _read_form(request: Request[Any, Any, Any], limit: int) -> _Form:
    """Read a multipart upload, keeping at most `limit` bytes of its file. A larger
    file is read on (not kept) so that the client, still sending, gets the answer,
    up to `_DRAIN_FACTOR` times the limit."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise invalid_request("A file is uploaded as multipart/form-data (`file`, `purpose`).")
    form = _Form()
    total = 0
    segment: MultipartSegment | None = None
    value = bytearray()
    try:
        with PushMultipartParser(boundary, max_segment_count=16) as parser:
            async for chunk in request.stream():
                total += len(chunk)
                if total > _DRAIN_FACTOR * limit + _FORM_SLACK_BYTES:
                    form.too_large = True
                    return form
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        segment, value = event, bytearray()
                        if segment.name == "file" and segment.filename is not None:
                            form.filename, form.data = segment.filename, bytearray()
                    elif event:
                        if segment is not None and segment.name == "file":
                            if form.data is None or form.too_large:
                                continue
                            if len(form.data) + len(event) > limit:
                                form.too_large, form.data = True, None
                            else:
                                form.data += event
                        elif len(value) + len(event) <= _FIELD_BYTES:
                            value += event
                    elif segment is not None:
                        if segment.name != "file":
                            charset = segment.charset or "utf-8"
                            form.fields[segment.name] = value.decode(charset, "replace")
                        segment = None
    except MultipartError as exc:
        raise invalid_request(f"Invalid multipart body: {exc}") from exc
    return form


def _page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
    """The `limit` items after the one whose id is `after` (from the first without)."""
    start = 0
    if after is not None:
        ids = [item.id for item in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    page = items[start : start + limit]
    return page, start + limit < len(items)


def _limit(raw: str | None, default: int, most: int) -> int:
    """The `limit` query parameter: 1 to `most`, `default` when absent."""
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid_request(f"`limit` is {raw!r}; it must be 1 to {most}.", param="limit")
    return int(raw)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _METADATA_KEYS:
        raise invalid_request(
            f"`metadata` has {len(metadata)} keys; at most {_METADATA_KEYS}.", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise invalid_request(
                "`metadata` keys are at most 64 characters, values at most 512.",
                param=f"metadata.{key[:64]}",
            )


def _new_id() -> str:
    # Time first, so that ids sort as they were made (lists are ordered by id).
    return f"{time.time_ns():016x}{secrets.token_hex(4)}"


def _check_id(kind: str, object_id: str, param: str) -> None:
    """404 for an id that no file or batch can have (ids are letters, digits, `-`
    and `_`), before it reaches JetStream, whose keys it may not be."""
    if not _ID.fullmatch(object_id):
        raise _not_found(kind, object_id, param)


def _not_found(kind: str, object_id: str, param: str) -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param=param, code="not_found")


def _store_down(why: str) -> ApiError:
    return unavailable(
        f"Files and batches are kept in JetStream, which cannot be reached now ({why}).",
        code="batch_store_unavailable",
    )


async def _call(work: Awaitable[T]) -> T:
    """`work`'s result; a 503 if JetStream does not answer."""
    try:
        return await work
    except JS_ERRORS as exc:
        raise _store_down(repr(exc)) from exc
