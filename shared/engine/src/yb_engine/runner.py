"""Prefill and decode of one model over one paged KV cache: the engine's entry points.

transformers' modules assume a contiguous per-request cache; serving needs more: a
prefix whose KV arrived from elsewhere, a prompt computed in chunks, each layer's KV
shipped as soon as it is written, and one decode step over many sequences of different
lengths. So the forward pass is our own (`decoder.py`, one layer loop for every family
the registry reads), with attention delegated to a backend (`attention.py`). It computes
the same function as transformers; the reference tests hold every family to that
within 1e-4.

`ModelRunner` turns each public call into a `Step` of flattened rows: a prefill chunk is
T tokens of one sequence, a decode step is one token of each of T sequences, a batched
prefill is several chunks, and a mixed step is both at once (B decode tokens, then one
prefill chunk: SARATHI's piggybacked prefill), so the chunk shares the weight reads of
the decode batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from yb_engine.attention import AttentionBackend, host_ints, select_backend
from yb_engine.decoder import Chunk, Decoder, Keep, LayerHook, LayerReady, Step
from yb_engine.kv_cache import PagedKVCache
from yb_engine.loader import LoadedModel
from yb_engine.pausing import EnginePause
from yb_engine.tensor_parallel import TPGroup

__all__ = [
    "DecodeSeq",
    "LayerHook",
    "LayerReady",
    "ModelRunner",
    "PrefillChunk",
    "PrefillSeq",
    "RowLogits",
]

#: `row_logits(start, rows)`: a prefill chunk's float32 logits `[chunk, vocab]`, after
#: tokens `start ..` of the prompt.
RowLogits = Callable[[int, torch.Tensor], None]


class DecodeSeq(msgspec.Struct, frozen=True):
    """One sequence in a decode step: the token at `position` is fed, its KV written.

    `block_table` must already hold a page for `position` (the caller allocates).
    """

    block_table: list[int]
    position: int
    token_id: int


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One prompt of a batched prefill (`ModelRunner.prefill_batch`): its tokens, the
    pages that hold them, how many of them already have their KV there, and the hook
    run after each layer wrote its KV (as `prefill`'s `layer_hook`)."""

    token_ids: Sequence[int]
    block_table: Sequence[int]
    num_cached_tokens: int = 0
    layer_hook: LayerHook | None = None

    @property
    def new_tokens(self) -> int:
        """The tokens the prefill computes."""
        return len(self.token_ids) - self.num_cached_tokens


class PrefillChunk(msgspec.Struct, frozen=True):
    """Tokens `[start, start + len(token_ids))` of one prompt, computed in a mixed step.

    Tokens before `start` must have their KV in `block_table`'s pages already (earlier
    chunks, or a cached prefix); `block_table` must hold pages up to the chunk's end.
    `wants_logits` asks for the next-token logits after the chunk's last token (the
    prompt's last chunk).
    """

    token_ids: list[int]
    block_table: list[int]
    start: int
    wants_logits: bool

    @property
    def end(self) -> int:
        """The position after the chunk's last token."""
        return self.start + len(self.token_ids)


