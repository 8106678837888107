"""The engine cost model the scheduler estimates with: a versioned, fitted file.

Three questions, each a small closed form whose coefficients `yb profile` fits on the
real runner of the machine it runs on:

- prefill: seconds to compute `new` tokens on top of `cached` ones. Projections and
  MLP cost per new token; attention costs per (new token x attended token), and each
  new token attends to the cached prefix and, on average, half of the new tokens:
  `base + per_token * new + per_pair * new * (cached + new / 2)`.
- decode: time between tokens of a batch of `batch` sequences holding `context`
  tokens in total: weights are read once per step, KV once per context token:
  `base + per_seq * batch + per_context_token * context`.
- transfer: seconds to load `blocks` blocks from a tier, local (same host) or
  remote: `setup + bytes / bandwidth`, with bytes from the model's KV size per token.
  Blocks already in the engine's own cache cost nothing.

The file is JSON, versioned (`version`); a reader refuses a newer major version
instead of guessing. `load_cost_model("")` is the built-in default (fitted on the
development machine with the default model), and built-in names exist for the
paper's setting, so the conductor always has a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec

from yb_shared import events as ev

COST_MODEL_VERSION: Final = 1


class PrefillCost(msgspec.Struct, kw_only=True):
    """Prefill seconds = base + per_token*new + per_pair*new*(cached + new/2)."""

    base_s: float
    per_token_s: float
    per_pair_s: float


class DecodeCost(msgspec.Struct, kw_only=True):
    """Seconds per decode step = base + per_seq*batch + per_context_token*context."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float


class TransferCost(msgspec.Struct, kw_only=True):
    """Bandwidths (GB/s) per tier and locality, and a fixed cost per contiguous run."""

    setup_s: float = 0.0005
    dram_local_gbps: float = 10.0
    dram_remote_gbps: float = 5.0
    ssd_local_gbps: float = 2.0
    ssd_remote_gbps: float = 1.5


class FitReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How well the fit matched its own measurements (relative errors)."""

    prefill_samples: int = 0
    prefill_mean_rel_error: float = 0.0
    decode_samples: int = 0
    decode_mean_rel_error: float = 0.0
    memcpy_gbps: float = 0.0


class CostModel(msgspec.Struct, kw_only=True):
    """An engine's cost model; see the module docstring for the formulas."""

    version: int = COST_MODEL_VERSION
    name: str = "custom"
    model: str = ""
    device: str = ""
    source: str = ""
    kv_bytes_per_token: int
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost = msgspec.field(default_factory=TransferCost)
    fit: FitReport = msgspec.field(default_factory=FitReport)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` already in pages."""
        if new_tokens <= 0:
            return 0.0
        p = self.prefill
        return (
            p.base_s
            + p.per_token_s * new_tokens
            + p.per_pair_s * new_tokens * (cached_tokens + new_tokens * 0.5)
        )

    def tbt_s(self, batch: int, context_tokens: int) -> float:
        """Seconds between tokens for a batch of `batch` sequences of `context_tokens`."""
        if batch <= 0:
            return 0.0
        d = self.decode
        return d.base_s + d.per_seq_s * batch + d.per_context_token_s * context_tokens

    def bandwidth_gbps(self, tier: ev.Tier, remote: bool) -> float:
        """GB/s of loading from `tier`; 0 for the engine's own cache (free)."""
        t = self.transfer
        match tier:
            case "engine":
                return 0.0
            case "dram":
                return t.dram_remote_gbps if remote else t.dram_local_gbps
            case "ssd":
                return t.ssd_remote_gbps if remote else t.ssd_local_gbps
        return t.dram_remote_gbps

    def load_s(self, blocks: int, block_size: int, tier: ev.Tier, remote: bool) -> float:
        """Seconds to bring `blocks` blocks from `tier` into a prefill engine's pages."""
        if blocks <= 0 or tier == "engine":
            return 0.0
        gbps = self.bandwidth_gbps(tier, remote)
        nbytes = blocks * block_size * self.kv_bytes_per_token
        return self.transfer.setup_s + nbytes / (gbps * 1e9)


class CostModelError(ValueError):
    """A cost model file that cannot be used."""


# Fitted with `yb profile --quick` on the development machine (2 shared CPU cores,
# float32, SmolLM2-135M-Instruct, torch SDPA): the model `yb up` serves by default.
# Mean fit errors: prefill 16%, decode 10% (a shared machine is a noisy one).
DEFAULT = CostModel(
    name="default",
    model="SmolLM2-135M-Instruct",
    device="cpu x2 threads, float32",
    source="yb profile --quick on the development machine",
    kv_bytes_per_token=46080,
    prefill=PrefillCost(base_s=0.1147, per_token_s=0.001344, per_pair_s=1.12e-6),
    decode=DecodeCost(base_s=0.05167, per_seq_s=0.004541, per_context_token_s=6.9e-6),
    transfer=TransferCost(
        setup_s=0.0005,
        dram_local_gbps=8.958,
        dram_remote_gbps=4.0,
        ssd_local_gbps=1.238,
        ssd_remote_gbps=1.238,
    ),
)

# The paper's setting, approximately: LLaMA2-70B (GQA, 8 KV heads, fp16) on A800
# nodes with RDMA between hosts. Used by benchmarks and simulations of the traces.
LLAMA2_70B_A800 = CostModel(
    name="llama2-70b-a800",
    model="LLaMA2-70B",
    device="8xA800",
    source="approximation of Mooncake (arXiv 2407.00079) figures",
    kv_bytes_per_token=327680,
    prefill=PrefillCost(base_s=0.02, per_token_s=1.0 / 12000.0, per_pair_s=1.5e-10),
    decode=DecodeCost(base_s=0.025, per_seq_s=0.0004, per_context_token_s=5.0e-8),
    transfer=TransferCost(
        setup_s=0.0002,
        dram_local_gbps=40.0,
        dram_remote_gbps=20.0,
        ssd_local_gbps=6.0,
        ssd_remote_gbps=5.0,
    ),
)

BUILTIN: dict[str, CostModel] = {m.name: m for m in (DEFAULT, LLAMA2_70B_A800)}


def load_cost_model(spec: str | Path = "") -> CostModel:
    """A cost model from a built-in name ("" = default) or a JSON file written by
    `yb profile`. Raises `CostModelError` on an unreadable or too new file."""
    text = str(spec)
    if not text:
        return DEFAULT
    if text in BUILTIN:
        return BUILTIN[text]
    path = Path(text).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        known = ", ".join(sorted(BUILTIN))
        raise CostModelError(f"cost model {text!r}: not a file ({exc}); built-in: {known}") from exc
    try:
        version = msgspec.json.decode(raw, type=_Versioned).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CostModelError(f"cost model {path}: {exc}") from exc
    if version > COST_MODEL_VERSION:
        raise CostModelError(
            f"cost model {path} has version {version}; this conductor reads up to "
            f"{COST_MODEL_VERSION}"
        )
    try:
        return msgspec.json.decode(raw, type=CostModel)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CostModelError(f"cost model {path}: {exc}") from exc


def save_cost_model(model: CostModel, path: str | Path) -> None:
    """Write a cost model as indented JSON."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(model), indent=2) + b"\n")


class _Versioned(msgspec.Struct):
    version: int = COST_MODEL_VERSION
