"""The runner's own parameter container, fused for fewer, larger matmuls.

q/k/v are concatenated into one projection and gate/up into another: on a CPU each
`F.linear` call has a fixed cost and a wider GEMM uses the cores better, and on a GPU it
is one kernel launch instead of three. `to_hf_state_dict` undoes the fusion, so a
reference transformers model can be built from exactly these numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from yb_engine.architecture import ArchConfig, LayerRange

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer: attention (fused qkv) and SwiGLU MLP (fused gate/up)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every parameter of the layer (None for an absent bias)."""
        return (
            self.attn_norm,
            self.qkv,
            self.qkv_bias,
            self.o,
            self.o_bias,
            self.mlp_norm,
            self.gate_up,
            self.gate_up_bias,
            self.down,
            self.down_bias,
        )


class _TensorReader:
    """Reads Hugging Face-named tensors from `state` onto the device, fusing per layer.

    `state` may be lazy (the loader's view of a safetensors file): a tensor is read when
    it is asked for, so a pipeline stage reads only its own. A tensor read only to be
    fused is taken with `state.copy_of(name)` where the state offers it (the loader's
    does: such a tensor is read into memory of its own instead of through the file's
    map, whose pages would otherwise stay resident beside the fused copy).
    """

    def __init__(
        self, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        self.state = state
        self.dtype = dtype
        self.device = device

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

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def put(self, name: str) -> torch.Tensor:
        return self.place(self.get(name))

    def layer(self, arch: ArchConfig, i: int) -> LayerWeights:
        get, put = self.part, self.place
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m = p + "mlp."
        qkv = torch.cat(
            [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]
        )
        qkv_bias = None
        if arch.qkv_bias:
            qkv_bias = put(
                torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            )
        gate_up = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
        gate_up_bias = None
        if arch.mlp_bias:
            gate_up_bias = put(torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]))
        return LayerWeights(
            attn_norm=self.put(p + "input_layernorm.weight"),
            qkv=put(qkv),
            qkv_bias=qkv_bias,
            o=self.put(a + "o_proj.weight"),
            o_bias=self.put(a + "o_proj.bias") if arch.o_bias else None,
            mlp_norm=self.put(p + "post_attention_layernorm.weight"),
            gate_up=put(gate_up),
            gate_up_bias=gate_up_bias,
            down=self.put(m + "down_proj.weight"),
            down_bias=self.put(m + "down_proj.bias") if arch.mlp_bias else None,
        )

    def lm_head(self, arch: ArchConfig, embed: torch.Tensor | None) -> torch.Tensor:
        """The head: the embedding tensor itself when tied (read here if `embed` is None)."""
        if arch.tie_embeddings or LM_HEAD not in self.state:
            return embed if embed is not None else self.put(EMBED)
        return self.put(LM_HEAD)


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
    ) -> ModelWeights:
        """Fuse a Hugging Face Llama/Qwen2 state dict (names `model.layers.N...`)."""

        read = _TensorReader(state, dtype=dtype, device=device)
        embed = read.put(EMBED)
        return cls(
            embed=embed,
            layers=tuple(read.layer(arch, i) for i in range(arch.num_layers)),
            final_norm=read.put(FINAL_NORM),
            lm_head=read.lm_head(arch, embed),
        )

    def to_hf_state_dict(self, arch: ArchConfig) -> dict[str, torch.Tensor]:
        """Split the fused tensors back into Hugging Face names (views, no copies)."""
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
            out[p + "input_layernorm.weight"] = layer.attn_norm
            out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
            wq, wk, wv = layer.qkv.split([q, kv, kv])
            out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = (
                wq,
                wk,
                wv,
            )
            if layer.qkv_bias is not None:
                bq, bk, bv = layer.qkv_bias.split([q, kv, kv])
                out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = bq, bk, bv
            out[a + "o_proj.weight"] = layer.o
            if layer.o_bias is not None:
                out[a + "o_proj.bias"] = layer.o_bias
            m = p + "mlp."
            gate, up = layer.gate_up.chunk(2)
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = gate, up
            if layer.gate_up_bias is not None:
                gb, ub = layer.gate_up_bias.chunk(2)
                out[m + "gate_proj.bias"], out[m + "up_proj.bias"] = gb, ub
            out[m + "down_proj.weight"] = layer.down
            if layer.down_bias is not None:
                out[m + "down_proj.bias"] = layer.down_bias
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
