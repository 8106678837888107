"""A memory-limited cgroup for a test's processes (development only).

`MemoryCgroup.create(limit_bytes)` makes a fresh cgroup under the memory controller,
with a hard limit on the memory its processes may take, wherever this machine mounts
it: cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`). A process joins it with
`join(pid)` (a child joins itself before it execs, so everything it starts is inside);
`peak_bytes()` and `oom_kills()` say what the processes took and whether the kernel
killed one for it; `remove()` deletes the cgroup once its processes are gone.

Creating one needs root and a writable controller: `MemoryCgroup.create` raises
`CgroupUnavailable` saying why not, for a test to skip on.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be created here (the message says why)."""


@dataclass(frozen=True)
class MemoryCgroup:
    """One cgroup with a memory limit (see the module doc)."""

    path: Path
    version: int

    @classmethod
    def create(cls, limit_bytes: int, name: str = "") -> MemoryCgroup:
        """A new cgroup whose processes may take at most `limit_bytes` of memory."""
        name = name or f"yb-test-{os.getpid()}-{time.monotonic_ns()}"
        for version, parent, limit_file in (
            (2, CGROUP_ROOT, "memory.max"),
            (2, CGROUP_ROOT / "unified", "memory.max"),
            (1, CGROUP_ROOT / "memory", "memory.limit_in_bytes"),
        ):
            if version == 2 and "memory" not in _read(parent / "cgroup.subtree_control"):
                continue
            if version == 1 and not (parent / limit_file).exists():
                continue
            path = parent / name
            try:
                path.mkdir()
            except OSError as exc:
                raise CgroupUnavailable(f"cannot create {path}: {exc.strerror}") from exc
            try:
                (path / limit_file).write_text(f"{limit_bytes}\n")
            except OSError as exc:
                path.rmdir()
                raise CgroupUnavailable(f"cannot limit {path}: {exc.strerror}") from exc
            return cls(path, version)
        raise CgroupUnavailable(
            f"no memory controller to create a cgroup in under {CGROUP_ROOT} (neither "
            "cgroup v2 with memory delegated nor v1's memory hierarchy)"
        )

    def join(self, pid: int = 0) -> None:
        """Move process `pid` (0: the calling one) into the cgroup."""
        (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")

    def peak_bytes(self) -> int:
        """The most memory the cgroup's processes held at once (their page cache
        included, which the kernel reclaims before it kills anything)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int(_read(self.path / name) or 0)

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for want of memory."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(self.path / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self, timeout_s: float = 30.0) -> None:
        """Delete the cgroup once its processes have gone (they must be stopping)."""
        deadline = time.monotonic() + timeout_s
        while _read(self.path / "cgroup.procs").strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
