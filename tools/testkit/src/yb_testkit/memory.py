"""What a running `yb up` cluster costs in memory, two ways, for benchmarks.

- Each process's own peak resident set (VmHWM), summed (`peak_rss_figures`): the
  figure `top` would suggest. It counts a page that several processes share once per
  process: the code of libtorch, the Python interpreter, the model's weights that
  every engine maps from the same file.
- The cluster's proportional set size (PSS), summed over its processes at moments the
  caller chooses (`PssPeaks`): a shared page counts once, split among those that share
  it, so the sum is what the cluster takes from the machine. A peak between two
  samples (a prefill's activations) is missed; each process's own peak is kept too.

Both read /proc only; nothing is estimated.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from yb_testkit.fixtures import LocalCluster


def peak_rss_figures(cluster: LocalCluster) -> dict[str, float]:
    """`peak_rss_mb_<process>` of every process of the cluster (the launcher's as
    `yb_up`) and `peak_rss_mb_total`, their sum, MiB."""
    figures = {
        f"peak_rss_mb_{name.replace('-', '_')}": round(mb, 1)
        for name, mb in cluster.peak_rss_mb().items()
    }
    figures["peak_rss_mb_total"] = round(sum(figures.values()), 1)
    return figures


def pss_mb(pid: int) -> float:
    """The proportional set size of one process, MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


class PssPeaks:
    """The highest summed PSS of a cluster's processes at the moments `sample()` is
    called, and each process's highest.

    Sampled where the caller says (between the requests a benchmark times), not on a
    timer: the kernel walks a process's page tables to count its PSS, about 15 ms of CPU
    for a 1 GB engine, which would slow the very requests being timed on a small
    machine. The processes are read from `cluster.json` at every sample, so a restarted
    one is followed under its new pid.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster
        self.peak_total = 0.0
        self.peaks: dict[str, float] = {}

    def sample(self) -> None:
        """Read every process once."""
        pids = dict(self._cluster.pids)
        with contextlib.suppress(RuntimeError):  # no cluster.json: the cluster stopped
            pids.update(self._cluster.info().pids)
        if self._cluster.process is not None:
            pids["yb-up"] = self._cluster.process.pid
        sizes = {name: pss_mb(pid) for name, pid in pids.items()}
        for name, mb in sizes.items():
            self.peaks[name] = max(self.peaks.get(name, 0.0), mb)
        self.peak_total = max(self.peak_total, sum(sizes.values()))

    def figures(self) -> dict[str, float]:
        """The peaks seen, MiB."""
        out = {
            f"peak_pss_mb_{name.replace('-', '_')}": round(mb, 1)
            for name, mb in sorted(self.peaks.items())
        }
        out["peak_pss_mb_total"] = round(self.peak_total, 1)
        return out
