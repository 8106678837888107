"""The decoder's forward pass: one layer loop, for every family and every path.

A step is a batch of rows flattened to `[T, hidden]`: first the B decode tokens of a
`DecodePlan` (one per sequence), then prefill chunks, each a run of one prompt's tokens
with its own `PrefillPlan`. A prefill is one chunk; a batched prefill is several; a
decode step is decode rows only; a mixed step (SARATHI's piggybacking) is both. Every
linear layer runs once over all the rows; only attention cares which is which.

A layer is an attention (grouped-query, or DeepSeek's latent attention) and an MLP
(dense and gated, or a mixture of experts), with the norms where its family puts them.
What differs between families is data in `ArchConfig` (`families.py` reads it), so
`ModelRunner` and the pipeline's `StageRunner` both drive this one loop: the runner over
every layer, a stage over its range.

The last layer of the model only needs the rows whose output is used: the decode rows,
and per chunk all of its rows (a stage that hands its output on, or a prompt whose
every logit is wanted), its last row (the next-token logits), or none (a chunk that
only fills the cache). Every row's KV is still written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from yb_engine.architecture import ArchConfig
from yb_engine.attention import AttentionBackend, AttnOptions, DecodePlan, PrefillPlan
from yb_engine.kv_cache import PagedKVCache
from yb_engine.rope import Rotary
from yb_engine.tensor_parallel import TPGroup
from yb_engine.weights import (
    AttentionWeights,
    LatentAttentionWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
)

LayerHook = Callable[[int, int, int], None]
#: Called with a layer's index before the layer reads the cache (see `Chunk.ready`).
LayerReady = Callable[[int], None]
Keep = Literal["all", "last", "none"]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm as each family computes it: Llama's (`weight * normed.to(dtype)`) or,
    with an `offset`, Gemma's (`(normed * (offset + weight)).to(dtype)`, in float32)."""
    if offset:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (offset + weight.float())).type_as(x)
    if x.dtype == torch.float32:
        # One fused op, bit-identical here to the spelled-out form below.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # transformers' LlamaRMSNorm: normalize in float32, round, then scale.
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One prompt's rows `[lo, hi)` of a step, attended with `plan`; `keep` says which of
    its rows the model's last layer computes; `hook(layer, start, end)` runs after each
    layer wrote the chunk's KV (the caller ships those pages while later layers run);
    `ready(layer)` runs before each layer reads the cache and returns once the layer's
    cached prefix is in the pages (the caller loads it while earlier layers run)."""

    plan: PrefillPlan
    lo: int
    hi: int
    keep: Keep
    hook: LayerHook | None = None
    ready: LayerReady | None = None


@dataclass(slots=True)
class Step:
    """The rows of one forward: `num_decode` decode rows (with `decode`'s plan), then
    `chunks`; `positions` gives each row's position in its sequence."""

    positions: torch.Tensor
    chunks: Sequence[Chunk] = ()
    decode: DecodePlan | None = None
    num_decode: int = 0
    _kept: torch.Tensor | None = field(default=None, init=False)
    _kept_made: bool = field(default=False, init=False)

    def kept_rows(self) -> torch.Tensor | None:
        """The rows the last layer computes, as an index (None: every row)."""
        if not self._kept_made:
            rows = list(range(self.num_decode))
            for c in self.chunks:
                if c.keep == "all":
                    rows.extend(range(c.lo, c.hi))
                elif c.keep == "last":
                    rows.append(c.hi - 1)
            total = self.num_decode + sum(c.hi - c.lo for c in self.chunks)
            if rows != list(range(total)):
                self._kept = torch.tensor(rows, dtype=torch.int64, device=self.positions.device)
            self._kept_made = True
        return self._kept


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored adjacent (x0, x1, x2, x3...) as split halves (x0, x2...,
    x1, x3...), the layout `Rotary.apply` rotates: what transformers' interleaved
    RoPE computes."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class Decoder:
    """The layers `[first_layer, first_layer + len(layers))` of a model, and its
    embeddings and head where this holder has them: computes a `Step` over the KV
    pages of `cache` (whose layer j is the model's layer `first_layer + j`).

    With `tp`, this is one rank of a tensor-parallel instance: `arch` is the rank's
    (`Shard.local_arch`: its heads), the weights its share, and the partial sums of
    each layer's attention and MLP meet in an all-reduce (`yb_engine.tensor_parallel`).
    """

    def __init__(
        self,
        arch: ArchConfig,
        layers: Sequence[LayerWeights],
        *,
        first_layer: int,
        embed: torch.Tensor | None,
        final_norm: torch.Tensor | None,
        lm_head: torch.Tensor | None,
        cache: PagedKVCache,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        self.arch = arch
        self.tp = tp
        self.experts = (
            tp.shard.experts(arch)
            if tp is not None and arch.moe is not None
            else range(arch.moe.num_experts if arch.moe is not None else 0)
        )
        self.layers = layers
        self.first_layer = first_layer
        self.embed_weight = embed
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.cache = cache
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.holds_last = first_layer + len(layers) == arch.num_layers
        rot_dim = arch.mla.rope_dim if arch.mla is not None else arch.head_dim
        self.rotary = Rotary(arch.rope, rot_dim, device)
        self.rotary_local = Rotary(arch.rope_local, rot_dim, device) if arch.rope_local else None
        self.opts = [
            AttnOptions(
                scale=arch.attn_scale,
                window=arch.window(first_layer + j),
                softcap=arch.attn_softcap,
            )
            for j in range(len(layers))
        ]
        self.act = _activation(arch.hidden_act)
        self._embed_scale = (
            torch.tensor(arch.embed_scale, dtype=dtype) if arch.embed_scale != 1.0 else None
        )

    # -- ends -------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[T]` to hidden states `[T, hidden]`."""
        assert self.embed_weight is not None, "only the first stage embeds tokens"
        if self.tp is not None:
            x = self.tp.embed(ids, self.embed_weight)
        else:
            x = F.embedding(ids, self.embed_weight)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits `[T, vocab]` of final hidden states."""
        assert self.final_norm is not None and self.lm_head is not None
        arch = self.arch
        logits = F.linear(self.norm(hidden, self.final_norm), self.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        if arch.logit_scale != 1.0:
            logits = logits * arch.logit_scale
        if arch.final_softcap is not None:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits.float()

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.arch.rms_eps, self.arch.norm_offset)

    # -- the layer loop ---------------------------------------------------------------

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Run `x` (`[T, hidden]`, the step's rows) through the layers; returns the
        last layer's rows (all of them unless this holds the model's last layer: then
        the rows `step.kept_rows()` names)."""
        cos_sin = self.rotary.cos_sin(step.positions, self.dtype)
        local = (
            self.rotary_local.cos_sin(step.positions, self.dtype)
            if self.rotary_local is not None
            else cos_sin
        )
        last = len(self.layers) - 1
        hooks = [c for c in step.chunks if c.hook is not None]
        waits = [c.ready for c in step.chunks if c.ready is not None]
        for j, lw in enumerate(self.layers):
            for ready in waits:
                ready(self.first_layer + j)
            opts = self.opts[j]
            final = self.holds_last and j == last
            rope = local if opts.window and self.rotary_local is not None else cos_sin
            x = self._layer(j, lw, x, step, rope, opts, final)
            for c in hooks:
                assert c.hook is not None
                c.hook(self.first_layer + j, c.plan.start, c.plan.end)
        return x

    def _layer(
        self,
        j: int,
        lw: LayerWeights,
        x: torch.Tensor,
        step: Step,
        rope: tuple[torch.Tensor, ...],
        opts: AttnOptions,
        final: bool,
    ) -> torch.Tensor:
        arch = self.arch
        h = self.norm(x, lw.attn_norm) if lw.attn_norm is not None else x
        if isinstance(lw.attn, LatentAttentionWeights):
            attn = self._latent_attention(j, lw.attn, h, step, rope, opts, final)
        else:
            attn = self._attention(j, lw.attn, h, step, rope, opts, final)
        if final:
            kept = step.kept_rows()
            if kept is not None:
                x = x.index_select(0, kept)
        if attn is None:  # a last layer whose output no row needs
            return x
        tp = self.tp
        if tp is None:
            out = F.linear(attn, lw.attn.o, lw.attn.o_bias)
        else:  # each rank's heads give a partial sum; the bias is added once
            out = tp.all_reduce(F.linear(attn, lw.attn.o))
            if lw.attn.o_bias is not None:
                out = out + lw.attn.o_bias
        if lw.post_attn_norm is not None:
            out = self.norm(out, lw.post_attn_norm)
        x = x + out * arch.residual_scale if arch.residual_scale != 1.0 else x + out
        h = self.norm(x, lw.mlp_norm) if lw.mlp_norm is not None else x
        mlp = lw.mlp
        if tp is None:
            out = self._experts(mlp, h) if isinstance(mlp, MoEWeights) else self._mlp(mlp, h)
        elif isinstance(mlp, MoEWeights):
            out = tp.all_reduce(self._experts(mlp, h))
        else:
            out = tp.all_reduce(self._mlp(mlp, h, bias=False))
            if mlp.down_bias is not None:
                out = out + mlp.down_bias
        if lw.post_mlp_norm is not None:
            out = self.norm(out, lw.post_mlp_norm)
        return x + out * arch.residual_scale if arch.residual_scale != 1.0 else x + out

    def _queries_for(self, q: torch.Tensor, c: Chunk, final: bool) -> torch.Tensor | None:
        """The chunk's query rows this layer attends (see the module doc)."""
        if not final or c.keep == "all":
            return q[c.lo : c.hi]
        if c.keep == "last":
            return q[c.hi - 1 : c.hi]
        return None

    def _attend(
        self,
        q: torch.Tensor,
        step: Step,
        final: bool,
        decode: Callable[[torch.Tensor, int], torch.Tensor],
        prefill: Callable[[torch.Tensor | None, Chunk], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """Attention for each part of the step, joined: `decode(q[:B], B)` for the
        decode rows, `prefill(queries, chunk)` for each chunk (which writes the chunk's
        KV and attends the rows this layer needs); `[rows, heads * dim]`, or None when
        no row needs an output."""
        parts = []
        if step.decode is not None:
            parts.append(decode(q[: step.num_decode], step.num_decode))
        for c in step.chunks:
            out = prefill(self._queries_for(q, c, final), c)
            if out is not None:
                parts.append(out)
        if not parts:
            return None
        joined = torch.cat(parts) if len(parts) > 1 else parts[0]
        return joined.reshape(joined.shape[0], -1)

    def _attention(
        self,
        j: int,
        w: AttentionWeights,
        h: torch.Tensor,
        step: Step,
        rope: tuple[torch.Tensor, ...],
        opts: AttnOptions,
        final: bool,
    ) -> torch.Tensor | None:
        arch = self.arch
        t = h.shape[0]
        heads, kv_heads, dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        cos, sin = rope
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        if arch.qk_norm:
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            assert w.q_norm is not None and w.k_norm is not None
            if arch.qk_norm == "full":  # over the whole projection (OLMo 2)
                q, k = self.norm(q, w.q_norm), self.norm(k, w.k_norm)
                q, k = q.view(t, heads, dim), k.view(t, kv_heads, dim)
            else:  # per head (Qwen3, Gemma 3)
                q = self.norm(q.view(t, heads, dim), w.q_norm)
                k = self.norm(k.view(t, kv_heads, dim), w.k_norm)
            q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
            v = v.view(t, kv_heads, dim)
        else:
            qk_heads = heads + kv_heads
            # Queries and keys sit side by side in each row of the fused output, so one
            # rotation covers both (half the small ops of rotating them separately).
            qk = Rotary.apply(qkv[:, : qk_heads * dim].view(t, qk_heads, dim), cos, sin)
            q, k = qk.split([heads, kv_heads], dim=1)
            v = qkv[:, qk_heads * dim :].view(t, kv_heads, dim)
        kv_layer, backend, plan = self.cache.kv[j], self.backend, step.decode
        return self._attend(
            q,
            step,
            final,
            lambda qd, b: backend.decode(kv_layer, qd, k[:b], v[:b], plan, opts),  # type: ignore[arg-type]
            lambda qc, c: backend.prefill(
                kv_layer, qc, k[c.lo : c.hi], v[c.lo : c.hi], c.plan, opts
            ),
        )

    def _latent_attention(
        self,
        j: int,
        w: LatentAttentionWeights,
        h: torch.Tensor,
        step: Step,
        rope: tuple[torch.Tensor, ...],
        opts: AttnOptions,
        final: bool,
    ) -> torch.Tensor | None:
        arch = self.arch
        mla = arch.mla
        assert mla is not None
        backend = self.backend
        if not hasattr(backend, "prefill_latent"):
            raise ValueError(f"{backend.name} cannot attend over latent (MLA) pages")
        t, heads, r = h.shape[0], arch.num_heads, mla.kv_lora_rank
        cos, sin = rope
        if w.q is not None:
            q = F.linear(h, w.q)
        else:
            assert w.q_a is not None and w.q_a_norm is not None and w.q_b is not None
            q = F.linear(self.norm(F.linear(h, w.q_a), w.q_a_norm), w.q_b)
        q_nope, q_rot = q.view(t, heads, mla.qk_dim).split([mla.nope_dim, mla.rope_dim], dim=-1)
        compressed = F.linear(h, w.kv_a)
        latent, k_rot = compressed.split([r, mla.rope_dim], dim=-1)
        latent = self.norm(latent, w.kv_a_norm)
        k_rot = k_rot.view(t, 1, mla.rope_dim)
        if mla.interleaved_rope:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q = torch.cat((q_nope, Rotary.apply(q_rot, cos, sin)), dim=-1)
        # What the pages keep: the normalized latent, then the rotated shared key.
        kept = torch.cat((latent, Rotary.apply(k_rot, cos, sin)[:, 0]), dim=-1).view(t, 1, -1)

        def expand(context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            n = context.shape[0]
            kv = F.linear(context[:, 0, :r], w.kv_b).view(n, heads, mla.nope_dim + mla.v_dim)
            k_nope, values = kv.split([mla.nope_dim, mla.v_dim], dim=-1)
            shared = context[:, :, r:].expand(n, heads, mla.rope_dim)
            return torch.cat((k_nope, shared), dim=-1), values

        # Decode attends in latent space (weight absorption): a query head's key
        # up-projection is folded into the query, so a step reads the latents as they
        # lie instead of expanding every cached token to every head; the value
        # up-projection is applied to the attention's output. The same function; a
        # prefill chunk, which computes many queries, expands the latents instead.
        up = w.kv_b.view(heads, mla.nope_dim + mla.v_dim, r)
        key_up, value_up = up[:, : mla.nope_dim], up[:, mla.nope_dim :]

        def decode(qd: torch.Tensor, b: int) -> torch.Tensor:
            absorbed = torch.bmm(qd[..., : mla.nope_dim].transpose(0, 1), key_up)
            q_latent = torch.cat((absorbed.transpose(0, 1), qd[..., mla.nope_dim :]), dim=-1)
            out = backend.decode_latent(  # type: ignore[attr-defined]
                kv_layer, q_latent, kept[:b], r, plan, opts
            )
            return torch.bmm(out.transpose(0, 1), value_up.transpose(1, 2)).transpose(0, 1)

        kv_layer, plan = self.cache.kv[j], step.decode
        return self._attend(
            q,
            step,
            final,
            decode,
            lambda qc, c: backend.prefill_latent(  # type: ignore[attr-defined]
                kv_layer, qc, kept[c.lo : c.hi], expand, c.plan, opts
            ),
        )

    # -- MLPs ---------------------------------------------------------------------------

    def _mlp(self, w: MLPWeights, h: torch.Tensor, bias: bool = True) -> torch.Tensor:
        gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return F.linear(self.act(gate).mul_(up), w.down, w.down_bias if bias else None)

    def _route(self, w: MoEWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's `top_k` experts `[T, k]` and their weights `[T, k]` (float32)."""
        moe = self.arch.moe
        assert moe is not None
        logits = F.linear(h.float() if moe.router_fp32 else h, w.router)
        if moe.scoring == "softmax":
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(probs, moe.top_k, dim=-1)
            if moe.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return experts, weights
        # DeepSeek-V3: sigmoid scores; experts chosen by score plus a selection bias,
        # only from the `topk_group` groups whose two best experts score highest.
        scores = logits.float().sigmoid()
        choice = scores + w.selection_bias if w.selection_bias is not None else scores
        t, e, g = scores.shape[0], moe.num_experts, moe.num_groups
        group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        allowed = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e).bool()
        choice = choice.masked_fill(~allowed, float("-inf"))
        experts = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if moe.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * moe.scale

    def _experts(self, w: MoEWeights, h: torch.Tensor) -> torch.Tensor:
        """The mixture of experts over all the step's tokens at once: the (token,
        expert) pairs are sorted by expert, so each expert that got tokens runs one
        gate/up and one down matmul over all of them; the results are weighted and
        summed back into their tokens with one `index_add_`.

        A tensor-parallel rank runs only the experts it holds (`self.experts`, a
        contiguous run, so their pairs are one run of the sorted order) and its share of
        the shared expert: a partial sum, which the caller all-reduces."""
        moe = self.arch.moe
        assert moe is not None
        experts, weights = self._route(w, h)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        held = self.experts
        lo = sum(counts[: held.start])
        order = order[lo : lo + sum(counts[held.start : held.stop])]
        token_of = order // moe.top_k
        rows = h.index_select(0, token_of)
        outs = []
        start = 0
        for e in held:
            n = counts[e]
            if not n:
                continue
            j = e - held.start
            gate, up = F.linear(rows[start : start + n], w.gate_up[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act(gate).mul_(up), w.down[j]))
            start += n
        out = torch.zeros_like(h)
        if outs:
            weighted = torch.cat(outs) * weights.flatten()[order, None].to(h.dtype)
            out.index_add_(0, token_of, weighted)
        if w.shared is not None:
            out = out + self._mlp(w.shared, h, bias=self.tp is None)
        return out
