"""Sampler: greedy, seeded reproducibility, independence from the batch, filters."""

from __future__ import annotations

import torch

from yb_core.protocol import SamplingParams
from yb_engine import Sampler, new_generator


def logits_for(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def draw(params: SamplingParams, logits: torch.Tensor, steps: int) -> list[int]:
    gen = new_generator(params)
    return [Sampler().sample(logits[i : i + 1], [params], [gen])[0] for i in range(steps)]


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    logits = logits_for(4)
    params = SamplingParams(temperature=0.0)
    assert new_generator(params) is None
    assert Sampler().sample(logits, [params] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = logits_for(64)
    a = draw(SamplingParams(seed=7), logits, 64)
    b = draw(SamplingParams(seed=7), logits, 64)
    c = draw(SamplingParams(seed=8), logits, 64)
    assert a == b
    assert a != c


def test_a_request_draws_the_same_alone_and_in_a_batch() -> None:
    logits = logits_for(20, seed=3)
    target = SamplingParams(seed=11, temperature=0.8, top_p=0.9)
    alone = draw(target, logits, 20)
    others = [SamplingParams(seed=s, top_k=5) for s in (1, 2)] + [SamplingParams(temperature=0)]
    gens = [new_generator(p) for p in [target, *others]]
    batched = []
    for i in range(20):
        rows = logits[i : i + 1].expand(4, -1)
        batched.append(Sampler().sample(rows, [target, *others], gens)[0])
    assert alone == batched


def test_an_unfiltered_request_draws_the_same_beside_one_that_filters() -> None:
    # A plain-temperature row used to be drawn through the sorted order whenever another
    # row of its step filtered (top-k or top-p), so its token depended on its neighbours.
    logits = logits_for(40, seed=4)
    target = SamplingParams(seed=5, temperature=1.0)
    alone = draw(target, logits, 40)
    filtering = SamplingParams(seed=9, top_p=0.95)
    gens = [new_generator(target), new_generator(filtering)]
    beside = [
        Sampler().sample(logits[i : i + 1].expand(2, -1), [target, filtering], gens)[0]
        for i in range(40)
    ]
    assert alone == beside


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = logits_for(1, vocab=30, seed=5)
    ranked = logits[0].argsort(descending=True).tolist()
    sampler = Sampler()
    top3 = SamplingParams(seed=1, top_k=3, temperature=2.0)
    gen = new_generator(top3)
    picks = {sampler.sample(logits, [top3], [gen])[0] for _ in range(300)}
    assert picks == set(ranked[:3])
    probs = torch.softmax(logits[0], -1)[ranked]
    # the smallest prefix of the ranking holding 50% of the mass
    keep = int((probs.cumsum(0) < 0.5).sum()) + 1
    nucleus = SamplingParams(seed=2, top_p=0.5)
    gen = new_generator(nucleus)
    picks = {sampler.sample(logits, [nucleus], [gen])[0] for _ in range(400)}
    assert picks == set(ranked[:keep])


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    params = SamplingParams(seed=0)
    gen = new_generator(params)
    n = 6000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[Sampler().sample(logits, [params], [gen])[0]] += 1
    expected = torch.softmax(logits[0], -1) * n
    assert counts[3] == 0
    assert bool(((counts - expected).abs() < 5 * expected.sqrt() + 1).all())
