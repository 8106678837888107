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

Version 2 adds what other engines' published models need, every new field defaulting
to "absent" so that a version-1 file means exactly what it meant:

- prefill in passes of at most `max_pass_tokens` tokens (0: one pass), each pass
  paying `base` and a term quadratic in its own size, `per_token_sq * pass**2`
  (engines whose fitted curve ignores the cached context, such as Dynamo's mocker);
- decode as a function of KV utilisation `u = context / kv_capacity_tokens`:
  `+ per_util * u + per_util_sq * u**2`, never below `floor_s`;
- `block_size`: the engine's KV block size, when the model is tied to one;
- `hidden_bytes_per_token`: the size of one token's hidden state, what a pipeline
  stage hands the next one per token (0: unknown, a hand-off costs `setup_s`).

A prompt prefilled over a group of pipeline stages (chunked pipeline parallelism,
`pipeline_prefill_s`) is cut into chunks that flow through the stages in order:
chunk k on stage s starts once stage s finished chunk k-1 and stage s-1 handed it
chunk k, and takes that stage's share of the layers times the whole model's time for
the chunk at its context (`prefill_s(chunk, cached + tokens before it)`). So the
pipeline fills, then advances one chunk per slowest-stage chunk time.

Version 3 adds tensor parallelism (`tensor_parallel`, `TensorParallelCost`): the
prefill and decode coefficients describe an instance of `degree` ranks and the
transfer bandwidths one of `transfer_lanes` data-plane lanes (1 and 1 by default: a
file without the section, and every `yb profile` fit, describes one device and one
lane). An instance announces its own degree and lanes (`InstanceUp`), and
`at_degree` prices it there:

- times measured at that degree (`measured`), where the file carries them;
- else each rank does `1/n` of the work, plus the all-reduces the ranks add: two per
  layer (after attention and after the MLP) of the hidden state of every token in
  the pass. A ring all-reduce of `B` bytes over `n` ranks takes `latency + B ·
  2(n-1)/n / bus bandwidth`. So with `r = degree / n` and `A(n)` the all-reduce
  cost at `n` ranks (zero at 1, and zero when the file gives no `layers` or no
  bandwidth), a coefficient `c` measured at `degree` becomes `(c - A(degree)) · r +
  A(n)`: per token (prefill `per_token`, decode `per_seq`) the bytes term, per pass
  (decode `base`, which is reading the weights; prefill `base`, a fixed overhead
  that does not shrink with ranks) the latency term. Attention (`per_pair`,
  `per_context_token`), the squared term and the KV-utilisation terms scale by `r`
  alone: they move no hidden state;
- the decode KV room (`kv_capacity_tokens`) is the devices' memory less the weights
  (`weight_bytes`, held once per instance whatever its degree): the file's room plus
  the weights, times `n / degree`, less the weights (in proportion when the weights
  are not given);
- a prefix load moves `lanes / transfer_lanes` times the bandwidth (each lane an
  endpoint of its own; the fixed cost is paid once, the lanes run side by side).

An instance at the file's own degree and lanes is priced by the file itself, so a
log recorded before tensor parallelism (every instance at 1 and 1, a cost model
without the section) decides exactly as it did.

The file is JSON, versioned (`version`); a reader refuses a newer version instead
of guessing, and a model is saved with the lowest version that expresses it, so a
plain `yb profile` fit stays readable by version-1 conductors. `load_cost_model("")`
is the built-in default (fitted on the development machine with the default model);
named built-in profiles ship as JSON files beside this module (`profiles/`), each
documenting in its `notes` how it was derived.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Final, Protocol

import msgspec

from yb_core import events as ev

# The newest file version this reader understands.
COST_MODEL_VERSION: Final = 3


class PrefillCost(msgspec.Struct, kw_only=True):
    """Prefill seconds = base + per_token*new + per_pair*new*(cached + new/2).

    Version 2: with `max_pass_tokens` the prompt runs in passes of at most that many
    tokens, each paying `base_s` and `per_token_sq_s * pass**2` (0 and 0 in version 1).
    """

    base_s: float
    per_token_s: float
    per_pair_s: float
    per_token_sq_s: float = 0.0
    max_pass_tokens: int = 0


class DecodeCost(msgspec.Struct, kw_only=True):
    """Seconds per decode step = base + per_seq*batch + per_context_token*context.

    Version 2: `+ per_util_s*u + per_util_sq_s*u**2` with `u = context /
    kv_capacity_tokens` (the instance's KV utilisation), and at least `floor_s`.
    `kv_capacity_tokens` is also the KV room of one decode instance when the model
    knows it (0: unknown).
    """

    base_s: float
    per_seq_s: float
    per_context_token_s: float
    per_util_s: float = 0.0
    per_util_sq_s: float = 0.0
    floor_s: float = 0.0
    kv_capacity_tokens: int = 0


class TransferCost(msgspec.Struct, kw_only=True):
    """Bandwidths (GB/s) per tier and locality, and a fixed cost per contiguous run."""

    setup_s: float = 0.0005
    dram_local_gbps: float = 10.0
    dram_remote_gbps: float = 5.0
    ssd_local_gbps: float = 2.0
    ssd_remote_gbps: float = 1.5


class DegreeCost(msgspec.Struct, kw_only=True):
    """Prefill and decode coefficients measured on an instance of `tensor_parallel`
    ranks (version 3): `CostModel.at_degree` takes them as they are."""

    tensor_parallel: int
    prefill: PrefillCost
    decode: DecodeCost


class TensorParallelCost(msgspec.Struct, kw_only=True):
    """The degree the coefficients describe and what another degree changes
    (version 3; see the module docstring).

    `degree`: ranks of the instance the prefill and decode coefficients were measured
    on; `transfer_lanes`: data-plane lanes the transfer bandwidths were measured over.
    `layers`: layers whose outputs are all-reduced (two all-reduces each);
    `allreduce_gbps`: the all-reduce's bus bandwidth, GB/s (nccl-tests' `busbw`);
    `allreduce_latency_s`: the fixed cost of one all-reduce. Either of the first two
    at 0 makes the all-reduces free. `weight_bytes`: the model's weights (0: KV room
    scales with the degree). `measured`: coefficients measured at other degrees.
    """

    degree: int = 1
    transfer_lanes: int = 1
    layers: int = 0
    allreduce_gbps: float = 0.0
    allreduce_latency_s: float = 0.0
    weight_bytes: int = 0
    measured: list[DegreeCost] = msgspec.field(default_factory=list)


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
    block_size: int = 0
    hidden_bytes_per_token: int = 0
    tensor_parallel: TensorParallelCost = msgspec.field(default_factory=TensorParallelCost)
    notes: list[str] = msgspec.field(default_factory=list)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` already in pages."""
        if new_tokens <= 0:
            return 0.0
        p = self.prefill
        # Evaluated exactly as version 1 did (a replay compares decisions bit for bit),
        # version-2 terms only added on top. The attention term does not depend on
        # how the prompt is cut into passes: summed over passes, pass * (cached before
        # it + pass / 2) is always new * (cached + new / 2); only `base` and the
        # squared term count passes.
        t = (
            p.base_s
            + p.per_token_s * new_tokens
            + p.per_pair_s * new_tokens * (cached_tokens + new_tokens * 0.5)
        )
        step = p.max_pass_tokens
        if step <= 0 or new_tokens <= step:
            if p.per_token_sq_s:
                t += p.per_token_sq_s * new_tokens * new_tokens
            return t
        full, rest = divmod(new_tokens, step)
        passes = full + (1 if rest else 0)
        return t + (passes - 1) * p.base_s + p.per_token_sq_s * (full * step * step + rest * rest)

    def pipeline_prefill_s(
        self,
        new_tokens: int,
        cached_tokens: int,
        shares: Sequence[float],
        chunk_tokens: int,
    ) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` over pipeline
        stages holding `shares` of the layers (in order), in chunks of `chunk_tokens`
        (see the module docstring): the last stage's finish of the last chunk."""
        if new_tokens <= 0:
            return 0.0
        chunk = chunk_tokens if chunk_tokens > 0 else new_tokens
        handoff = self.handoff_s(min(chunk, new_tokens))
        finish = [0.0] * len(shares)
        done = 0
        while done < new_tokens:
            n = min(chunk, new_tokens - done)
            whole = self.prefill_s(n, cached_tokens + done)
            ready = 0.0  # when this chunk's hidden states reach the next stage
            for s, share in enumerate(shares):
                start = finish[s] if finish[s] > ready else ready
                finish[s] = start + whole * share
                ready = finish[s] + handoff
            done += n
        return finish[-1]

    def handoff_s(self, tokens: int) -> float:
        """Seconds to hand one chunk of `tokens` hidden states to the next stage."""
        nbytes = tokens * self.hidden_bytes_per_token
        return self.transfer.setup_s + nbytes / (self.transfer.dram_remote_gbps * 1e9)

    def tbt_s(self, batch: int, context_tokens: int) -> float:
        """Seconds between tokens for a batch of `batch` sequences of `context_tokens`."""
        if batch <= 0:
            return 0.0
        d = self.decode
        t = d.base_s + d.per_seq_s * batch + d.per_context_token_s * context_tokens
        if d.kv_capacity_tokens and (d.per_util_s or d.per_util_sq_s):
            u = context_tokens / d.kv_capacity_tokens
            t += d.per_util_s * u + d.per_util_sq_s * u * u
        if d.floor_s and t < d.floor_s:
            return d.floor_s
        return t

    def decode_steps_s(self, batch: int, context_tokens: int, steps: int) -> float:
        """Seconds for `steps` decode steps of a fixed batch whose context grows by
        `batch` tokens a step (the first step at `context_tokens`).

        A closed form (the step time is a polynomial of degree <= 2 in the context),
        so a simulator can jump over thousands of steps at once; summed step by step
        only where `floor_s` may bind.
        """
        if steps <= 0 or batch <= 0:
            return 0.0
        d = self.decode
        alpha = d.base_s + d.per_seq_s * batch
        beta = d.per_context_token_s
        gamma = 0.0
        if d.kv_capacity_tokens and (d.per_util_s or d.per_util_sq_s):
            beta += d.per_util_s / d.kv_capacity_tokens
            gamma = d.per_util_sq_s / (d.kv_capacity_tokens * d.kv_capacity_tokens)
        c0 = float(context_tokens)
        last = c0 + batch * (steps - 1)
        if d.floor_s > 0.0 and self._may_floor(alpha, beta, gamma, c0, last):
            return math.fsum(self.tbt_s(batch, int(c0) + batch * i) for i in range(steps))
        n = float(steps)
        b = float(batch)
        sum_i = n * (n - 1.0) * 0.5
        sum_i2 = (n - 1.0) * n * (2.0 * n - 1.0) / 6.0
        total = n * alpha + beta * (n * c0 + b * sum_i)
        if gamma:
            total += gamma * (n * c0 * c0 + 2.0 * c0 * b * sum_i + b * b * sum_i2)
        return total

    def _may_floor(self, alpha: float, beta: float, gamma: float, lo: float, hi: float) -> bool:
        """Whether the step-time polynomial dips to the floor anywhere in [lo, hi]."""
        floor = self.decode.floor_s
        points = [lo, hi]
        if gamma > 0.0:
            vertex = -beta / (2.0 * gamma)
            if lo < vertex < hi:
                points.append(vertex)
        return any(alpha + beta * c + gamma * c * c <= floor for c in points)

    def at_degree(self, tensor_parallel: int, transfer_lanes: int) -> CostModel:
        """This model for an instance of `tensor_parallel` ranks moving KV over
        `transfer_lanes` lanes (see the module docstring): itself at its own degree
        and lanes. Values below 1 count as 1."""
        tp = self.tensor_parallel
        n = tensor_parallel if tensor_parallel > 1 else 1
        lanes = transfer_lanes if transfer_lanes > 1 else 1
        if n == tp.degree and lanes == tp.transfer_lanes:
            return self
        prefill, decode = self.prefill, self.decode
        if n != tp.degree:
            prefill, decode = self._compute_at(n)
        transfer = self.transfer
        if lanes != tp.transfer_lanes:
            f = lanes / tp.transfer_lanes
            transfer = msgspec.structs.replace(
                transfer,
                dram_local_gbps=transfer.dram_local_gbps * f,
                dram_remote_gbps=transfer.dram_remote_gbps * f,
                ssd_local_gbps=transfer.ssd_local_gbps * f,
                ssd_remote_gbps=transfer.ssd_remote_gbps * f,
            )
        return msgspec.structs.replace(
            self,
            prefill=prefill,
            decode=decode,
            transfer=transfer,
            tensor_parallel=msgspec.structs.replace(tp, degree=n, transfer_lanes=lanes),
        )

    def allreduce_s(self, ranks: int) -> tuple[float, float]:
        """What the all-reduces of one pass over `ranks` ranks add: seconds per token
        in the pass, and fixed seconds per pass (0 and 0 on one rank)."""
        tp = self.tensor_parallel
        if ranks <= 1 or tp.layers <= 0:
            return 0.0, 0.0
        count = 2 * tp.layers
        per_token = 0.0
        if tp.allreduce_gbps > 0.0:
            ring = 2.0 * (ranks - 1) / ranks
            per_token = count * self.hidden_bytes_per_token * ring / (tp.allreduce_gbps * 1e9)
        return per_token, count * tp.allreduce_latency_s

    def kv_capacity_at(self, ranks: int) -> int:
        """Decode KV room, tokens, of an instance of `ranks` ranks (0: unknown; at least
        1 where it is known: an instance whose weights leave no room holds a token)."""
        tp = self.tensor_parallel
        room = self.decode.kv_capacity_tokens
        if not room or ranks == tp.degree:
            return room
        weights, per_token = tp.weight_bytes, self.kv_bytes_per_token
        if weights and per_token:
            memory = (room * per_token + weights) * ranks / tp.degree
            return max(1, int((memory - weights) // per_token))
        return max(1, room * ranks // tp.degree)

    def _compute_at(self, n: int) -> tuple[PrefillCost, DecodeCost]:
        """Prefill and decode coefficients at `n` ranks: measured, else modelled."""
        tp = self.tensor_parallel
        for m in tp.measured:
            if m.tensor_parallel == n:
                return m.prefill, m.decode
        r = tp.degree / n
        token_p, pass_p = self.allreduce_s(tp.degree)
        token_n, pass_n = self.allreduce_s(n)
        p, d = self.prefill, self.decode
        prefill = msgspec.structs.replace(
            p,
            base_s=max(0.0, p.base_s - pass_p) + pass_n,
            per_token_s=max(0.0, p.per_token_s - token_p) * r + token_n,
            per_pair_s=p.per_pair_s * r,
            per_token_sq_s=p.per_token_sq_s * r,
        )
        room = self.kv_capacity_at(n)
        # The utilisation terms are in u = context / room: r times the time at a
        # context, over the new room.
        grow = room / d.kv_capacity_tokens if d.kv_capacity_tokens else 1.0
        decode = msgspec.structs.replace(
            d,
            base_s=max(0.0, d.base_s - pass_p) * r + pass_n,
            per_seq_s=max(0.0, d.per_seq_s - token_p) * r + token_n,
            per_context_token_s=d.per_context_token_s * r,
            per_util_s=d.per_util_s * r * grow,
            per_util_sq_s=d.per_util_sq_s * r * grow * grow,
            kv_capacity_tokens=room,
        )
        return prefill, decode

    def min_version(self) -> int:
        """The lowest file version that expresses this model."""
        if self.tensor_parallel != TensorParallelCost():
            return 3
        p, d = self.prefill, self.decode
        v2 = (
            p.per_token_sq_s
            or p.max_pass_tokens
            or d.per_util_s
            or d.per_util_sq_s
            or d.floor_s
            or d.kv_capacity_tokens
            or self.block_size
            or self.hidden_bytes_per_token
        )
        return 2 if v2 else 1

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

    def load_s(
        self, blocks: int, block_size: int, tier: ev.Tier, remote: bool, share: float = 1.0
    ) -> float:
        """Seconds to bring `blocks` blocks from `tier` into a prefill engine's pages
        (`share`: the part of each block's layers it loads, a pipeline stage's)."""
        if blocks <= 0 or tier == "engine":
            return 0.0
        gbps = self.bandwidth_gbps(tier, remote)
        nbytes = blocks * block_size * self.kv_bytes_per_token
        if share != 1.0:
            return self.transfer.setup_s + nbytes * share / (gbps * 1e9)
        return self.transfer.setup_s + nbytes / (gbps * 1e9)


class CostModelError(ValueError):
    """A cost model file that cannot be used."""


class Shaped(Protocol):
    """What prices an instance beyond the model: its ranks and its transfer lanes."""

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def transfer_lanes(self) -> int: ...


class DegreeCosts:
    """One cost model at every (degree, lanes) that instances announce, each derived
    once (`CostModel.at_degree`). The conductor adjusts the model's KV size in place
    when engines announce theirs (`Conductor._price_kv`): the derived models follow."""

    __slots__ = ("_at", "_kv_bytes", "model")

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._at: dict[tuple[int, int], CostModel] = {}
        self._kv_bytes = model.kv_bytes_per_token

    def at(self, tensor_parallel: int, transfer_lanes: int) -> CostModel:
        """The model at that degree and those lanes."""
        model = self.model
        if model.kv_bytes_per_token != self._kv_bytes:
            self._at.clear()
            self._kv_bytes = model.kv_bytes_per_token
        key = (tensor_parallel, transfer_lanes)
        found = self._at.get(key)
        if found is None:
            found = self._at[key] = model.at_degree(tensor_parallel, transfer_lanes)
        return found

    def of(self, inst: Shaped) -> CostModel:
        """The model for one instance, at the degree and lanes it announced."""
        return self.at(inst.tensor_parallel, inst.transfer_lanes)


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

# Named profiles shipped as files beside this module (see `profiles/README.md`).
PROFILE_NAMES: tuple[str, ...] = ("llama2-70b-a800", "dynamo-mocker")


def _profile(name: str) -> CostModel:
    raw = resources.files("yb_conductor").joinpath("profiles", f"{name}.json").read_bytes()
    return msgspec.json.decode(raw, type=CostModel)


BUILTIN: dict[str, CostModel] = {DEFAULT.name: DEFAULT}
BUILTIN.update((name, _profile(name)) for name in PROFILE_NAMES)
LLAMA2_70B_A800 = BUILTIN["llama2-70b-a800"]
DYNAMO_MOCKER = BUILTIN["dynamo-mocker"]


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
    """Write a cost model as indented JSON, stamped with the lowest version that
    expresses it (a version-1 reader can then still read a plain fit)."""
    stamped = msgspec.structs.replace(model, version=model.min_version())
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(stamped), indent=2) + b"\n")


class _Versioned(msgspec.Struct):
    version: int = COST_MODEL_VERSION
