"""The SSD tier: one file per block under a directory, read and written on threads.

A block file is a 4 KiB header followed by the block's bytes (at a page-aligned offset,
so the payload can be read straight into a DRAM slot). The header names the block
(key, size) and carries one xxh3-64 per layer chunk: a read verifies every chunk and
hands the checksums on, so a block fetched from SSD is sent without hashing it again.
Files are written under a temporary name and renamed into place, so a crash leaves
either the whole file or none; a restarted store finds its blocks again (`recover`).

The tier tracks capacity in blocks, orders eviction with its own policy, and never
evicts a block that is pinned (being read) or still being written. All file I/O runs
on the store's I/O threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import xxhash

from yb_core.telemetry import get_logger
from yb_kvstore.eviction import EvictionPolicy, LruPolicy

log = get_logger(__name__)

MAGIC: Final = b"YBKVBLK1"
#: Header: magic, format version, key, block bytes, chunk count; then one u64 per chunk.
_HEADER: Final = struct.Struct("<8sIQQI")
#: The payload starts here (page-aligned).
DATA_OFFSET: Final = 4096
MAX_CHUNKS: Final = (DATA_OFFSET - _HEADER.size) // 8
_VERSION: Final = 1
_SUFFIX: Final = ".blk"
#: Bytes per pwrite/preadv call (large enough to stream, small enough to bound a call).
_IO_CHUNK: Final = 8 << 20


class SsdFull(RuntimeError):
    """No block on SSD may be evicted (all pinned or being written)."""


class BlockCorrupt(OSError):
    """A block file is missing, short, or fails its checksums."""


class State(enum.Enum):
    """Where a block's file stands."""

    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class SsdEntry:
    """One block of the tier.

    `staging` holds the bytes of a block whose file is still being written when the
    block already left DRAM (the store copied it out to free the slot): reads are
    served from it until the file is complete.
    """

    key: int
    nbytes: int
    checksums: tuple[int, ...]
    state: State
    staging: np.ndarray | None = None
    written: asyncio.Future[None] | None = None
    pins: int = 0


def chunk_checksums(data: np.ndarray, chunks: int) -> tuple[int, ...]:
    """xxh3-64 of each of `chunks` equal parts of `data` (the block's layer chunks)."""
    flat = data.reshape(-1).view(np.uint8)
    if chunks <= 0 or flat.nbytes % chunks:
        raise ValueError(f"{flat.nbytes} bytes do not split into {chunks} chunks")
    n = flat.nbytes // chunks
    return tuple(xxhash.xxh3_64_intdigest(flat[i * n : (i + 1) * n].data) for i in range(chunks))


def _header(key: int, nbytes: int, checksums: Sequence[int]) -> bytes:
    head = _HEADER.pack(MAGIC, _VERSION, key, nbytes, len(checksums))
    body = struct.pack(f"<{len(checksums)}Q", *checksums)
    return (head + body).ljust(DATA_OFFSET, b"\0")


def _parse_header(raw: bytes) -> tuple[int, int, tuple[int, ...]] | None:
    if len(raw) < _HEADER.size:
        return None
    magic, version, key, nbytes, count = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != _VERSION or count > MAX_CHUNKS or nbytes <= 0:
        return None
    end = _HEADER.size + 8 * count
    if len(raw) < end:
        return None
    return key, nbytes, tuple(struct.unpack_from(f"<{count}Q", raw, _HEADER.size))


