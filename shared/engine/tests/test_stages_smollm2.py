"""Pipeline stages on the real default model, SmolLM2-135M-Instruct (30 layers): stages
loaded from the converted checkpoint read only their own tensors, and 2 and 4 stages
give the whole model's logits and KV pages."""

from __future__ import annotations

import pytest
import torch

from yb_core.model_files import default_model_cache_dir
from yb_engine import LoadedModel, ModelRunner, PagedKVCache, ensure_default_model, load_model
from yb_engine.architecture import LayerRange
from yb_engine.loader import load_stage
from yb_engine.stages import StageRunner, run_pipeline, stage_cache

pytestmark = pytest.mark.slow

BLOCK = 16
PAGES = 24
PROMPT = 300
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(ensure_default_model(default_model_cache_dir()))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_from_checkpoint_equal_whole_model(smol: LoadedModel, num_stages: int) -> None:
    assert smol.path is not None
    gen = torch.Generator().manual_seed(num_stages)
    ids = [int(t) for t in torch.randint(0, smol.config.vocab, (PROMPT,), generator=gen)]
    whole = PagedKVCache(smol.config, PAGES, BLOCK)
    table = list(range(PAGES))
    reference = ModelRunner(smol, whole).prefill(ids, table, chunk_size=512)

    total_bytes = sum(
        t.numel() * t.element_size() for t in smol.weights.to_hf_state_dict(smol.config).values()
    )
    stages = []
    for layers in LayerRange.split(smol.config.num_layers, num_stages):
        stage = load_stage(smol.path, layers)
        read_layers = {int(n.split(".")[2]) for n in stage.tensors_read if ".layers." in n}
        assert read_layers == set(range(layers.start, layers.end))
        # A stage reads about its share of the weights; the embedding (which is also the
        # tied head, 28 % of the model) only on the first and last stages.
        embed_bytes = smol.weights.embed.numel() * 4
        with_embed = layers.is_first or layers.is_last(smol.config)
        layer_bytes = sum(stage.tensors_read.values()) - (embed_bytes if with_embed else 0)
        assert layer_bytes < (total_bytes - embed_bytes) * len(layers) / 30 * 1.01
        stages.append(StageRunner(stage, stage_cache(stage, PAGES, BLOCK)))
    logits = run_pipeline(stages, ids, [table] * num_stages, chunk_size=128)
    assert rel_err(logits, reference) < TOLERANCE
    assert int(logits.argmax()) == int(reference.argmax())
    used = table[: whole.pages_for(PROMPT)]
    for stage in stages:
        layers = stage.layer_range
        assert rel_err(stage.cache.kv[:, used], whole.kv[layers.start : layers.end, used]) < (
            TOLERANCE
        )
