"""Where the Batch API keeps its files and batches: JetStream, never the gateway's disk.

Four buckets, named after `gateway.batch_bucket` (`<b>` below), replicated like the
event stream (`nats.replicas`):

- object store `<b>_files`: the bytes of every file (uploads, outputs, error files),
  named by file id;
- KV `<b>`: `file.<id>` holds a file's `FileObject`, `batch.<id>` a batch's
  `BatchObject`, each as the API shows it. A batch changes only by compare-and-set on
  the revision read (`update_batch`), so the worker's progress and a client's cancel
  never overwrite each other;
- KV `<b>_lines`: `<batch id>.<line index>` holds one line's `LineResult`, written
  with `create`, which succeeds only while the key is absent: a line's result is
  recorded once, whoever ran it, and never replaced. Once the batch's final state is
  stored (its files hold the results), they are purged;
- KV `<b>_leases` (its entries expire after `gateway.batch_lease_ttl_s`):
  `<batch id>` names the gateway that works on the batch (`BatchLease`).

A file's bytes are stored before its record, so a listed file can always be read.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import AsyncGenerator, Callable
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from yb_core.telemetry import get_logger

log = get_logger(__name__)

#: Compare-and-set attempts before an update gives up (each one lost to a writer
#: that changed the record in between).
CAS_ATTEMPTS = 32

#: The header of a KV delete or purge marker (nats-py's `kv.KV_OP`).
KV_OPERATION = "KV-Operation"

#: How long the server keeps a reading consumer that lost its subscriber (`_replay`).
CONSUMER_IDLE_S = 5.0

#: What a failed JetStream call raises.
JS_ERRORS = (nats.errors.Error, OSError, TimeoutError)

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
#: A batch in one of these is done: nothing runs for it any more.
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


class FileObject(msgspec.Struct, kw_only=True):
    """OpenAI's `File` object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(msgspec.Struct, kw_only=True):
    """How many of a batch's lines there are, and how many ended each way."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    """Why a whole batch failed (a line's own error goes to the error file)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    """A batch's `errors` list."""

    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(msgspec.Struct, kw_only=True):
    """OpenAI's `Batch` object, as stored and as served."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class LineError(msgspec.Struct, kw_only=True):
    """A line that got no response: refused as written, or not run in time."""

    code: str
    message: str


class LineResult(msgspec.Struct, kw_only=True):
    """One line's outcome, recorded once. `status_code` is None for a line refused
    before it ran (`error` says why); otherwise `body` is the answer's JSON (the
    completion, or an OpenAI error object)."""

    index: int
    id: str
    custom_id: str | None
    status_code: int | None = None
    request_id: str | None = None
    # JSON `null` for a line refused before it ran (msgspec reads a `Raw` whole,
    # whatever JSON it holds, but not as one side of a union).
    body: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    error: LineError | None = None

    @property
    def ok(self) -> bool:
        """Whether the line was answered 200 (it goes to the output file)."""
        return self.status_code == 200


_encode = msgspec.json.Encoder().encode
_file_decoder = msgspec.json.Decoder(FileObject)
_batch_decoder = msgspec.json.Decoder(BatchObject)
_line_decoder = msgspec.json.Decoder(LineResult)


class BatchStore:
    """The Batch API's buckets on one JetStream connection (see the module docstring).

    Every method raises what nats-py raises when JetStream cannot answer (`JS_ERRORS`);
    the HTTP routes turn that into a 503 and the worker retries later.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        meta: KeyValue,
        lines: KeyValue,
        leases: KeyValue,
        files: ObjectStore,
        timeout_s: float,
    ) -> None:
        self._js = js
        self._meta_bucket = bucket
        self._lines_bucket = f"{bucket}_lines"
        self._files_bucket = f"{bucket}_files"
        self._meta = meta
        self._lines = lines
        self._leases = leases
        self._files = files
        self._timeout_s = timeout_s

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        *,
        replicas: int,
        lease_ttl_s: float,
        timeout_s: float,
    ) -> BatchStore:
        """Create the buckets, or bind to them where they exist already."""
        meta = await _key_value(js, bucket, replicas=replicas)
        lines = await _key_value(js, f"{bucket}_lines", replicas=replicas)
        leases = await _key_value(js, f"{bucket}_leases", replicas=replicas, ttl=lease_ttl_s)
        try:
            files = await js.create_object_store(bucket=f"{bucket}_files", replicas=replicas)
        except nats.js.errors.BadRequestError:
            files = await js.object_store(f"{bucket}_files")
        return cls(js, bucket, meta, lines, leases, files, timeout_s)

    # --- files ----------------------------------------------------------------------

    async def put_file(self, record: FileObject, data: bytes) -> None:
        """Store a file's bytes, then its record (replacing both if they exist)."""
        await self._files.put(record.id, data)
        await self._meta.put(f"file.{record.id}", _encode(record))

    async def get_file(self, file_id: str) -> FileObject | None:
        """A file's record; None if there is none."""
        raw = await self._get(self._meta, f"file.{file_id}")
        return None if raw is None else _file_decoder.decode(raw[0])

    async def file_bytes(self, file_id: str) -> bytes | None:
        """A file's bytes; None if they are gone.

        The chunks are read here, not through `ObjectStore.get`: that one waits for
        each chunk without a deadline, so a stalled delivery (its ordered consumer
        failing to recreate itself) would hold its caller forever. Here every chunk
        comes within the request timeout or the read raises `TimeoutError`.
        """
        try:
            info = await self._files.get_info(file_id)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None
        if not info.size:
            return b""
        digest = hashlib.sha256()
        out = bytearray()
        chunks = f"$O.{self._files_bucket}.C.{info.nuid}"
        async with contextlib.aclosing(
            self._replay(chunks, f"OBJ_{self._files_bucket}", api.DeliverPolicy.ALL)
        ) as messages:
            async for msg in messages:
                out += msg.data
                digest.update(msg.data)
        # The digest is recorded as "SHA-256=<url-safe base64>".
        recorded = (info.digest or "").partition("=")[2].rstrip("=")
        read = base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")
        if len(out) != info.size or read != recorded:
            raise nats.js.errors.DigestMismatchError
        return bytes(out)

    async def delete_file(self, file_id: str) -> bool:
        """Delete a file's record and bytes; False if there was no such file."""
        if await self.get_file(file_id) is None:
            return False
        await self._meta.delete(f"file.{file_id}")
        with contextlib.suppress(
            nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError
        ):
            await self._files.delete(file_id)
        return True

    async def list_files(self) -> list[FileObject]:
        """Every file's record, in no particular order."""
        return [_file_decoder.decode(v) for v in await self._values(self._meta_bucket, "file.*")]

    # --- batches --------------------------------------------------------------------

    async def create_batch(self, batch: BatchObject) -> None:
        """Store a new batch (its id is new: `create` refuses one that exists)."""
        await self._meta.create(f"batch.{batch.id}", _encode(batch))

    async def get_batch(self, batch_id: str) -> BatchObject | None:
        """A batch as stored now; None if there is none."""
        raw = await self._get(self._meta, f"batch.{batch_id}")
        return None if raw is None else _batch_decoder.decode(raw[0])

    async def update_batch(
        self, batch_id: str, change: Callable[[BatchObject], BatchObject | None]
    ) -> BatchObject | None:
        """Apply `change` to the batch as stored and write the result if the batch
        did not change meanwhile, else read it again and retry. `change` returns
        None to leave the batch as it is. Returns the batch as stored afterwards;
        None if there is no such batch."""
        key = f"batch.{batch_id}"
        for _ in range(CAS_ATTEMPTS):
            raw = await self._get(self._meta, key)
            if raw is None:
                return None
            current = _batch_decoder.decode(raw[0])
            changed = change(current)
            if changed is None:
                return current
            try:
                await self._meta.update(key, _encode(changed), last=raw[1])
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            return changed
        raise nats.errors.Error(f"batch {batch_id}: {CAS_ATTEMPTS} updates lost to others")

    async def list_batches(self) -> list[BatchObject]:
        """Every batch, in no particular order."""
        return [_batch_decoder.decode(v) for v in await self._values(self._meta_bucket, "batch.*")]

    # --- lines ----------------------------------------------------------------------

    async def record_line(self, batch_id: str, result: LineResult) -> bool:
        """Record a line's result unless one is recorded already; True if this one
        was. A result too large for a NATS message is recorded as an error instead."""
        key = f"{batch_id}.{result.index}"
        try:
            try:
                await self._lines.create(key, _encode(result))
            except nats.errors.MaxPayloadError:
                too_large = msgspec.structs.replace(
                    result,
                    body=msgspec.Raw(b"null"),
                    status_code=None,
                    error=LineError(
                        code="response_too_large",
                        message="The answer is larger than a NATS message may be.",
                    ),
                )
                await self._lines.create(key, _encode(too_large))
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def line_results(self, batch_id: str) -> dict[int, LineResult]:
        """Every line result recorded for a batch, by line index."""
        results = [
            _line_decoder.decode(v) for v in await self._values(self._lines_bucket, f"{batch_id}.*")
        ]
        return {r.index: r for r in results}

    async def forget_lines(self, batch_id: str) -> None:
        """Drop a finished batch's line results (its output and error files hold
        them now): one purge of their subjects."""
        bucket = self._lines_bucket
        await self._js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{batch_id}.>")

    # --- leases ---------------------------------------------------------------------

    async def acquire_lease(self, batch_id: str, holder: str) -> int:
        """Take a batch's lease if nobody holds it: its revision, or 0 if taken."""
        try:
            return int(await self._leases.create(batch_id, holder.encode()))
        except nats.js.errors.KeyWrongLastSequenceError:
            return 0

    async def renew_lease(self, batch_id: str, holder: str, revision: int) -> int:
        """Extend a held lease: its new revision. Raises `KeyWrongLastSequenceError`
        if it was lost (it expired and someone else took it, or nobody holds it).

        A renewal whose answer was lost (a timeout) may still have been stored: the
        lease is then at a revision its holder never heard of, and is still its own
        when the entry names it (`holder` is unique to one gateway process)."""
        try:
            return int(await self._leases.update(batch_id, holder.encode(), last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            current = await self._get(self._leases, batch_id)
            if current is None or current[0] != holder.encode():
                raise
            return int(await self._leases.update(batch_id, holder.encode(), last=current[1]))

    async def release_lease(self, batch_id: str, revision: int) -> None:
        """Give a lease up (if still ours), so another gateway may take it at once."""
        with contextlib.suppress(*JS_ERRORS):
            await self._leases.delete(batch_id, last=revision)

    # --- helpers --------------------------------------------------------------------

    async def _get(self, kv: KeyValue, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b"", entry.revision or 0

    async def _values(self, bucket: str, pattern: str) -> list[bytes]:
        """The current value of every key of KV `bucket` that matches `pattern`.

        Not through `KeyValue.watch`: its "no more values" marker can come before
        the values (when the server has sent them all before the watcher asked how
        many were pending), and a read would then find nothing.
        """
        values: list[bytes] = []
        async with contextlib.aclosing(
            self._replay(
                f"$KV.{bucket}.{pattern}", f"KV_{bucket}", api.DeliverPolicy.LAST_PER_SUBJECT
            )
        ) as messages:
            async for msg in messages:
                if msg.data and (msg.headers or {}).get(KV_OPERATION) is None:
                    values.append(msg.data)
        return values

    async def _replay(
        self, subject: str, stream: str, policy: api.DeliverPolicy
    ) -> AsyncGenerator[Msg, None]:
        """The messages of `stream` on `subject` as a consumer delivering by `policy`
        finds them now, each within the request timeout (else `TimeoutError`).

        The consumer's own count says when they are all read: those delivered plus
        those pending when it is asked, each message saying how many follow it.

        The consumer is deleted once read. The server keeps an ephemeral consumer
        until it has had no subscriber for its inactive threshold, and refuses a new
        one past its limit (1,000 on a stream in nats-server 2.15): reads left to
        expire would pile up there, and a burst of them (a client listing batches in
        a loop) would make every read fail. The threshold is the backstop for one the
        ordered consumer re-created under another name.
        """
        config = api.ConsumerConfig(deliver_policy=policy, inactive_threshold=CONSUMER_IDLE_S)
        sub = await self._js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            config=config,
            pending_msgs_limit=1_000_000,
        )
        name: str | None = None
        try:
            info = await sub.consumer_info()
            name = info.name
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return
            while True:
                msg = await sub.next_msg(timeout=self._timeout_s)
                yield msg
                if msg.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(*JS_ERRORS):
                await sub.unsubscribe()
            if name is not None:
                with contextlib.suppress(*JS_ERRORS):
                    await self._js.delete_consumer(stream, name)


async def _key_value(
    js: JetStreamContext, bucket: str, *, replicas: int, ttl: float | None = None
) -> KeyValue:
    try:
        return await js.create_key_value(bucket=bucket, history=1, replicas=replicas, ttl=ttl)
    except nats.js.errors.BadRequestError:
        # Exists with other settings (another ttl, say): use it as it is.
        return await js.key_value(bucket)
