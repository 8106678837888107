"""Pipeline stages (CPP): a prompt prefilled through 2 or 4 layer-range stages, chunk by
chunk, gives the logits and KV pages of one whole-model prefill, with and without a
cached prefix; a stage loaded from a checkpoint reads its own tensors only."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from yb_engine import LoadedModel, ModelRunner, PagedKVCache
from yb_engine.architecture import LayerRange
from yb_engine.loader import LoadedStage, load_stage, tiny_random_model
from yb_engine.stages import (
    HiddenHeader,
    StageRunner,
    chunk_spans,
    hidden_bytes,
    hidden_from_buffer,
    run_pipeline,
    stage_cache,
)

BLOCK = 16
PAGES = 12
PROMPT = 150
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny4() -> LoadedModel:
    return tiny_random_model(seed=3, num_layers=4)


def prompt(model: LoadedModel, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, model.config.vocab, (n,), generator=gen)]


def scrambled_table(seed: int) -> list[int]:
    # Pages out of order, so a stage that confused page and position would show.
    return [int(p) for p in torch.randperm(PAGES, generator=torch.Generator().manual_seed(seed))]


def whole_prefill(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, PagedKVCache]:
    cache = PagedKVCache(model.config, PAGES, BLOCK)
    logits = ModelRunner(model, cache).prefill(ids, scrambled_table(0))
    return logits, cache


def group(model: LoadedModel, num_stages: int) -> list[StageRunner]:
    stages = []
    for layers in LayerRange.split(model.config.num_layers, num_stages):
        stage = LoadedStage.of_model(model, layers)
        stages.append(StageRunner(stage, stage_cache(stage, PAGES, BLOCK)))
    return stages


def assert_pages_equal(
    stages: list[StageRunner], whole: PagedKVCache, num_tokens: int, *, exact: bool = False
) -> None:
    """Each stage's pages hold the whole model's KV of its layers: within 1e-4 of the
    largest value (chunks of other sizes round sums differently), bit for bit when
    `exact`."""
    used = scrambled_table(0)[: whole.pages_for(num_tokens)]
    for i, stage in enumerate(stages):
        layers = stage.layer_range
        table = scrambled_table(i + 1)[: whole.pages_for(num_tokens)]
        ours = stage.cache.kv[:, table]
        theirs = whole.kv[layers.start : layers.end, used]
        assert ours.shape == theirs.shape
        if exact:
            assert torch.equal(ours, theirs), f"stage {i} pages differ"
        else:
            assert rel_err(ours, theirs) < TOLERANCE, f"stage {i} pages differ"


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def test_layer_ranges() -> None:
    assert LayerRange.split(30, 4) == [
        LayerRange(0, 8),
        LayerRange(8, 16),
        LayerRange(16, 23),
        LayerRange(23, 30),
    ]
    assert LayerRange.split(4, 1) == [LayerRange(0, 4)]
    with pytest.raises(ValueError, match="cannot cut"):
        LayerRange.split(2, 3)
    with pytest.raises(ValueError, match="empty"):
        LayerRange(3, 3)
    arch = tiny_random_model(num_layers=4).config
    with pytest.raises(ValueError, match="exceeds"):
        LayerRange(2, 5).check(arch)
    assert chunk_spans(10, 3, 4) == [(3, 7), (7, 10)]
    with pytest.raises(ValueError, match="last prompt token"):
        chunk_spans(10, 10, 4)


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("chunk_size", [1, 17, 64, 512])
def test_pipeline_equals_whole_model(tiny4: LoadedModel, num_stages: int, chunk_size: int) -> None:
    ids = prompt(tiny4, PROMPT)
    reference, whole = whole_prefill(tiny4, ids)
    stages = group(tiny4, num_stages)
    tables = [scrambled_table(i + 1) for i in range(num_stages)]
    logits = run_pipeline(stages, ids, tables, chunk_size=chunk_size)
    assert logits.shape == reference.shape
    # The whole model computes in chunks of 512 too: the same sums, the same bits.
    same_chunks = chunk_size == 512
    assert torch.equal(logits, reference) if same_chunks else rel_err(logits, reference) < TOLERANCE
    assert_pages_equal(stages, whole, PROMPT, exact=same_chunks)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipeline_reuses_each_stages_cached_prefix(tiny4: LoadedModel, num_stages: int) -> None:
    ids = prompt(tiny4, PROMPT, seed=1)
    reference, whole = whole_prefill(tiny4, ids)
    cached = 4 * BLOCK  # whole pages, as the prefix pool holds them
    stages = group(tiny4, num_stages)
    tables = [scrambled_table(i + 1) for i in range(num_stages)]
    prefix_pages = scrambled_table(0)[: cached // BLOCK]
    for stage, table in zip(stages, tables, strict=True):
        # Each stage is given the prefix KV of its own layers only, as a stage of a
        # group loads it from the pool; the rest of its pages stay zero.
        layers = stage.layer_range
        stage.cache.kv[:, table[: cached // BLOCK]] = whole.kv[
            layers.start : layers.end, prefix_pages
        ]
    logits = run_pipeline(stages, ids, tables, num_cached_tokens=cached, chunk_size=40)
    assert rel_err(logits, reference) < TOLERANCE
    assert_pages_equal(stages, whole, PROMPT)


def test_stage_with_all_layers_is_the_model(tiny4: LoadedModel) -> None:
    ids = prompt(tiny4, 40, seed=2)
    reference, _ = whole_prefill(tiny4, ids)
    stages = group(tiny4, 1)
    assert rel_err(run_pipeline(stages, ids, [scrambled_table(1)], chunk_size=9), reference) < (
        TOLERANCE
    )


def test_qkv_bias_model_over_two_stages() -> None:
    model = tiny_random_model(seed=4, qkv_bias=True)
    ids = prompt(model, 70, seed=3)
    reference, whole = whole_prefill(model, ids)
    stages = group(model, 2)
    logits = run_pipeline(stages, ids, [scrambled_table(1), scrambled_table(2)], chunk_size=32)
    assert rel_err(logits, reference) < TOLERANCE
    assert_pages_equal(stages, whole, 70)


def test_hidden_states_cross_as_header_and_bytes(tiny4: LoadedModel) -> None:
    """Stages driven by hand, every hand-off through the wire form: a msgpack header and
    the tensor's raw bytes, as a transport between processes carries them."""
    ids = prompt(tiny4, 90, seed=5)
    reference, _ = whole_prefill(tiny4, ids)
    first, second = group(tiny4, 2)
    tables = [scrambled_table(1), scrambled_table(2)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(HiddenHeader)
    logits = None
    for index, (start, end) in enumerate(chunk_spans(len(ids), 0, 32)):
        hidden = first.forward(torch.tensor(ids[start:end]), tables[0], start, len(ids))
        assert hidden is not None
        header_bytes = encoder.encode(
            HiddenHeader.of(
                hidden, request_id="r1", chunk_index=index, start=start, prompt_len=len(ids)
            )
        )
        payload = bytes(hidden_bytes(hidden))
        header = decoder.decode(header_bytes)
        assert (header.request_id, header.chunk_index, header.start, header.end) == (
            "r1",
            index,
            start,
            end,
        )
        assert header.shape == (end - start, tiny4.config.hidden)
        assert header.dtype == "float32"
        assert header.nbytes == len(payload)
        received = hidden_from_buffer(header, payload, "cpu")
        assert torch.equal(received, hidden)
        logits = second.forward(received, tables[1], header.start, header.prompt_len)
        assert (logits is None) != header.is_last_chunk
    assert logits is not None
    assert rel_err(logits, reference) < TOLERANCE
    answer = header.describing(logits)  # how the last stage labels its logits
    assert (answer.chunk_index, answer.start, answer.end) == (header.chunk_index, 64, 90)
    assert (answer.shape, answer.dtype) == ((tiny4.config.vocab,), "float32")
    with pytest.raises(ValueError, match="the header says"):
        hidden_from_buffer(header, payload[:-4], "cpu")


def test_stage_refuses_mismatched_inputs(tiny4: LoadedModel) -> None:
    first, second = group(tiny4, 2)
    with pytest.raises(ValueError, match="token ids"):
        first.forward(torch.zeros(4, tiny4.config.hidden), list(range(PAGES)), 0, 4)
    with pytest.raises(ValueError, match="hidden states"):
        second.forward(torch.tensor([1, 2, 3]), list(range(PAGES)), 0, 3)
    with pytest.raises(ValueError, match="outside the prompt"):
        first.forward(torch.tensor([1, 2, 3]), list(range(PAGES)), 2, 4)
    wrong = PagedKVCache(tiny4.config, PAGES, BLOCK)  # every layer, not the stage's
    with pytest.raises(ValueError, match="does not fit layers"):
        StageRunner(first.stage, wrong)
    with pytest.raises(ValueError, match="does not follow"):
        run_pipeline([second, first], [1, 2], [[0], [0]])


def save_checkpoint(model: LoadedModel, directory: Path) -> None:
    model.hf_model.save_pretrained(directory)
    model.tokenizer.save_pretrained(directory)


def test_load_stage_reads_only_its_tensors(tiny4: LoadedModel, tmp_path: Path) -> None:
    save_checkpoint(tiny4, tmp_path)
    ranges = LayerRange.split(4, 3)  # [0, 2), [2, 3), [3, 4)
    loaded = [load_stage(tmp_path, layers) for layers in ranges]
    for layers, stage in zip(ranges, loaded, strict=True):
        layer_ids = {int(name.split(".")[2]) for name in stage.tensors_read if ".layers." in name}
        assert layer_ids == set(range(layers.start, layers.end))
        others = {name for name in stage.tensors_read if ".layers." not in name}
        expected = set()
        if layers.is_first:
            expected.add("model.embed_tokens.weight")
        if layers.is_last(tiny4.config):
            # Tied embeddings: the last stage reads the embedding tensor as its head.
            expected |= {"model.norm.weight", "model.embed_tokens.weight"}
        assert others == expected
        assert sum(stage.tensors_read.values()) == sum(
            t.numel() * t.element_size()
            for name, t in tiny4.weights.to_hf_state_dict(tiny4.config).items()
            if name in stage.tensors_read
        )
        assert stage.weights.num_parameters() == sum(n // 4 for n in stage.tensors_read.values())
    middle = loaded[1]
    assert middle.weights.embed is None and middle.weights.lm_head is None
    assert torch.equal(middle.weights.layers[0].attn.qkv, tiny4.weights.layers[2].attn.qkv)
    # The loaded stages compute the whole model's logits.
    ids = prompt(tiny4, 60, seed=6)
    reference, _ = whole_prefill(tiny4, ids)
    stages = [StageRunner(s, stage_cache(s, PAGES, BLOCK)) for s in loaded]
    tables = [scrambled_table(i + 1) for i in range(3)]
    assert rel_err(run_pipeline(stages, ids, tables, chunk_size=25), reference) < TOLERANCE
