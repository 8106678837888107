"""The runner on the real default model, SmolLM2-135M-Instruct (converted from the GGUF).

These are the claims that only the real model can back: our forward equals
transformers' on it, batching does not change greedy output, and it answers a question.
"""

from __future__ import annotations

import pytest
import torch

from yb_core.model_files import default_model_cache_dir
from yb_core.protocol import SamplingParams
from yb_engine import (
    DecodeBatcher,
    DecodeSeq,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    TokenOutput,
    ensure_default_model,
    load_model,
)
from yb_text.detokenize import IncrementalDetokenizer

pytestmark = pytest.mark.slow

BLOCK = 16


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(ensure_default_model(default_model_cache_dir()))


def chat(model: LoadedModel, question: str) -> list[int]:
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids: list[int] = model.tokenizer.encode(text, add_special_tokens=False)
    return ids


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_logits_match_transformers(smol: LoadedModel) -> None:
    ids = chat(smol, "Write a short poem about paged attention and the sea, in four lines.")
    ids = (ids * 8)[:230]  # a longer prompt: positions up to 229
    n_prompt, n_decode = 227, 3
    with torch.inference_mode():
        ref = smol.hf_model(torch.tensor([ids[: n_prompt + n_decode]])).logits[0].float()
    cache = PagedKVCache(smol.config, 32, BLOCK)
    runner = ModelRunner(smol, cache)
    table = [int(p) for p in torch.randperm(32, generator=torch.Generator().manual_seed(0))[:15]]
    last = n_prompt - 1
    assert rel_err(runner.prefill(ids[:n_prompt], table), ref[last]) < 1e-4
    assert rel_err(runner.prefill(ids[:n_prompt], table, chunk_size=100), ref[last]) < 1e-4
    runner.prefill(ids[:128], table)
    cached = runner.prefill(ids[:n_prompt], table, num_cached_tokens=128, chunk_size=64)
    assert rel_err(cached, ref[last]) < 1e-4
    for pos in range(n_prompt, n_prompt + n_decode):
        assert rel_err(runner.decode([DecodeSeq(table, pos, ids[pos])])[0], ref[pos]) < 1e-4


def generate(
    model: LoadedModel, prompts: dict[str, list[int]], params: SamplingParams, max_batch: int
) -> dict[str, list[TokenOutput]]:
    cache = PagedKVCache(model.config, 256, BLOCK)
    alloc = PageAllocator(256)
    runner = ModelRunner(model, cache)
    batcher = DecodeBatcher(runner, alloc, model.tokenizer, max_batch)
    for rid, ids in prompts.items():
        pages = alloc.allocate(cache.pages_for(len(ids)))
        first = int(runner.prefill(ids, pages).argmax())
        batcher.add(rid, ids, pages, first, params)
    out: dict[str, list[TokenOutput]] = {}
    while batcher.has_work():
        for o in batcher.step():
            out.setdefault(o.request_id, []).append(o)
    assert alloc.num_used == 0
    return out


def test_batched_greedy_decoding_equals_solo(smol: LoadedModel) -> None:
    prompts = {
        "short": chat(smol, "Hi!"),
        "mid": chat(smol, "List three uses of a hash function in distributed systems."),
        "long": chat(smol, "Explain " + "why caching matters, " * 30 + "in one paragraph."),
        "raw": smol.tokenizer.encode("The history of the printing press"),
    }
    assert len({len(p) for p in prompts.values()}) == 4
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    together = generate(smol, prompts, params, max_batch=8)
    for rid, ids in prompts.items():
        alone = generate(smol, {rid: ids}, params, max_batch=1)[rid]
        solo_tokens = [o.token_id for o in alone]
        assert len(solo_tokens) == 32
        assert [o.token_id for o in together[rid]] == solo_tokens, rid


def test_answers_the_capital_of_france(smol: LoadedModel) -> None:
    ids = chat(smol, "What is the capital of France?")
    outs = generate(smol, {"q": ids}, SamplingParams(temperature=0.0, max_tokens=48), 1)["q"]
    text = "".join(o.text_delta for o in outs)
    assert "Paris" in text
    assert outs[-1].finish_reason == "stop"  # it ends its answer with <|im_end|>


def test_detokenizer_on_multibyte_text(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    sentence = "Crème brûlée in 東京 costs ¥1200 🍮!"
    ids = tok.encode(sentence, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, chat(smol, "hi"))
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == sentence
    assert all("\ufffd" not in d for d in deltas)
