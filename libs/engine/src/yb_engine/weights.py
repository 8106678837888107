"""The runner's own parameter container, fused for fewer, larger matmuls.

q/k/v are concatenated into one projection and gate/up into another: on a CPU each
`F.linear` call has a fixed cost and a wider GEMM uses the cores better, and on a GPU it
is one kernel launch instead of three. `to_hf_state_dict` undoes the fusion, so a
reference transformers model can be built from exactly these numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from yb_engine.architecture import ArchConfig


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

        def get(name: str) -> torch.Tensor:
            try:
                return state[name]
            except KeyError:
                raise KeyError(f"checkpoint lacks {name!r}") from None

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        def maybe(name: str, present: bool) -> torch.Tensor | None:
            return put(get(name)) if present else None

        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat(
                [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]
            )
            qkv_bias = None
            if arch.qkv_bias:
                qkv_bias = put(
                    torch.cat(
                        [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]
                    )
                )
            m = p + "mlp."
            gate_up = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            gate_up_bias = None
            if arch.mlp_bias:
                gate_up_bias = put(torch.cat([get(m + "gate_proj.bias"), get(m + "up_proj.bias")]))
            layers.append(
                LayerWeights(
                    attn_norm=put(get(p + "input_layernorm.weight")),
                    qkv=put(qkv),
                    qkv_bias=qkv_bias,
                    o=put(get(a + "o_proj.weight")),
                    o_bias=maybe(a + "o_proj.bias", arch.o_bias),
                    mlp_norm=put(get(p + "post_attention_layernorm.weight")),
                    gate_up=put(gate_up),
                    gate_up_bias=gate_up_bias,
                    down=put(get(m + "down_proj.weight")),
                    down_bias=maybe(m + "down_proj.bias", arch.mlp_bias),
                )
            )
        embed = put(get("model.embed_tokens.weight"))
        if arch.tie_embeddings or "lm_head.weight" not in state:
            lm_head = embed
        else:
            lm_head = put(state["lm_head.weight"])
        return cls(
            embed=embed,
            layers=tuple(layers),
            final_norm=put(get("model.norm.weight")),
            lm_head=lm_head,
        )

    def to_hf_state_dict(self, arch: ArchConfig) -> dict[str, torch.Tensor]:
        """Split the fused tensors back into Hugging Face names (views, no copies)."""
        q, kv = arch.q_size, arch.kv_size
        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
        }
        if not arch.tie_embeddings:
            out["lm_head.weight"] = self.lm_head
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
        tensors: dict[int, torch.Tensor] = {}
        for t in (self.embed, self.final_norm, self.lm_head):
            tensors[id(t)] = t
        for layer in self.layers:
            for t in (
                layer.attn_norm,
                layer.qkv,
                layer.o,
                layer.mlp_norm,
                layer.gate_up,
                layer.down,
            ):
                tensors[id(t)] = t
            for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias):
                if b is not None:
                    tensors[id(b)] = b
        return sum(t.numel() for t in tensors.values())
