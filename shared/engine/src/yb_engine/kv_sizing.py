"""How many KV pages an engine allocates: what it can use, within its budget.

Every function here is arithmetic on numbers it is given (memory figures, model
shape), so the rule is tested with made-up machines; only `read_host_memory_available`
reads the real one, and the engine host asks CUDA for its figures. Nothing imports
torch: `yb up` uses it too.

The rule (`EngineConfig` has the settings):

1. An explicit `num_kv_pages` is used as given.
2. Else a byte budget: `kv_memory_bytes` when set; on CUDA `cuda_budget` (the share
   of the device the engine may fill, less its weights and activation peak, never
   more than is free). The budget buys `budget // page_nbytes` pages, kept between a
   floor (one sequence of the longest length the model serves: an engine that cannot
   hold one is useless, so the floor wins over a smaller budget, with a warning) and
   a ceiling (`max_batch_size` such sequences plus the prefix cache: more is never in
   use at once, so it would only be memory held for nothing).
   The prefill engine's prefix cache gets what is left beside one longest sequence,
   at most `prefix_cache_pages`.
3. Else, on the CPU, a size, not a share of whatever memory is free
   (`sequences_kv`): `kv_sequences` longest sequences (at most `max_batch_size`).
   The memory a CPU has is the whole machine's, shared with every other process:
   the engine takes what it can use, not a share of whatever happens to be free.
   The prefill engine's prefix cache lives in those pages while they are idle (at
   most `prefix_cache_pages` of them) and yields them to a prompt that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Source = Literal["num_kv_pages", "kv_memory_bytes", "cuda", "kv_sequences"]
Bound = Literal["", "floor", "ceiling"]


@dataclass(frozen=True, slots=True)
class KVSizing:
    """The page count an engine allocates, and why.

    `budget_bytes` is what the budget allowed (0 for an explicit page count);
    `bound` says whether the floor or the ceiling overrode it; `reason` is the
    budget's derivation in words, for the log.
    """

    pages: int
    page_nbytes: int
    prefix_cache_pages: int
    source: Source
    budget_bytes: int = 0
    bound: Bound = ""
    reason: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.pages * self.page_nbytes

    def log_fields(self) -> dict[str, Any]:
        """The fields of the `kv_cache_sized` log event."""
        return {
            "pages": self.pages,
            "bytes": self.nbytes,
            "page_bytes": self.page_nbytes,
            "prefix_cache_pages": self.prefix_cache_pages,
            "source": self.source,
            "budget_bytes": self.budget_bytes,
            "bound": self.bound or "none",
            "reason": self.reason,
        }


def pages_for(tokens: int, block_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // block_size)


def host_memory_available(
    meminfo: str, cgroup_max: str | None = None, cgroup_current: str | None = None
) -> int:
    """Bytes this process may still use: /proc/meminfo's MemAvailable (what the kernel
    can give without swapping: free memory plus reclaimable caches), or what is left
    under the cgroup's memory limit when that is lower (a container sees the host's
    meminfo, not its own limit). `cgroup_max` and `cgroup_current` are the contents of
    cgroup v2's `memory.max` and `memory.current`."""
    available = 0
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit.lower() != "kb":
                raise ValueError(f"unexpected unit in meminfo: {line!r}")
            available = int(value) * 1024
            break
    else:
        raise ValueError("no MemAvailable in meminfo")
    if cgroup_max is not None and cgroup_current is not None:
        limit = cgroup_max.strip()
        if limit != "max":
            available = min(available, max(0, int(limit) - int(cgroup_current.strip())))
    return available


def read_host_memory_available(root: Path = Path("/")) -> int:
    """`host_memory_available` of this machine (and this container's cgroup)."""
    meminfo = (root / "proc" / "meminfo").read_text()
    cgroup = root / "sys" / "fs" / "cgroup"
    try:
        limit = (cgroup / "memory.max").read_text()
        current = (cgroup / "memory.current").read_text()
    except OSError:  # cgroup v1, or no limit file at the root: the host's figure
        return host_memory_available(meminfo)
    return host_memory_available(meminfo, limit, current)


