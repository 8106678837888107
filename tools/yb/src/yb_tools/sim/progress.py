"""A one-line progress bar on stderr (no dependency: the simulator's only output that
is not data)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`label [#####.....]  45%  1797/3993  1.2s`, redrawn in place, throttled."""

    def __init__(
        self, label: str, *, stream: TextIO | None = None, enabled: bool = True, width: int = 30
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.started = time.perf_counter()
        self._last = 0.0
        # Redrawn ten times a second on a terminal, once a second into a file or pipe.
        isatty = getattr(self.stream, "isatty", None)
        self.period = 0.1 if isatty is not None and isatty() else 1.0

    def __call__(self, done: int, total: int) -> None:
        """Show `done` of `total` (throttled, always at the end)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < self.period:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r{self.label:<22} [{bar}] {frac:4.0%}  {done}/{total}  {now - self.started:.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