class SsdTier:
    """Block files under `directory`, at most `capacity` of them."""

    def __init__(
        self,
        directory: Path,
        capacity: int,
        executor: Executor,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError("SSD capacity must be positive")
        self.directory = directory
        self.capacity = capacity
        self.policy = policy or LruPolicy()
        self._executor = executor
        self._entries: dict[int, SsdEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[int]:
        """Every block on the tier (written or being written)."""
        return list(self._entries)

    def entry(self, key: int) -> SsdEntry | None:
        """The entry of `key`, if the tier holds it."""
        return self._entries.get(key)

    @property
    def nbytes(self) -> int:
        """Bytes of block payload on the tier."""
        return sum(e.nbytes for e in self._entries.values())

    def path(self, key: int) -> Path:
        """Where the file of `key` lives."""
        return self.directory / f"{key:016x}{_SUFFIX}"

    async def _io(self, fn: object, *args: object) -> object:
        assert callable(fn)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- recovery -------------------------------------------------------------------

    async def recover(self) -> list[int]:
        """Index the block files a previous run left; returns their keys, oldest first.

        Unfinished (temporary) files are removed, files beyond the capacity too
        (oldest first). Payloads are verified when read, not here: a restart reads
        one header per block, not the whole tier.
        """
        found = await self._io(self._scan)
        assert isinstance(found, list)
        keys: list[int] = []
        for key, nbytes, checksums in found:
            self._entries[key] = SsdEntry(key, nbytes, checksums, State.READY)
            self.policy.touch(key)
            keys.append(key)
        return keys

    def _scan(self) -> list[tuple[int, int, tuple[int, ...]]]:
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, int, int, tuple[int, ...]]] = []
        for path in self.directory.iterdir():
            if path.suffix != _SUFFIX:
                if path.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            try:
                with open(path, "rb") as f:
                    parsed = _parse_header(f.read(DATA_OFFSET))
                stat = path.stat()
            except OSError:
                continue
            if (
                parsed is None
                or path.name != f"{parsed[0]:016x}{_SUFFIX}"
                or stat.st_size != DATA_OFFSET + parsed[1]
            ):
                log.warning("ssd_file_ignored", path=str(path))
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            found.append((stat.st_mtime, *parsed))
        found.sort()
        for _mtime, key, _n, _c in found[: max(0, len(found) - self.capacity)]:
            with contextlib.suppress(OSError):
                self.path(key).unlink()
        return [(k, n, c) for _t, k, n, c in found[-self.capacity :]] if found else []

    # --- admission --------------------------------------------------------------------

    def victim(self) -> int | None:
        """The best block to drop to make room, or None if none may go."""
        for key in self.policy.victims():
            entry = self._entries.get(key)
            if entry is not None and entry.state is State.READY and entry.pins == 0:
                return key
        return None

    def admit(
        self,
        key: int,
        nbytes: int,
        checksums: Sequence[int],
        staging: np.ndarray | None = None,
    ) -> list[int]:
        """Make `key` an entry being written; returns the keys dropped to make room.

        The caller then awaits `write()`. Raises SsdFull if the tier is full and
        nothing may be dropped (then nothing was dropped either).
        """
        if key in self._entries:
            raise ValueError(f"block {key:x} is on SSD already")
        dropped: list[int] = []
        if len(self._entries) >= self.capacity:
            victim = self.victim()
            if victim is None:
                raise SsdFull(f"all {self.capacity} SSD blocks are pinned or being written")
            self.drop(victim)
            dropped.append(victim)
        loop = asyncio.get_running_loop()
        self._entries[key] = SsdEntry(
            key, nbytes, tuple(checksums), State.WRITING, staging, loop.create_future()
        )
        self.policy.touch(key)
        return dropped

    async def write(self, key: int, data: np.ndarray) -> None:
        """Write the admitted block `key` from `data` (must not change until this returns).

        On failure the entry is dropped and the OSError raised; the caller decides what
        happens to the block.
        """
        entry = self._entries[key]
        assert entry.state is State.WRITING and entry.written is not None
        header = _header(key, entry.nbytes, entry.checksums)
        try:
            await self._io(self._write_file, self.path(key), header, data)
        except OSError as exc:
            log.warning("ssd_write_failed", key=f"{key:x}", error=str(exc))
            if self._entries.get(key) is entry:
                del self._entries[key]
                self.policy.forget(key)
            entry.written.set_exception(exc)
            entry.written.exception()  # retrieved: waiters re-raise their own copy
            raise
        entry.state = State.READY
        entry.staging = None
        entry.written.set_result(None)

    @staticmethod
    def _write_file(path: Path, header: bytes, data: np.ndarray) -> None:
        tmp = path.with_name(path.name + ".tmp")
        payload = memoryview(data.reshape(-1).view(np.uint8).data).cast("B")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, header, 0)
            done = 0
            while done < len(payload):
                done += os.pwrite(fd, payload[done : done + _IO_CHUNK], DATA_OFFSET + done)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        os.replace(tmp, path)

    # --- reads ------------------------------------------------------------------------

    def pin(self, key: int) -> None:
        """Keep `key` on the tier while it is read."""
        self._entries[key].pins += 1

    def unpin(self, key: int) -> None:
        """Release one pin (no-op if the entry is gone)."""
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    async def read_into(self, key: int, dest: np.ndarray) -> tuple[int, ...]:
        """Read block `key` into `dest` (exactly its size), verifying every chunk.

        Returns the chunk checksums. Pin the entry around the call. Raises
        BlockCorrupt if the file is unreadable or fails its checksums (the entry is
        then dropped), KeyError if the tier does not hold `key`.
        """
        entry = self._entries[key]
        if dest.nbytes != entry.nbytes:
            raise ValueError(f"block {key:x} has {entry.nbytes} bytes, buffer {dest.nbytes}")
        self.policy.touch(key)
        if entry.state is State.WRITING:
            if entry.staging is not None:
                staging = entry.staging
                await self._io(np.copyto, dest.reshape(-1), staging.reshape(-1))
                return entry.checksums
            assert entry.written is not None
            await asyncio.wait([entry.written])
            if entry.written.exception() is not None:
                raise BlockCorrupt(f"block {key:x} could not be written to SSD")
        try:
            ok = await self._io(self._read_file, self.path(key), dest, entry.checksums)
        except OSError as exc:
            ok = False
            log.warning("ssd_read_failed", key=f"{key:x}", error=str(exc))
        if not ok:
            if self._entries.get(key) is entry:
                self.drop(key)
            raise BlockCorrupt(f"block {key:x} on SSD is unreadable or corrupt")
        return entry.checksums

    @staticmethod
    def _read_file(path: Path, dest: np.ndarray, checksums: tuple[int, ...]) -> bool:
        view = memoryview(dest.reshape(-1).view(np.uint8).data).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done : done + _IO_CHUNK]], DATA_OFFSET + done)
                if n <= 0:
                    return False
                done += n
        finally:
            os.close(fd)
        return chunk_checksums(dest, len(checksums)) == checksums if checksums else True

    # --- removal ----------------------------------------------------------------------

    def drop(self, key: int) -> None:
        """Forget `key` now; its file is removed on an I/O thread."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.policy.forget(key)
        self._executor.submit(self._unlink, self.path(key))

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
