"""What one process answers: the reference that disaggregated serving must equal.

`single_process_answer` runs prefill and decode of the default model (or the model
directory `model_path`) on one runner, in this process, with greedy sampling; a cluster
given the same chat must stream exactly this text (tests/test_e2e.py on the CPU,
tests/test_cuda.py on a GPU, tests/test_families_cluster.py for other families).
"""

from __future__ import annotations

from typing import Any


def single_process_answer(
    messages: list[dict[str, Any]],
    max_tokens: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    kv_dtype: str = "auto",
    block_size: int = 64,
    num_pages: int = 64,
    model_path: Any = None,
) -> str:
    """The greedy answer of the default model (or of the directory `model_path`) to
    `messages`, prefilled and decoded by one `ModelRunner` on `device` in `dtype`, with
    pages of `block_size` tokens in `kv_dtype` (`model.kv_dtype`)."""
    import torch

    from yb_core.model_files import default_model_cache_dir
    from yb_core.protocol import SamplingParams
    from yb_engine.batcher import DecodeBatcher
    from yb_engine.kv_cache import PageAllocator, PagedKVCache
    from yb_engine.kv_quant import kv_dtype_for
    from yb_engine.loader import ensure_default_model, load_model
    from yb_engine.runner import ModelRunner
    from yb_engine.sampling import Sampler

    torch_dtype = getattr(torch, dtype)
    path = model_path or ensure_default_model(default_model_cache_dir())
    model = load_model(path, dtype=torch_dtype, device=device)
    tok = model.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    cache = PagedKVCache(
        model.config,
        num_pages,
        block_size,
        dtype=kv_dtype_for(kv_dtype, torch_dtype),
        device=device,
    )
    allocator = PageAllocator(num_pages)
    runner = ModelRunner(model, cache)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    pages = allocator.allocate(cache.pages_for(len(prompt)))
    logits = runner.prefill(prompt, pages)
    (first,) = Sampler().sample(logits[None], [params], [None])
    batcher = DecodeBatcher(runner, allocator, tok, max_batch_size=1)
    batcher.add("r", prompt, pages, first, params)
    answer = ""
    while batcher.has_work():
        answer += "".join(out.text_delta for out in batcher.step())
    return answer


def assert_prefix_reused_from_pool(cluster: Any, model: str, *, block_size: int = 64) -> None:
    """A prompt of four full blocks and three tokens, asked again and again through
    `cluster`'s `/v1/completions`: the first answer computes it all; once its blocks
    reach the pool (after the answer), an answer reuses all four blocks, and every
    answer is the first one's greedy text."""
    import random

    import httpx

    rng = random.Random(11)
    prompt = [rng.randrange(10, 250) for _ in range(4 * block_size)] + [1, 2, 3]

    def complete() -> tuple[str, int]:
        r = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=60,
            headers=cluster.headers,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return body["choices"][0]["text"], cached

    first, cached = complete()
    assert cached == 0
    for _ in range(50):
        again, cached = complete()
        assert again == first
        if cached:
            break
    assert cached == 4 * block_size