class ModelRunner:
    """Prefill and decode for one model over one `PagedKVCache`.

    Not thread-safe: one runner is driven by one thread (it reuses workspaces). It leaves
    `torch.set_num_threads` to the caller, since the engine, not the library, knows how
    many cores it owns.
    """

    def __init__(
        self,
        model: LoadedModel,
        cache: PagedKVCache,
        backend: AttentionBackend | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """`tp`: this is one rank of a tensor-parallel instance (`model` holds the
        rank's share of the weights, `cache` its heads' pages); every rank runs the
        same calls in the same order (`yb_engine.tp_instance`)."""
        arch = model.config if tp is None else tp.shard.local_arch(model.config)
        if cache.spec != arch.kv_spec(cache.spec.dtype):
            raise ValueError(f"KV cache {cache.spec} does not fit {arch.model_id}")
        if cache.device.type != torch.device(model.device).type:
            raise ValueError(f"KV cache on {cache.device}, model on {model.device}")
        self.model = model
        self.arch = arch
        self.cache = cache
        self.weights = model.weights
        self.dtype = model.dtype
        self.device = torch.device(model.device)
        if backend is None:
            backend = select_backend(
                self.device, cache.block_size, self.dtype, arch, cache_dtype=cache.dtype
            )
        elif backend.cache_dtype_must_match and cache.dtype != self.dtype:
            raise ValueError(
                f"{backend.name} reads the KV cache in place: it must be {self.dtype}, "
                f"not {cache.dtype}"
            )
        self.backend: AttentionBackend = backend
        weights = model.weights
        self.decoder = Decoder(
            arch,
            weights.layers,
            first_layer=0,
            embed=weights.embed,
            final_norm=weights.final_norm,
            lm_head=weights.lm_head,
            cache=cache,
            backend=backend,
            dtype=self.dtype,
            device=self.device,
            tp=tp,
        )

    @property
    def attention_backend(self) -> str:
        """The attention backend that runs ("torch-sdpa", "flash-attn", "flash-attn-cute")."""
        return self.backend.name

    # -- public API -------------------------------------------------------------------

    def prefill(
        self,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_cached_tokens: int = 0,
        chunk_size: int = 512,
        layer_hook: LayerHook | None = None,
        all_logits: bool = False,
        row_logits: RowLogits | None = None,
        layer_ready: LayerReady | None = None,
        hold: EnginePause | None = None,
    ) -> torch.Tensor:
        """Compute the KV of `token_ids[num_cached_tokens:]` and the next-token logits.

        Tokens before `num_cached_tokens` must already have their KV in the pages of
        `block_table` (computed earlier or received from a KV store). The rest is
        computed in chunks of `chunk_size` tokens, each attending to the cached prefix
        and the earlier chunks, so peak activation memory is bounded by the chunk, not
        the prompt. After each layer has written a chunk's KV, `layer_hook(layer, start,
        end)` runs, so the caller can ship those pages while later layers compute.
        `layer_ready(layer)` runs before each layer of the first chunk reads the
        cache: the cached prefix may still be landing, layer by layer, and must be
        there (in every layer) once it returns. It raises to abandon the call.

        Returns float32 logits `[vocab]` for the token after the prompt. At least the
        last prompt token must be computed (its logits are not cached anywhere). With
        `all_logits`, the logits after every computed token instead, `[n -
        num_cached_tokens, vocab]` (row j follows token `num_cached_tokens + j`; the
        last row is what `prefill` returns): what a prompt's logprobs are read from.
        `row_logits(start, rows)` instead hands over each chunk's rows as they are
        computed (`rows` follow tokens `start ..`), so no more than one chunk's logits
        is ever held (a long prompt's `[n, vocab]` float32 would not fit), and the
        call returns the last row only. With `hold`, the call may hold after any layer
        (after `layer_hook` ran) and lend the engine thread meanwhile
        (`yb_engine.pausing`); it raises `PauseAbandoned` where it is abandoned.
        """
        self.check_prefill(
            token_ids, block_table, num_cached_tokens, chunk_size, all_logits, row_logits
        )
        layer_hook = self.holding_hook(layer_hook, hold)
        n = len(token_ids)
        block_size = self.cache.block_size
        with torch.inference_mode():
            ids = host_ints(list(token_ids), torch.int64, self.device)
            decoder = self.decoder
            rows: list[torch.Tensor] = []
            for start in range(num_cached_tokens, n, chunk_size):
                end = min(start + chunk_size, n)
                plan = self.backend.plan_prefill(block_table, start, end, block_size)
                every_row = all_logits or row_logits is not None
                keep: Keep = "all" if every_row else "last" if end == n else "none"
                # The first chunk runs behind the prefix's arrival; later chunks find
                # every layer of it there.
                ready = layer_ready if start == num_cached_tokens else None
                step = Step(
                    positions=torch.arange(start, end, device=self.device),
                    chunks=[Chunk(plan, 0, end - start, keep, layer_hook, ready)],
                )
                hidden = decoder.forward(decoder.embed(ids[start:end]), step)
                if every_row:
                    chunk_rows = decoder.logits(hidden)
                    if row_logits is not None:
                        row_logits(start, chunk_rows)
                        hidden = hidden[-1:]
                    else:
                        rows.append(chunk_rows)
            if all_logits:
                return torch.cat(rows) if len(rows) > 1 else rows[0]
            return decoder.logits(hidden[-1:])[0]

    def holding_hook(self, hook: LayerHook | None, hold: EnginePause | None) -> LayerHook | None:
        """`hook`, then `hold`'s decision at the same layer boundary (once the layer's
        KV went out: what is held was computed)."""
        if hold is None:
            return hook

        def at_layer(layer: int, start: int, end: int) -> None:
            if hook is not None:
                hook(layer, start, end)
            hold.at_layer(layer, start, end)

        return at_layer

    def check_prefill(
        self,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_cached_tokens: int,
        chunk_size: int = 1,
        all_logits: bool = False,
        row_logits: RowLogits | None = None,
    ) -> None:
        """Raise ValueError unless `prefill` can compute this prompt (checked before
        anything is computed or written)."""
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if all_logits and row_logits is not None:
            raise ValueError("ask for all_logits or row_logits, not both")
        n = len(token_ids)
        if not 0 <= num_cached_tokens < n:
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} must be in [0, {n}): "
                "the last prompt token must be computed to get its logits"
            )
        if n > self.arch.max_position:
            raise ValueError(f"prompt of {n} tokens exceeds max_position {self.arch.max_position}")
        block_size = self.cache.block_size
        if len(block_table) * block_size < n:
            raise ValueError(f"{len(block_table)} pages of {block_size} cannot hold {n} tokens")

    def check_positions(self, batch: Sequence[DecodeSeq]) -> None:
        """Raise ValueError unless every decode position is one the model has."""
        for seq in batch:
            if not 0 <= seq.position < self.arch.max_position:
                raise ValueError(f"position {seq.position} outside [0, {self.arch.max_position})")

    def check_mixed(self, batch: Sequence[DecodeSeq], chunk: PrefillChunk) -> None:
        """Raise ValueError unless `mixed` can compute this step."""
        if not chunk.token_ids:
            raise ValueError("a prefill chunk needs at least one token")
        if chunk.start < 0 or chunk.end > self.arch.max_position:
            raise ValueError(
                f"chunk [{chunk.start}, {chunk.end}) outside [0, {self.arch.max_position}]"
            )
        self.check_positions(batch)

    def prefill_batch(self, seqs: Sequence[PrefillSeq]) -> torch.Tensor:
        """`prefill` of several prompts in one forward pass; float32 logits `[N, vocab]`,
        row i after the last token of `seqs[i]`.

        Each prompt's uncached tokens are computed as one chunk: every linear layer
        runs once over all the prompts' tokens, attention per prompt (each sees only its
        own pages). So N short prompts cost about what one does, where one at a time
        each pays the whole per-layer overhead. Each prompt gets what `prefill` computes
        for it alone (the same function; float sums may round differently with the
        batch's shape). Each one's `layer_hook` runs after each layer.
        """
        if not seqs:
            return torch.empty(0, self.arch.vocab, dtype=torch.float32, device=self.device)
        block_size = self.cache.block_size
        for seq in seqs:
            self.check_prefill(seq.token_ids, seq.block_table, seq.num_cached_tokens)
        with torch.inference_mode():
            plans = [
                self.backend.plan_prefill(
                    seq.block_table, seq.num_cached_tokens, len(seq.token_ids), block_size
                )
                for seq in seqs
            ]
            ids = host_ints(
                [t for seq in seqs for t in seq.token_ids[seq.num_cached_tokens :]],
                torch.int64,
                self.device,
            )
            positions = torch.cat([torch.arange(p.start, p.end, device=self.device) for p in plans])
            chunks, lo = [], 0
            for plan, seq in zip(plans, seqs, strict=True):
                hi = lo + plan.end - plan.start
                chunks.append(Chunk(plan, lo, hi, "last", seq.layer_hook))
                lo = hi
            step = Step(positions=positions, chunks=chunks)
            decoder = self.decoder
            return decoder.logits(decoder.forward(decoder.embed(ids), step))

    def decode(self, batch: Sequence[DecodeSeq]) -> torch.Tensor:
        """One decode step for every sequence of `batch`; float32 logits `[B, vocab]`.

        Each sequence's `token_id` is fed at its `position` (its KV is written there) and
        attends to positions `[0, position]` of its own pages. Sequences may have any
        mix of lengths.
        """
        if not batch:
            return torch.empty(0, self.arch.vocab, dtype=torch.float32, device=self.device)
        self.check_positions(batch)
        with torch.inference_mode():
            plan = self.backend.plan_decode(
                [s.block_table for s in batch], [s.position for s in batch], self.cache.block_size
            )
            ids = host_ints([s.token_id for s in batch], torch.int64, self.device)
            step = Step(positions=plan.positions, decode=plan, num_decode=len(batch))
            decoder = self.decoder
            return decoder.logits(decoder.forward(decoder.embed(ids), step))

    def mixed(
        self, batch: Sequence[DecodeSeq], chunk: PrefillChunk
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step for `batch` and one prefill chunk, in one forward pass.

        Every linear layer runs once over the B decode tokens and the chunk's tokens
        together; attention runs per part (the decode plan for the B rows, the prefill
        plan for the chunk). Each part computes what `decode` and `prefill` compute for
        it alone (the same function; float sums may round differently with the batch's
        shape). Returns the decode logits `[B, vocab]` and, when `chunk.wants_logits`,
        the logits `[vocab]` after the chunk's last token (else None); float32.
        """
        n = len(chunk.token_ids)
        self.check_mixed(batch, chunk)
        block_size = self.cache.block_size
        with torch.inference_mode():
            prefill_plan = self.backend.plan_prefill(
                chunk.block_table, chunk.start, chunk.end, block_size
            )
            chunk_positions = torch.arange(chunk.start, chunk.end, device=self.device)
            decode_plan = None
            positions = chunk_positions
            if batch:
                decode_plan = self.backend.plan_decode(
                    [s.block_table for s in batch], [s.position for s in batch], block_size
                )
                positions = torch.cat([decode_plan.positions, chunk_positions])
            ids = host_ints(
                [*(s.token_id for s in batch), *chunk.token_ids], torch.int64, self.device
            )
            b = len(batch)
            step = Step(
                positions=positions,
                chunks=[Chunk(prefill_plan, b, b + n, "last" if chunk.wants_logits else "none")],
                decode=decode_plan,
                num_decode=b,
            )
            decoder = self.decoder
            logits = decoder.logits(decoder.forward(decoder.embed(ids), step))
            return logits[:b], (logits[b] if chunk.wants_logits else None)
