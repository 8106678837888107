"""The runner's own parameter containers, fused for fewer, larger matmuls.

q/k/v are concatenated into one projection and gate/up into another: on a CPU each
`F.linear` call has a fixed cost and a wider GEMM uses the cores better, and on a GPU it
is one kernel launch instead of three. A mixture of experts stacks its experts into two
3-d tensors, so a step runs one matmul per expert it routed tokens to. A layer holds an
attention (grouped-query or latent) and an MLP (dense or experts), and the norms where
its family puts them. `to_hf_state_dict` undoes the fusion of a Llama-layout model, so a
reference transformers model can be built from exactly these numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from yb_engine.architecture import ArchConfig, LayerRange
from yb_engine.families import family_named
from yb_engine.tensor_parallel import Shard

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class AttentionWeights:
    """Grouped-query attention: fused q/k/v and the output projection, with the
    per-head (or full-width) q/k norms of families that have them."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LatentAttentionWeights:
    """Multi-head latent attention (DeepSeek): the query path (`q` directly, or the
    low-rank `q_a` -> norm -> `q_b`), the latent down-projection fused with the shared
    rotary key (`kv_a`), its norm, the up-projection to per-head keys and values
    (`kv_b`), and the output projection."""

    q: torch.Tensor | None
    q_a: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o: torch.Tensor
    o_bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class MLPWeights:
    """A gated MLP: fused gate/up projection, then down."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """A mixture of experts: the router `[experts, hidden]` (and DeepSeek's selection
    bias `[experts]`), every expert's fused gate/up `[experts, 2 * inter, hidden]` and
    down `[experts, hidden, inter]` stacked, and an always-on shared expert."""

    router: torch.Tensor
    selection_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    shared: MLPWeights | None = None


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer: its attention and MLP, and the norms where its family puts
    them (None where it has none): before attention (`attn_norm`), after it
    (`post_attn_norm`), before the MLP (`mlp_norm`), after it (`post_mlp_norm`)."""

    attn: AttentionWeights | LatentAttentionWeights
    mlp: MLPWeights | MoEWeights
    attn_norm: torch.Tensor | None
    mlp_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter of the layer."""
        found: list[torch.Tensor] = []

        def walk(obj: object) -> None:
            for name in getattr(obj, "__slots__", ()):
                value = getattr(obj, name)
                if isinstance(value, torch.Tensor):
                    found.append(value)
                elif value is not None and hasattr(value, "__slots__"):
                    walk(value)

        walk(self)
        return found


#: Where each norm of a layer lies, relative to `model.layers.N.`, per norm layout.
_NORM_NAMES: dict[str, dict[str, str]] = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {
        "attn_norm": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    },
    "post": {
        "post_attn_norm": "post_attention_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    },
}


class _TensorReader:
    """Reads Hugging Face-named tensors from `state` onto the device, fusing per layer.

    `state` may be lazy (the loader's view of a safetensors file): a tensor is read when
    it is asked for, so a pipeline stage reads only its own. A tensor read only to be
    fused is taken with `state.copy_of(name)` where the state offers it (the loader's
    does: such a tensor is read into memory of its own instead of through the file's
    map, whose pages would otherwise stay resident beside the fused copy).

    With a tensor-parallel `shard`, each tensor is cut to the rank's share as it is read
    (`yb_engine.tensor_parallel`): only the rows or columns of the share are copied
    out of the file's map, so a rank holds its share and no more.
    """

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        shard: Shard | None = None,
    ) -> None:
        self.state = state
        self.dtype = dtype
        self.device = device
        self.shard = shard if shard is not None and shard.size > 1 else None

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.state[name]
        except KeyError:
            raise KeyError(f"checkpoint lacks {name!r}") from None

    def part(self, name: str) -> torch.Tensor:
        """A tensor that is only read to build a fused one."""
        copy_of = getattr(self.state, "copy_of", None)
        if copy_of is None or name not in self.state:
            return self.get(name)
        part: torch.Tensor = copy_of(name)
        return part

    def place(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def put(self, name: str) -> torch.Tensor:
        return self.place(self.get(name))

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.put(name) if name in self.state else None

    def fused(self, names: list[str]) -> torch.Tensor:
        return self.place(torch.cat([self.part(n) for n in names]))

    # -- a rank's share ---------------------------------------------------------------

    def rows(self, name: str, share: range, per: int, offset: int = 0) -> torch.Tensor:
        """Rows `[offset + share.start * per, offset + share.stop * per)` of `name`."""
        t = self.get(name)
        return t[offset + share.start * per : offset + share.stop * per]

    def cols(self, name: str, share: range, per: int) -> torch.Tensor:
        """Columns `[share.start * per, share.stop * per)` of `name`."""
        t = self.get(name)
        return t[:, share.start * per : share.stop * per]

    def cut_rows(self, names: list[str], shares: list[tuple[range, int]]) -> torch.Tensor:
        """Each of `names` cut to its rows (`(share, per)`), fused."""
        return self.place(
            torch.cat([self.rows(n, r, per) for n, (r, per) in zip(names, shares, strict=True)])
        )

    def layer(self, arch: ArchConfig, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        norms = {
            field: self.put(p + name + ".weight")
            for field, name in _NORM_NAMES[arch.norm_layout].items()
        }
        attn = self.latent_attention(arch, p) if arch.mla else self.attention(arch, p)
        if arch.is_sparse(i):
            mlp: MLPWeights | MoEWeights = self.experts(arch, p)
        elif family_named(arch.family).fused_checkpoint and self.shard is not None:
            name = p + "mlp.gate_up_proj.weight"
            share = self.shard.columns(arch.intermediate)
            mlp = MLPWeights(
                gate_up=self.place(
                    torch.cat(
                        [self.rows(name, share, 1), self.rows(name, share, 1, arch.intermediate)]
                    )
                ),
                gate_up_bias=None,
                down=self.place(self.cols(p + "mlp.down_proj.weight", share, 1)),
                down_bias=None,
            )
        elif family_named(arch.family).fused_checkpoint:
            mlp = MLPWeights(
                gate_up=self.put(p + "mlp.gate_up_proj.weight"),
                gate_up_bias=None,
                down=self.put(p + "mlp.down_proj.weight"),
                down_bias=None,
            )
        else:
            mlp = self.mlp(p + "mlp.", arch.mlp_bias)
        return LayerWeights(
            attn=attn,
            mlp=mlp,
            attn_norm=norms.get("attn_norm"),
            mlp_norm=norms.get("mlp_norm"),
            post_attn_norm=norms.get("post_attn_norm"),
            post_mlp_norm=norms.get("post_mlp_norm"),
        )

    def attention(self, arch: ArchConfig, p: str) -> AttentionWeights:
        a = p + "self_attn."
        if self.shard is not None:
            return self._attention_share(arch, a, self.shard)
        if family_named(arch.family).fused_checkpoint:  # Phi-3: fused as we fuse them
            return AttentionWeights(
                qkv=self.put(a + "qkv_proj.weight"),
                qkv_bias=None,
                o=self.put(a + "o_proj.weight"),
                o_bias=None,
            )
        qkv_bias = None
        if arch.qkv_bias:
            qkv_bias = self.fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        return AttentionWeights(
            qkv=self.fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            qkv_bias=qkv_bias,
            o=self.put(a + "o_proj.weight"),
            o_bias=self.put(a + "o_proj.bias") if arch.o_bias else None,
            q_norm=self.put(a + "q_norm.weight") if arch.qk_norm else None,
            k_norm=self.put(a + "k_norm.weight") if arch.qk_norm else None,
        )

    def _attention_share(self, arch: ArchConfig, a: str, shard: Shard) -> AttentionWeights:
        """The rank's query heads and the KV heads they read: q/k/v by rows, the output
        projection by columns (its bias whole: it is added once, after the sum)."""
        d = arch.head_dim
        qh, kvh = shard.q_heads(arch), shard.kv_heads(arch)
        cuts = [(qh, d), (kvh, d), (kvh, d)]
        if family_named(arch.family).fused_checkpoint:  # Phi-3: q, k, v in one tensor
            name = a + "qkv_proj.weight"
            q, kv = arch.q_size, arch.kv_size
            qkv = self.place(
                torch.cat(
                    [
                        self.rows(name, qh, d),
                        self.rows(name, kvh, d, offset=q),
                        self.rows(name, kvh, d, offset=q + kv),
                    ]
                )
            )
            return AttentionWeights(
                qkv=qkv,
                qkv_bias=None,
                o=self.place(self.cols(a + "o_proj.weight", qh, d)),
                o_bias=None,
            )
        projections = [a + "q_proj", a + "k_proj", a + "v_proj"]
        qkv_bias = None
        if arch.qkv_bias:
            qkv_bias = self.cut_rows([n + ".bias" for n in projections], cuts)
        return AttentionWeights(
            qkv=self.cut_rows([n + ".weight" for n in projections], cuts),
            qkv_bias=qkv_bias,
            o=self.place(self.cols(a + "o_proj.weight", qh, d)),
            o_bias=self.put(a + "o_proj.bias") if arch.o_bias else None,
            q_norm=self.put(a + "q_norm.weight") if arch.qk_norm else None,
            k_norm=self.put(a + "k_norm.weight") if arch.qk_norm else None,
        )

    def latent_attention(self, arch: ArchConfig, p: str) -> LatentAttentionWeights:
        a = p + "self_attn."
        mla = arch.mla
        assert mla is not None
        low_rank = mla.q_lora_rank is not None
        if self.shard is None:
            q = None if low_rank else self.put(a + "q_proj.weight")
            q_b = self.put(a + "q_b_proj.weight") if low_rank else None
            kv_b, o = self.put(a + "kv_b_proj.weight"), self.put(a + "o_proj.weight")
        else:
            # The rank's heads of every per-head projection; the latent's own
            # projection (`kv_a`) and the query bottleneck (`q_a`) are whole.
            heads = self.shard.q_heads(arch)
            q_name = a + ("q_b_proj.weight" if low_rank else "q_proj.weight")
            q_share = self.place(self.rows(q_name, heads, mla.qk_dim))
            q, q_b = (None, q_share) if low_rank else (q_share, None)
            kv_b = self.place(self.rows(a + "kv_b_proj.weight", heads, mla.nope_dim + mla.v_dim))
            o = self.place(self.cols(a + "o_proj.weight", heads, mla.v_dim))
        return LatentAttentionWeights(
            q=q,
            q_a=self.put(a + "q_a_proj.weight") if low_rank else None,
            q_a_norm=self.put(a + "q_a_layernorm.weight") if low_rank else None,
            q_b=q_b,
            kv_a=self.put(a + "kv_a_proj_with_mqa.weight"),
            kv_a_norm=self.put(a + "kv_a_layernorm.weight"),
            kv_b=kv_b,
            o=o,
            o_bias=self.maybe(a + "o_proj.bias"),
        )

    def mlp(self, m: str, bias: bool, names: tuple[str, str, str] | None = None) -> MLPWeights:
        gate, up, down = names or (m + "gate_proj", m + "up_proj", m + "down_proj")
        if self.shard is not None:
            width = self.get(gate + ".weight").shape[0]
            share = [(self.shard.columns(width), 1)] * 2
            return MLPWeights(
                gate_up=self.cut_rows([gate + ".weight", up + ".weight"], share),
                gate_up_bias=(
                    self.cut_rows([gate + ".bias", up + ".bias"], share) if bias else None
                ),
                down=self.place(self.cols(down + ".weight", self.shard.columns(width), 1)),
                down_bias=self.put(down + ".bias") if bias else None,
            )
        return MLPWeights(
            gate_up=self.fused([gate + ".weight", up + ".weight"]),
            gate_up_bias=self.fused([gate + ".bias", up + ".bias"]) if bias else None,
            down=self.put(down + ".weight"),
            down_bias=self.put(down + ".bias") if bias else None,
        )

    def experts(self, arch: ArchConfig, p: str) -> MoEWeights:
        moe, names = arch.moe, family_named(arch.family).experts
        assert moe is not None and names is not None
        # A tensor-parallel rank holds whole experts, its share of them.
        experts = self.shard.experts(arch) if self.shard is not None else range(moe.num_experts)
        gate_up = torch.stack(
            [
                torch.cat(
                    [self.part(p + names.gate.format(e=e)), self.part(p + names.up.format(e=e))]
                )
                for e in experts
            ]
        )
        down = torch.stack([self.part(p + names.down.format(e=e)) for e in experts])
        router_dtype = torch.float32 if moe.router_fp32 else self.dtype
        shared = None
        if moe.shared_intermediate:
            shared = self.mlp(p + names.shared, False)
        return MoEWeights(
            router=self.place(self.get(p + names.router), router_dtype),
            selection_bias=(
                self.place(self.get(p + names.selection_bias), torch.float32)
                if moe.selection_bias
                else None
            ),
            gate_up=self.place(gate_up),
            down=self.place(down),
            shared=shared,
        )

    def embed(self, arch: ArchConfig) -> torch.Tensor:
        """The embedding rows (a tensor-parallel rank's: its share of the vocabulary)."""
        if self.shard is None:
            return self.put(EMBED)
        return self.place(self.rows(EMBED, self.shard.vocab(arch), 1))

    def lm_head(self, arch: ArchConfig, embed: torch.Tensor | None) -> torch.Tensor:
        """The head: the embedding tensor itself when tied (read here if `embed` is None)."""
        if arch.tie_embeddings or LM_HEAD not in self.state:
            return embed if embed is not None else self.embed(arch)
        if self.shard is None:
            return self.put(LM_HEAD)
        return self.place(self.rows(LM_HEAD, self.shard.vocab(arch), 1))


def _count_distinct(tensors: Iterable[torch.Tensor | None]) -> int:
    """Elements of the distinct tensors (a tensor listed twice, like a tied head, counts once)."""
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() for t in unique.values())


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """All parameters; `lm_head` is the embedding tensor itself when embeddings are tied."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def from_hf_state_dict(
        cls,
        state: Mapping[str, torch.Tensor],
        arch: ArchConfig,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        shard: Shard | None = None,
    ) -> ModelWeights:
        """Fuse a Hugging Face state dict (names `model.layers.N...`) of any registered
        family; with a tensor-parallel `shard`, only that rank's share of it."""

        read = _TensorReader(state, dtype=dtype, device=device, shard=shard)
        embed = read.embed(arch)
        return cls(
            embed=embed,
            layers=tuple(read.layer(arch, i) for i in range(arch.num_layers)),
            final_norm=read.put(FINAL_NORM),
            lm_head=read.lm_head(arch, embed),
        )

    def to_hf_state_dict(self, arch: ArchConfig) -> dict[str, torch.Tensor]:
        """Split the fused tensors back into Hugging Face names (views, no copies), for a
        Llama-layout model (pre norms, grouped-query attention, dense gated MLPs: what
        `tiny_random_model` builds)."""
        if arch.mla is not None or arch.moe is not None or arch.norm_layout != "pre":
            raise ValueError(f"to_hf_state_dict covers Llama-layout models, not {arch.family}")
        q, kv = arch.q_size, arch.kv_size
        out: dict[str, torch.Tensor] = {
            EMBED: self.embed,
            FINAL_NORM: self.final_norm,
        }
        if not arch.tie_embeddings:
            out[LM_HEAD] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            attn, mlp = layer.attn, layer.mlp
            assert isinstance(attn, AttentionWeights) and isinstance(mlp, MLPWeights)
            assert layer.attn_norm is not None and layer.mlp_norm is not None
            out[p + "input_layernorm.weight"] = layer.attn_norm
            out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
            for name, t in zip(
                ("q_proj", "k_proj", "v_proj"), attn.qkv.split([q, kv, kv]), strict=True
            ):
                out[a + name + ".weight"] = t
            if attn.qkv_bias is not None:
                biases = attn.qkv_bias.split([q, kv, kv])
                for name, t in zip(("q_proj", "k_proj", "v_proj"), biases, strict=True):
                    out[a + name + ".bias"] = t
            out[a + "o_proj.weight"] = attn.o
            if attn.o_bias is not None:
                out[a + "o_proj.bias"] = attn.o_bias
            m = p + "mlp."
            gate, up = mlp.gate_up.chunk(2)
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = gate, up
            if mlp.gate_up_bias is not None:
                gb, ub = mlp.gate_up_bias.chunk(2)
                out[m + "gate_proj.bias"], out[m + "up_proj.bias"] = gb, ub
            out[m + "down_proj.weight"] = mlp.down
            if mlp.down_bias is not None:
                out[m + "down_proj.bias"] = mlp.down_bias
        return out

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head is counted once)."""
        layer_tensors = (t for layer in self.layers for t in layer.tensors())
        return _count_distinct((self.embed, self.final_norm, self.lm_head, *layer_tensors))


@dataclass(frozen=True, slots=True)
class StageWeights:
    """The parameters of one pipeline stage, layers `layer_range` of a model.

    `layers[j]` is the model's layer `layer_range.start + j`. `embed` is present on the
    first stage only; `final_norm` and `lm_head` on the last only (the head is the
    embedding tensor when embeddings are tied, read by the last stage for itself).
    """

    layer_range: LayerRange
    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor | None
    final_norm: torch.Tensor | None
    lm_head: torch.Tensor | None

    @classmethod
    def from_hf_state_dict(
        cls,
        state: Mapping[str, torch.Tensor],
        arch: ArchConfig,
        layer_range: LayerRange,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> StageWeights:
        """Fuse the stage's tensors of a Hugging Face state dict; reads no other tensor."""
        layer_range.check(arch)
        read = _TensorReader(state, dtype=dtype, device=device)
        embed = read.put(EMBED) if layer_range.is_first else None
        last = layer_range.is_last(arch)
        return cls(
            layer_range=layer_range,
            layers=tuple(read.layer(arch, i) for i in range(layer_range.start, layer_range.end)),
            embed=embed,
            final_norm=read.put(FINAL_NORM) if last else None,
            lm_head=read.lm_head(arch, embed) if last else None,
        )

    @classmethod
    def of_model(
        cls, weights: ModelWeights, arch: ArchConfig, layer_range: LayerRange
    ) -> StageWeights:
        """The stage's share of a whole model's weights (the same tensors, not copies)."""
        layer_range.check(arch)
        last = layer_range.is_last(arch)
        return cls(
            layer_range=layer_range,
            layers=weights.layers[layer_range.start : layer_range.end],
            embed=weights.embed if layer_range.is_first else None,
            final_norm=weights.final_norm if last else None,
            lm_head=weights.lm_head if last else None,
        )

    def num_parameters(self) -> int:
        """Distinct parameters the stage holds (a tied head is counted once)."""
        layer_tensors = (t for layer in self.layers for t in layer.tensors())
        return _count_distinct((self.embed, self.final_norm, self.lm_head, *layer_tensors))