def activation_peak_estimate(
    *,
    hidden: int,
    q_size: int,
    kv_size: int,
    intermediate: int,
    num_heads: int,
    head_dim: int,
    vocab: int,
    chunk_size: int,
    max_batch_size: int,
    max_len: int,
    element_size: int,
) -> int:
    """Bytes of the largest step's temporaries, beyond weights and KV pages.

    The larger of a prefill chunk (`chunk_size` tokens against `max_len` of context)
    and a decode step (`max_batch_size` sequences of `max_len` each). Per step, one
    layer's temporaries are alive at a time: hidden states and projections, the MLP's
    three intermediates, the context's keys and values gathered from the pages and
    widened to every query head (the SDPA path does this; flash-attn reads the pages in
    place, so this overestimates it), fp32 attention scores, and the fp32 logits.
    """
    per_token = (4 * hidden + q_size + 2 * kv_size + 3 * intermediate) * element_size
    chunk = min(chunk_size, max_len)
    prefill = (
        chunk * per_token
        + 2 * max_len * num_heads * head_dim * element_size
        + chunk * num_heads * max_len * 4
        + chunk * max_len * element_size  # the additive mask
        + vocab * 4
    )
    decode = max_batch_size * (
        per_token
        + 2 * max_len * num_heads * head_dim * element_size
        + num_heads * max_len * 4
        + max_len * element_size
        + vocab * 4
    )
    return max(prefill, decode)


def cuda_budget(
    *, total: int, free: int, reserved: int, activation_peak: int, utilization: float
) -> int:
    """One engine's KV bytes on a CUDA device.

    The engine may fill `utilization` of the device's `total` (as vLLM's
    `gpu_memory_utilization`), with its weights already there (`reserved`: what torch's
    allocator holds for this process after loading them) and room kept for the
    activation peak. Never more than is `free` now less that peak, since other
    processes (another engine on the same GPU) hold memory this one cannot take.
    """
    share = int(total * utilization) - reserved - activation_peak
    return max(0, min(share, free - activation_peak))


def size_kv(
    *,
    budget_bytes: int,
    page_nbytes: int,
    seq_pages: int,
    max_batch_size: int,
    prefix_cache_pages: int,
    source: Source,
    reason: str,
) -> KVSizing:
    """Pages for a byte budget, between the floor and the ceiling (module doc)."""
    if page_nbytes <= 0 or seq_pages <= 0:
        raise ValueError("page_nbytes and seq_pages must be positive")
    floor = seq_pages
    ceiling = max(1, max_batch_size) * seq_pages + max(0, prefix_cache_pages)
    fit = budget_bytes // page_nbytes
    pages = min(max(fit, floor), ceiling)
    bound: Bound = "floor" if fit < floor else "ceiling" if fit > ceiling else ""
    return KVSizing(
        pages=pages,
        page_nbytes=page_nbytes,
        prefix_cache_pages=min(max(0, prefix_cache_pages), pages - seq_pages),
        source=source,
        budget_bytes=budget_bytes,
        bound=bound,
        reason=reason,
    )


def sequences_kv(
    *,
    sequences: int,
    page_nbytes: int,
    seq_pages: int,
    max_batch_size: int,
    prefix_cache_pages: int,
    max_len: int,
) -> KVSizing:
    """`sequences` sequences of `seq_pages` pages (the longest, `max_len` tokens), at
    most `max_batch_size` of them (the ceiling). The prefix cache keeps up to
    `prefix_cache_pages` of those pages while they are idle, and gives them up when a
    prompt needs the room (`PrefixCache.allocate` evicts on demand): cached blocks
    are copies the pool holds too, so they cost no pages of their own."""
    if page_nbytes <= 0 or seq_pages <= 0:
        raise ValueError("page_nbytes and seq_pages must be positive")
    held = min(max(1, sequences), max(1, max_batch_size))
    pages = held * seq_pages
    prefix = min(max(0, prefix_cache_pages), pages)
    return KVSizing(
        pages=pages,
        page_nbytes=page_nbytes,
        prefix_cache_pages=prefix,
        source="kv_sequences",
        bound="ceiling" if held < sequences else "",
        reason=f"engine.kv_sequences = {sequences}: {held} sequence(s) of {max_len} tokens"
        + (f" (max_batch_size {max_batch_size})" if held < sequences else "")
        + (f"; the prefix cache keeps up to {prefix} of those pages while idle" if prefix else ""),
    )


def explicit_kv(pages: int, page_nbytes: int, prefix_cache_pages: int) -> KVSizing:
    """An explicit `num_kv_pages`: used as given, the prefix cache bounded only by it
    (whoever set the count chose both)."""
    if pages <= 0:
        raise ValueError("num_kv_pages must be positive")
    return KVSizing(
        pages=pages,
        page_nbytes=page_nbytes,
        prefix_cache_pages=min(max(0, prefix_cache_pages), pages),
        source="num_kv_pages",
        reason="engine.num_kv_pages",
    )
