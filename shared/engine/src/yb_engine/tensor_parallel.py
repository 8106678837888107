"""Tensor parallelism: how a model is cut across the N ranks of one instance, and the
collectives that put the cut back together.

Megatron's cut, applied to every family the registry reads:

- attention: each rank holds `num_heads / N` query heads and the KV heads they read
  (`num_kv_heads / N` of them; where N exceeds the KV heads, each KV head is held by the
  `N / num_kv_heads` ranks whose queries read it). q/k/v are cut by rows, the output
  projection by columns, so each rank's output is a partial sum: one all-reduce.
  Latent attention (MLA) cuts its query heads and `kv_b` the same way; the latent
  itself (one per token, read by every head) is computed and kept by every rank.
- a dense MLP: gate/up by rows, down by columns (one all-reduce).
- a mixture of experts: each rank holds whole experts, a contiguous share of them
  (the router is replicated, so every rank routes alike); a shared expert is cut as a
  dense MLP. The ranks' partial sums meet in the same one all-reduce.
- the vocabulary: the embedding and the head are cut by rows. A token's embedding
  comes from the rank holding its row (the others add zeros: an exact all-reduce); the
  logits are gathered.

Norms, the router and the final norm are replicated. A layer costs two all-reduces
of the hidden state, plus one per forward for the embedding and one gather of the
logits. Biases of cut-by-columns projections are added once, after the all-reduce.

`Shard` is the arithmetic (which heads, experts, rows a rank holds), `check_degree`
says whether a model can be cut N ways, and `TPGroup` runs the collectives over
`torch.distributed` (gloo on the CPU), each bounded by the group's timeout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch

from yb_engine.architecture import ArchConfig

__all__ = [
    "Shard",
    "TPGroup",
    "check_degree",
    "head_cuts",
    "merge_cuts",
    "owner_ranks",
    "transfer_cuts",
]


def span(n: int, rank: int, size: int) -> range:
    """Rank `rank`'s share of `n` things cut `size` ways, as evenly as can be."""
    return range(rank * n // size, (rank + 1) * n // size)


def check_degree(arch: ArchConfig, n: int) -> str | None:
    """Why `arch` cannot run on `n` tensor-parallel ranks; None when it can."""
    if n < 1:
        return f"a tensor-parallel degree must be at least 1, not {n}"
    if n == 1:
        return None
    if arch.num_heads % n:
        return f"{arch.num_heads} attention heads cannot be cut {n} ways"
    if arch.mla is None:
        kv = arch.num_kv_heads
        if kv % n and n % kv:
            return f"{kv} KV heads cannot be cut {n} ways, nor replicated across {n} ranks"
    if arch.qk_norm == "full":
        # OLMo 2 normalizes q and k over the whole projection: a norm across ranks.
        return f"{arch.family}'s q/k norm over every head is not computed across ranks"
    if arch.moe is not None and arch.moe.num_experts < n:
        return f"{arch.moe.num_experts} experts cannot be shared by {n} ranks"
    if arch.intermediate < n:
        return f"an MLP of {arch.intermediate} cannot be cut {n} ways"
    return None


def kv_groups(arch: ArchConfig, n: int) -> int:
    """Into how many runs of heads an instance of degree `n` cuts a KV page: each run
    is held (owned) by one rank. The latent of MLA is one run, held by every rank."""
    if arch.mla is not None:
        return 1
    return min(n, arch.num_kv_heads)


def head_cuts(arch: ArchConfig, n: int) -> list[int]:
    """The KV head boundaries of an instance of degree `n`: run `i` is heads
    `[cuts[i], cuts[i + 1])` (for MLA, `[0, 1]`: the one latent)."""
    heads = 1 if arch.mla is not None else arch.num_kv_heads
    g = kv_groups(arch, n)
    return [i * heads // g for i in range(g + 1)]


def merge_cuts(*cuts: Sequence[int]) -> list[int]:
    """The head boundaries both sides of a transfer cut a page at: every boundary of
    either, so each piece is one run of heads that one rank holds on each side."""
    ends = {(c[0], c[-1]) for c in cuts}
    if len(ends) != 1:
        raise ValueError(f"head cuts of different pages: {list(cuts)}")
    return sorted(set(itertools.chain.from_iterable(cuts)))


def transfer_cuts(arch: ArchConfig, sender: int, receiver: int) -> list[int]:
    """The head boundaries a page travels cut at between instances of degrees `sender`
    and `receiver` (`merge_cuts` of theirs)."""
    return merge_cuts(head_cuts(arch, sender), head_cuts(arch, receiver))


def owner_ranks(arch: ArchConfig, n: int) -> list[list[int]]:
    """For each run of `head_cuts`, the ranks that hold it; the first owns it (sends
    it, and receives it for the others, which get a copy)."""
    g = kv_groups(arch, n)
    per = n // g
    return [list(range(i * per, (i + 1) * per)) for i in range(g)]


@dataclass(frozen=True, slots=True)
class Shard:
    """What rank `rank` of `size` holds of a model of architecture `arch`."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}")

    def q_heads(self, arch: ArchConfig) -> range:
        """The query heads this rank computes."""
        return span(arch.num_heads, self.rank, self.size)

    def kv_heads(self, arch: ArchConfig) -> range:
        """The KV heads this rank computes and keeps (for MLA: the latent, `range(1)`)."""
        if arch.mla is not None:
            return range(1)
        kv = arch.num_kv_heads
        if self.size <= kv:
            return span(kv, self.rank, self.size)
        head = self.rank // (self.size // kv)
        return range(head, head + 1)

    def experts(self, arch: ArchConfig) -> range:
        """The experts this rank holds (all of none when the model has none)."""
        assert arch.moe is not None
        return span(arch.moe.num_experts, self.rank, self.size)

    def columns(self, width: int) -> range:
        """This rank's share of an MLP of `width` (a dense MLP, a shared expert)."""
        return span(width, self.rank, self.size)

    def vocab(self, arch: ArchConfig) -> range:
        """The embedding and head rows this rank holds."""
        return span(arch.vocab, self.rank, self.size)

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The architecture as this rank's forward pass sees it: its own heads (the
        KV cache it keeps follows: `local_arch(arch).kv_spec`)."""
        if self.size == 1:
            return arch
        heads = len(self.q_heads(arch))
        kv = 1 if arch.mla is not None else len(self.kv_heads(arch))
        return msgspec.structs.replace(arch, num_heads=heads, num_kv_heads=kv)


class TPGroup:
    """The collectives of one rank of a tensor-parallel instance, over its own gloo
    process group (`torch.distributed.ProcessGroupGloo`, made on the instance's
    store: no process-wide default group, so a process may hold several instances).
    Every call is bounded by the group's timeout: a rank that stops answering makes
    the others raise, never wait forever."""

    def __init__(self, shard: Shard, arch: ArchConfig, store: object, timeout_s: float) -> None:
        """`store`: the instance's `torch.distributed.Store` (rank 0 holds it)."""
        import torch.distributed as dist

        self.shard = shard
        self.arch = arch
        self.timeout = timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(
            dist.PrefixStore("tp/", store),  # type: ignore[arg-type]
            shard.rank,
            shard.size,
            self.timeout,
        )
        self.vocab = shard.vocab(arch)
        # The widest share: every rank's logits are padded to it for the gather.
        self._vocab_width = -(-arch.vocab // shard.size)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self.pg.allreduce([t]).wait()
        return t

    def agree(self, value: int) -> int:
        """Rank 0's `value` on every rank (the others pass 0): what a holdable call
        does at a layer boundary (`yb_engine.pausing`), decided once for all."""
        t = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int32)
        return int(self.all_reduce(t).item())

    def embed(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings `[T, hidden]` of `ids` from the vocabulary rows this rank holds
        (`rows`, its share): its own rows, zeros for the others', summed."""
        lo, hi = self.vocab.start, self.vocab.stop
        mine = (ids >= lo) & (ids < hi)
        local = torch.where(mine, ids - lo, torch.zeros_like(ids))
        x = torch.nn.functional.embedding(local, rows)
        x = x * mine[:, None].to(x.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits `[T, its vocabulary share]` joined with every other
        rank's into `[T, vocab]`."""
        t, width = logits.shape[0], self._vocab_width
        if logits.shape[1] < width:
            pad = logits.new_zeros(t, width - logits.shape[1])
            logits = torch.cat((logits, pad), dim=1)
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.pg.allgather([parts], [logits.contiguous()]).wait()
        vocab = self.arch.vocab
        return torch.cat(
            [p[:, : len(span(vocab, r, self.size))] for r, p in enumerate(parts)], dim=1
        )
