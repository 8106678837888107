"""Every registered family against transformers' own forward, on every path the engine has.

Each family is a tiny random checkpoint that transformers builds from a config and
saves (`yb_testkit.checkpoints`), loaded by the engine's loader as a user's directory
would be. The reference is transformers' eager forward of the same directory in float32.
Tolerance: max |ours - reference| / max |reference| <= 1e-4, and greedy tokens equal.

Prompts are longer than the windowed families' 24-token window and cross 8-token pages,
so sliding windows, page boundaries and cached prefixes all matter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from yb_engine import DecodeSeq, LoadedModel, ModelRunner, PagedKVCache, PrefillSeq
from yb_engine.architecture import LayerRange, UnsupportedModelError
from yb_engine.loader import load_model, load_stage
from yb_engine.runner import PrefillChunk
from yb_engine.stages import StageRunner, run_pipeline, stage_cache
from yb_testkit.checkpoints import (
    FAMILY_CONFIGS,
    REFUSED_CONFIGS,
    build_checkpoint,
    refused_config_dir,
)

TOL = 1e-4
BLOCK = 8
PAGES = 64


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


class Family:
    """A family's checkpoint, loaded by the engine and by transformers."""

    def __init__(self, name: str, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        self.path = path
        self.model: LoadedModel = load_model(path)
        self.reference: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def ref_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits: torch.Tensor = self.reference(torch.tensor([ids])).logits[0].float()
        return logits

    def runner(self) -> tuple[ModelRunner, list[int]]:
        """A runner over a fresh cache, and its pages in scattered order."""
        cache = PagedKVCache(self.model.config, PAGES, BLOCK)
        order: list[int] = torch.randperm(
            PAGES, generator=torch.Generator().manual_seed(3)
        ).tolist()
        return ModelRunner(self.model, cache), order

    def prompt(self, n: int, seed: int = 1) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        ids: list[int] = torch.randint(3, self.model.config.vocab, (n,), generator=gen).tolist()
        return ids


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    path = build_checkpoint(name, tmp_path_factory.mktemp(name) / "ckpt")
    return Family(name, path)


def test_the_registry_reads_the_family(family: Family) -> None:
    arch = family.model.config
    model_type = FAMILY_CONFIGS[family.name][0]
    assert arch.model_type == model_type
    if family.name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        assert arch.moe is not None and arch.moe.sparse_layers
    if family.name == "deepseek_v3":
        assert arch.mla is not None
    if family.name in ("gemma2", "gemma3_text", "mistral", "phi3", "qwen2_windowed"):
        assert any(arch.layer_windows)


def test_prefill_logits_at_every_position(family: Family) -> None:
    ids = family.prompt(60)
    runner, pages = family.runner()
    ref = family.ref_logits(ids)
    ours = runner.prefill(ids, pages, chunk_size=16, all_logits=True)
    assert rel_err(ours, ref) <= TOL
    # Handed over chunk by chunk instead (a long prompt's logits are never all held).
    handed: list[tuple[int, torch.Tensor]] = []
    last = runner.prefill(ids, pages, chunk_size=16, row_logits=lambda s, r: handed.append((s, r)))
    assert [s for s, _ in handed] == [0, 16, 32, 48]
    assert rel_err(torch.cat([r for _, r in handed]), ref) <= TOL
    assert rel_err(last, ref[-1]) <= TOL


def test_chunked_prefill_on_a_cached_prefix_last_row_only(family: Family) -> None:
    ids = family.prompt(61, seed=2)
    ref = family.ref_logits(ids)
    runner, pages = family.runner()
    # The prefix's KV is in the pages (as if fetched from the pool); the rest is
    # computed in 7-token chunks that start and end mid-page, and the last layer
    # computes only the last row.
    runner.prefill(ids[:37], pages)
    last = runner.prefill(ids, pages, num_cached_tokens=37, chunk_size=7)
    assert rel_err(last, ref[-1]) <= TOL
    rows = runner.prefill(ids, pages, num_cached_tokens=37, chunk_size=7, all_logits=True)
    assert rel_err(rows, ref[37:]) <= TOL


def test_prefill_batch(family: Family) -> None:
    prompts = [family.prompt(n, seed=n) for n in (9, 40, 27)]
    runner, pages = family.runner()
    tables = [pages[0:6], pages[6:12], pages[12:18]]
    runner.prefill(prompts[1][:16], tables[1])  # the second has a cached prefix
    logits = runner.prefill_batch(
        [
            PrefillSeq(prompts[0], tables[0]),
            PrefillSeq(prompts[1], tables[1], num_cached_tokens=16),
            PrefillSeq(prompts[2], tables[2]),
        ]
    )
    for i, ids in enumerate(prompts):
        assert rel_err(logits[i], family.ref_logits(ids)[-1]) <= TOL, i


def test_batched_decode_of_mixed_lengths_and_the_mixed_step(family: Family) -> None:
    prompts = [family.prompt(n, seed=10 + n) for n in (12, 50, 31)]
    nexts = [5, 7, 11]
    runner, pages = family.runner()
    tables = [pages[i * 8 : (i + 1) * 8] for i in range(4)]
    for ids, table in zip(prompts, tables, strict=False):
        runner.prefill(ids, table)
    batch = [
        DecodeSeq(table, len(ids), nxt)
        for ids, table, nxt in zip(prompts, tables, nexts, strict=False)
    ]
    refs = [family.ref_logits([*ids, nxt])[-1] for ids, nxt in zip(prompts, nexts, strict=True)]
    # Piggybacked: the same decode step with a prompt's chunk (after its cached prefix).
    chunk_ids = family.prompt(45, seed=99)
    runner.prefill(chunk_ids[:20], tables[3])
    snapshot = runner.cache.kv.clone()
    decoded, chunk_logits = runner.mixed(
        batch, PrefillChunk(chunk_ids[20:], tables[3], start=20, wants_logits=True)
    )
    assert chunk_logits is not None
    assert rel_err(chunk_logits, family.ref_logits(chunk_ids)[-1]) <= TOL
    runner.cache.kv.copy_(snapshot)
    alone = runner.decode(batch)
    for i, ref in enumerate(refs):
        assert rel_err(alone[i], ref) <= TOL, i
        assert rel_err(decoded[i], ref) <= TOL, i


def test_pipeline_stages(family: Family) -> None:
    ids = family.prompt(58, seed=4)
    arch = family.model.config
    stages = []
    for layers in LayerRange.split(arch.num_layers, 2):
        stage = load_stage(family.path, layers)
        stages.append(StageRunner(stage, stage_cache(stage, 16, BLOCK)))
    tables = [list(range(8)), list(range(8, 16))]
    logits = run_pipeline(stages, ids, tables, chunk_size=13)
    assert rel_err(logits, family.ref_logits(ids)[-1]) <= TOL
    # A stage's pages hold exactly what the whole model's hold for its layers.
    runner, _ = family.runner()
    whole = list(range(8))
    runner.prefill(ids, whole)
    for stage, table in zip(stages, tables, strict=True):
        r = stage.layer_range
        assert rel_err(stage.cache.kv[:, table], runner.cache.kv[r.start : r.end, whole]) <= TOL


def test_greedy_tokens_equal_transformers_generate(family: Family) -> None:
    ids = family.prompt(30, seed=5)
    with torch.inference_mode():
        generated = family.reference.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    runner, pages = family.runner()
    tokens = [int(runner.prefill(ids, pages).argmax())]
    while len(tokens) < 12:
        step = runner.decode([DecodeSeq(pages, len(ids) + len(tokens) - 1, tokens[-1])])
        tokens.append(int(step[0].argmax()))
    assert tokens == generated


@pytest.mark.parametrize("name", sorted(REFUSED_CONFIGS))
def test_a_family_we_cannot_compute_is_refused_with_what_is_missing(
    name: str, tmp_path: Path
) -> None:
    directory = refused_config_dir(name, tmp_path / "ckpt")
    with pytest.raises(UnsupportedModelError) as refused:
        load_model(directory)
    reason = name.split("(")[1].rstrip(")").split()[-1]
    assert reason in str(refused.value), str(refused.value)


def test_pages_moved_as_bytes_decode_to_the_same_tokens(family: Family) -> None:
    """Disaggregation's contract, per family: a prefill engine's pages, moved as the
    bytes `page_view` exposes (what UCX and the kvstores carry), let another engine
    decode exactly what the prefill engine would have."""
    ids = family.prompt(45, seed=6)
    prefill, pages = family.runner()
    first = int(prefill.prefill(ids, pages).argmax())
    decode = ModelRunner(family.model, PagedKVCache(family.model.config, PAGES, BLOCK))
    theirs = list(range(PAGES - 1, -1, -1))  # other page numbers on the other side
    needed = prefill.cache.pages_for(len(ids))
    for layer in range(family.model.config.num_layers):
        for i in range(needed):
            source = prefill.cache.page_view(layer, pages[i])
            assert source.is_contiguous()
            assert source.numel() * source.element_size() == prefill.cache.page_nbytes
            target = decode.cache.page_view(layer, theirs[i])
            target.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(
                    bytearray(memoryview(source.view(-1).view(torch.uint8).numpy())),
                    dtype=torch.uint8,
                )
            )

    def greedy(runner: ModelRunner, table: list[int]) -> list[int]:
        out = [first]
        while len(out) < 8:
            step = runner.decode([DecodeSeq(table, len(ids) + len(out) - 1, out[-1])])
            out.append(int(step[0].argmax()))
        return out

    assert greedy(decode, theirs) == greedy(prefill, pages)
