"""Prompts prefilled inside the decode batch (mixed steps), on the tiny fp32 model.

A piggybacked request gives the tokens and logprobs (1e-4) of a separate prefill and a
hand-off; the requests decoding beside it give exactly their tokens without it; the
chunking does not change the result; a prefix already in the pages is not recomputed;
prompts that cannot fit are refused. The step-time model and the chunk bound it sets
are checked on given step times (never on this machine's clock).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from yb_core.protocol import SamplingParams
from yb_engine import (
    DecodeBatcher,
    DecodeSeq,
    LoadedModel,
    ModelRunner,
    OutOfPages,
    PageAllocator,
    PagedKVCache,
    TokenOutput,
    sample_first_tokens,
    tiny_random_model,
)
from yb_engine.batcher import StepTimeModel
from yb_engine.runner import PrefillChunk

BLOCK = 4
LOGPROB_TOL = 1e-4

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
SEEDED_N2 = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=10, logprobs=3)
# The streams running beside the prompt: long enough to decode through all its chunks.
# The seeded one filters (top_p < 1) so that every batch it is in samples it the same
# way: `Sampler` draws a filtering batch's rows through the sorted CDF and others' in
# vocabulary order, so a plain-temperature row's token would depend on whether a
# filtering request shares its step (its own issue, apart from piggybacking).
OTHERS = [
    ("a", 9, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    ("b", 17, SamplingParams(temperature=0.8, seed=3, top_p=0.9, max_tokens=40, ignore_eos=True)),
    ("c", 5, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)),
]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_random_model(0)


def prompt(n: int, seed: int) -> list[int]:
    ids: list[int] = torch.randint(
        0, 256, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return ids


class Engine:
    """A decode engine's runner, allocator and batcher over one cache."""

    def __init__(self, model: LoadedModel, num_pages: int = 256, **batcher_options: Any) -> None:
        self.cache = PagedKVCache(model.config, num_pages, BLOCK)
        self.alloc = PageAllocator(num_pages)
        self.runner = ModelRunner(model, self.cache)
        self.tokenizer = model.tokenizer
        self.batcher = DecodeBatcher(
            self.runner,
            self.alloc,
            model.tokenizer,
            8,
            **batcher_options,
        )
        self.outputs: dict[str, list[TokenOutput]] = {}
        self.first_step: dict[str, int] = {}
        self.steps = 0
        self.mixed_steps = 0

    def hand_off(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        """A separate prefill (as the prefill engine runs it), then `add`."""
        pages = self.alloc.allocate(self.cache.pages_for(len(ids)))
        logits = self.runner.prefill(ids, pages)
        sampled = sample_first_tokens(
            logits, params, tokenizer=self.tokenizer, eos_token_ids=self.runner.arch.eos_token_ids
        )
        logprobs = [s.logprob for s in sampled if s.logprob is not None]
        self.batcher.add(
            rid,
            ids,
            pages,
            sampled[0].token_id,
            params,
            first_tokens=[s.token_id for s in sampled],
            first_logprobs=logprobs or None,
        )

    def step(self) -> None:
        mixed = self.batcher.num_prefilling > 0 and self.batcher.num_running > 0
        self.steps += 1
        for out in self.batcher.step():
            self.outputs.setdefault(out.request_id, []).append(out)
            self.first_step.setdefault(out.request_id, self.steps)
        self.mixed_steps += mixed

    def run(self) -> dict[str, list[TokenOutput]]:
        while self.batcher.has_work():
            self.step()
        assert self.alloc.num_used == 0
        return self.outputs


def choice(outs: list[TokenOutput], index: int = 0) -> list[TokenOutput]:
    return [o for o in outs if o.index == index and o.token_id is not None]


def tokens(outs: list[TokenOutput], index: int = 0) -> list[int]:
    return [o.token_id for o in choice(outs, index) if o.token_id is not None]


def assert_same_logprobs(ours: list[TokenOutput], ref: list[TokenOutput]) -> None:
    for a, b in zip(ours, ref, strict=True):
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None and b.logprob is not None:
            assert abs(a.logprob.logprob - b.logprob.logprob) <= LOGPROB_TOL
            assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
            for (_, x), (_, y) in zip(a.logprob.top, b.logprob.top, strict=True):
                assert abs(x - y) <= LOGPROB_TOL


def scenario(
    model: LoadedModel, target: SamplingParams | None, mode: str, chunk: int = 8
) -> Engine:
    """Three streams decoding, then the target request (37 tokens) arrives, either with
    its prompt (`piggyback`) or prefilled separately (`hand_off`); None: no target."""
    engine = Engine(model, max_chunk_tokens=chunk)
    for rid, n, params in OTHERS:
        engine.hand_off(rid, prompt(n, len(rid) + n), params)
    engine.step()
    engine.step()
    if target is not None:
        ids = prompt(37, 100)
        if mode == "piggyback":
            engine.batcher.add_prompt("target", ids, target)
        else:
            engine.hand_off("target", ids, target)
    engine.run()
    return engine


@pytest.mark.parametrize("params", [GREEDY, SEEDED, SEEDED_N2], ids=["greedy", "seeded", "n2"])
def test_piggybacked_prompt_matches_a_separate_prefill(
    model: LoadedModel, params: SamplingParams
) -> None:
    piggy = scenario(model, params, "piggyback")
    handed = scenario(model, params, "hand_off")
    alone = scenario(model, None, "none")
    # 37 tokens in chunks of 8: five steps of which every one also decoded the others.
    assert piggy.mixed_steps == 5
    assert piggy.first_step["target"] == 2 + 5
    for index in range(params.n):
        ours, ref = piggy.outputs["target"], handed.outputs["target"]
        assert tokens(ours, index) == tokens(ref, index)
        assert len(tokens(ours, index)) > 1
        assert_same_logprobs(choice(ours, index), choice(ref, index))
        assert [o.finish_reason for o in ours if o.finished] == [
            o.finish_reason for o in ref if o.finished
        ]
    for rid, _, _ in OTHERS:
        assert tokens(piggy.outputs[rid]) == tokens(alone.outputs[rid])
        assert_same_logprobs(choice(piggy.outputs[rid]), choice(alone.outputs[rid]))


@pytest.mark.parametrize("chunk", [1, 3, 8, 36, 512])
def test_chunk_boundaries_do_not_change_the_tokens(model: LoadedModel, chunk: int) -> None:
    reference = scenario(model, GREEDY, "hand_off")
    piggy = scenario(model, GREEDY, "piggyback", chunk=chunk)
    assert piggy.first_step["target"] == 2 + -(-37 // chunk)
    assert tokens(piggy.outputs["target"]) == tokens(reference.outputs["target"])
    assert_same_logprobs(choice(piggy.outputs["target"]), choice(reference.outputs["target"]))
    for rid, _, _ in OTHERS:
        assert tokens(piggy.outputs[rid]) == tokens(reference.outputs[rid])


def test_prompt_alone_in_the_batch(model: LoadedModel) -> None:
    ids = prompt(21, 4)
    handed, piggy = Engine(model), Engine(model, max_chunk_tokens=5)
    handed.hand_off("r", ids, SEEDED)
    piggy.batcher.add_prompt("r", ids, SEEDED)
    assert tokens(piggy.run()["r"]) == tokens(handed.run()["r"])
    assert piggy.first_step["r"] == 5


def test_a_cached_prefix_is_not_recomputed(model: LoadedModel) -> None:
    ids = prompt(30, 8)
    cached = 13  # not a page multiple: the chunk after it fills the prefix's last page
    engine = Engine(model, max_chunk_tokens=4)
    # The prefix's KV as the pool would load it: computed elsewhere into these pages.
    pages = engine.alloc.allocate(engine.cache.pages_for(cached))
    engine.runner.prefill(ids[:cached], pages)
    engine.batcher.add_prompt("r", ids, GREEDY, cached_pages=pages, num_cached_tokens=cached)
    engine.step()
    assert engine.batcher.prompt_chunks("r") == [4]
    outs = engine.run()["r"]
    # 17 tokens computed in chunks of 4: the first token comes with the fifth step.
    assert engine.first_step["r"] == 5
    reference = Engine(model)
    reference.hand_off("r", ids, GREEDY)
    ref = reference.run()["r"]
    assert tokens(outs) == tokens(ref)
    assert_same_logprobs(choice(outs), choice(ref))


def test_prompts_that_cannot_run_are_refused_and_nothing_is_taken(model: LoadedModel) -> None:
    engine = Engine(model, num_pages=10)  # 40 tokens of pages
    with pytest.raises(ValueError, match="needs 11 KV pages of 4 tokens; this engine has 10"):
        engine.batcher.add_prompt("long", prompt(41, 1), GREEDY)
    with pytest.raises(ValueError, match="needs 11 KV pages"):  # 10 pages + a copy for n = 2
        engine.batcher.add_prompt("n2", prompt(39, 1), SEEDED_N2)
    max_position = engine.runner.arch.max_position
    with pytest.raises(ValueError, match=f"exceeds the model's {max_position}"):
        engine.batcher.add_prompt("huge", prompt(max_position + 1, 1), GREEDY)
    with pytest.raises(ValueError, match="last token is computed"):
        engine.batcher.add_prompt("all-cached", prompt(8, 1), GREEDY, num_cached_tokens=8)
    held = engine.alloc.allocate(5)
    with pytest.raises(OutOfPages):
        engine.batcher.add_prompt("busy", prompt(24, 1), GREEDY)
    assert engine.alloc.num_used == 5 and not engine.batcher.has_work()
    engine.alloc.free(held)
    engine.batcher.add_prompt("fits", prompt(24, 1), GREEDY)
    with pytest.raises(ValueError, match="already being decoded"):
        engine.batcher.add_prompt("fits", prompt(4, 1), GREEDY)
    assert engine.alloc.num_used == 6


def test_abort_while_prefilling_frees_the_pages(model: LoadedModel) -> None:
    engine = Engine(model, max_chunk_tokens=4)
    engine.batcher.add_prompt("r", prompt(20, 2), SEEDED_N2)
    engine.step()
    assert engine.batcher.num_prefilling == 1
    assert engine.batcher.abort("r")
    engine.run()
    ends = [(o.index, o.finish_reason) for o in engine.outputs["r"]]
    assert ends == [(0, "abort"), (1, "abort")]


def test_kept_blocks_outlive_their_request_until_released(model: LoadedModel) -> None:
    ids = prompt(22, 6)  # five full blocks and a part
    engine = Engine(model, max_chunk_tokens=8)
    once = SamplingParams(temperature=0.0, max_tokens=1)
    with pytest.raises(ValueError, match="not distinct of"):  # block 5 is the partial one
        engine.batcher.add_prompt("r", ids, once, keep_blocks=[4, 5])
    engine.batcher.add_prompt("r", ids, once, keep_blocks=[1, 3, 4])
    engine.step()
    assert engine.batcher.take_kept() == {}  # not computed yet
    while "r" not in engine.outputs:
        engine.step()
    # Computed and ended in the same step (max_tokens 1): only the kept pages remain.
    assert [o.finish_reason for o in engine.outputs["r"]] == ["length"]
    kept = engine.batcher.take_kept()
    assert list(kept) == ["r"] and list(kept["r"]) == [1, 3, 4]
    assert engine.batcher.take_kept() == {}
    assert engine.alloc.num_used == 3 and not engine.batcher.has_work()
    # They hold the blocks' KV, as a separate prefill computes it.
    reference = Engine(model)
    pages = reference.alloc.allocate(reference.cache.pages_for(len(ids)))
    reference.runner.prefill(ids, pages)
    for block, page in kept["r"].items():
        ours, theirs = engine.cache.kv[:, page], reference.cache.kv[:, pages[block]]
        assert torch.allclose(ours, theirs, atol=1e-5)
    engine.batcher.release_kept(list(kept["r"].values()))
    assert engine.alloc.num_used == 0


def test_kept_blocks_shared_with_running_choices_are_freed_by_the_last_holder(
    model: LoadedModel,
) -> None:
    engine = Engine(model, max_chunk_tokens=64)
    engine.batcher.add_prompt("r", prompt(13, 9), SEEDED_N2, keep_blocks=[0, 2])
    engine.step()
    kept = list(engine.batcher.take_kept()["r"].values())
    # Released while both choices still read them: nothing is freed yet.
    used = engine.alloc.num_used
    engine.batcher.release_kept(kept)
    assert engine.alloc.num_used == used and engine.batcher.has_work()
    engine.run()  # asserts every page came back
    # And the other way round: the request ends first.
    engine.batcher.add_prompt("s", prompt(13, 9), SEEDED_N2, keep_blocks=[1])
    engine.step()
    kept = list(engine.batcher.take_kept()["s"].values())
    engine.outputs.clear()
    while engine.batcher.has_work():
        engine.step()
    assert engine.alloc.num_used == 1
    engine.batcher.release_kept(kept)
    assert engine.alloc.num_used == 0


def test_a_prompt_that_ends_before_it_is_computed_keeps_nothing(model: LoadedModel) -> None:
    engine = Engine(model, max_chunk_tokens=4)
    engine.batcher.add_prompt("r", prompt(20, 2), GREEDY, keep_blocks=[0, 1])
    engine.step()
    assert engine.batcher.abort("r")
    engine.run()
    assert engine.batcher.take_kept() == {}


def test_the_step_time_model_learns_a_line() -> None:
    model = StepTimeModel(window=10)
    assert model.predict(10) is None and model.max_tokens_within(1.0) is None
    # One size class only: proportional, which overestimates the cost of more tokens.
    model.observe(4, 0.020)
    model.observe(5, 0.020)
    model.observe(4, 0.020)
    assert model.predict(8) == pytest.approx(0.040)
    assert model.max_tokens_within(0.050) == 10
    for tokens_fed in (12, 20, 36):
        model.observe(tokens_fed, 0.018 + 0.0005 * tokens_fed)
    fixed, per_token = model.coefficients() or (0.0, 0.0)
    assert fixed == pytest.approx(0.018) and per_token == pytest.approx(0.0005)
    assert model.max_tokens_within(0.050) == 64
    assert model.max_tokens_within(0.010) == 0
    # The line goes through each class's 90th-percentile step: one slowed step in ten
    # does not move it, two do.
    for _ in range(6):
        model.observe(4, 0.020)
    model.observe(4, 5.0)
    assert model.predict(4) == pytest.approx(0.020)
    model.observe(4, 0.030)
    assert (model.predict(4) or 0.0) > 0.020
    # The window forgets: a class's last ten steps are what it knows.
    for tokens_fed in (4, 12, 20, 36) * 10:
        model.observe(tokens_fed, 0.010 * tokens_fed)
    assert model.predict(100) == pytest.approx(1.0)
    assert model.num_steps == 40


class GivenStepTimes(StepTimeModel):
    """A step-time model that keeps the steps the test gives it and ignores the
    engine's own (whose times depend on this machine)."""

    frozen = False

    def observe(self, tokens: int, seconds: float) -> None:
        if not self.frozen:
            super().observe(tokens, seconds)


def test_the_chunk_keeps_the_step_within_the_tbt_slo(model: LoadedModel) -> None:
    step_time = GivenStepTimes()
    for tokens_fed in (3, 10, 30):  # 10 ms a step plus 1 ms a token
        step_time.observe(tokens_fed, 0.010 + 0.001 * tokens_fed)
    step_time.frozen = True
    engine = Engine(model, tbt_slo_s=0.025, max_chunk_tokens=64, step_time=step_time)
    for rid, n, params in OTHERS:
        engine.hand_off(rid, prompt(n, n), params)
    # Nothing runs yet, but the three waiting requests will be in the next step.
    assert engine.batcher.prompt_chunk_budget() == 15 - 3
    assert engine.batcher.predicted_step_seconds(12) == pytest.approx(0.025)
    # 30 tokens: chunks of 12, 12 and 6 beside the 3 decode tokens.
    assert engine.batcher.predicted_prompt_seconds(30) == pytest.approx(0.025 + 0.025 + 0.019)
    engine.batcher.add_prompt("r", prompt(30, 1), GREEDY)
    # A second prompt waits for the first's 30 tokens: 60 in chunks of 12.
    assert engine.batcher.predicted_prompt_seconds(30) == pytest.approx(5 * 0.025)
    engine.step()
    assert engine.batcher.prompt_chunks("r") == [12]
    # A tighter SLO than the decode batch alone meets: one token a step, never none.
    engine.batcher.tbt_slo_s = 0.012
    engine.step()
    assert engine.batcher.prompt_chunks("r") == [12, 1]
    # No SLO, or nothing running: the whole budget.
    idle = Engine(model, tbt_slo_s=0.025, max_chunk_tokens=64, step_time=step_time)
    assert idle.batcher.prompt_chunk_budget() == 64


def test_before_any_step_is_timed_a_chunk_beside_running_requests_is_one_page(
    model: LoadedModel,
) -> None:
    engine = Engine(model, tbt_slo_s=0.050, max_chunk_tokens=64)
    engine.hand_off("a", prompt(6, 1), GREEDY)
    assert engine.batcher.prompt_chunk_budget() == BLOCK


def test_mixed_forward_equals_decode_and_prefill_apart(model: LoadedModel) -> None:
    cache = PagedKVCache(model.config, 64, BLOCK)
    runner = ModelRunner(model, cache)
    alloc = PageAllocator(64)
    seqs = []
    for n in (5, 11):
        ids = prompt(n, n)
        pages = alloc.allocate(cache.pages_for(n + 1))
        runner.prefill(ids, pages)
        seqs.append(DecodeSeq(pages, n, ids[-1]))
    ids = prompt(19, 3)
    pages = alloc.allocate(cache.pages_for(len(ids)))
    runner.prefill(ids[:7], pages)
    saved = cache.kv.clone()
    decode_alone = runner.decode(seqs)
    prefill_alone = runner.prefill(ids, pages, num_cached_tokens=7)
    cache.kv.copy_(saved)
    decode_mixed, prompt_logits = runner.mixed(seqs, PrefillChunk(ids[7:], pages, 7, True))
    assert prompt_logits is not None
    torch.testing.assert_close(decode_mixed, decode_alone, rtol=0, atol=LOGPROB_TOL)
    torch.testing.assert_close(prompt_logits, prefill_alone, rtol=0, atol=LOGPROB_TOL)
    # A middle chunk: no logits, its KV written all the same.
    cache.kv.copy_(saved)
    _, none = runner.mixed(seqs, PrefillChunk(ids[7:12], pages, 7, False))
    assert none is None
    _, none = runner.mixed([], PrefillChunk(ids[12:15], pages, 12, False))
    assert none is None
    _, last = runner.mixed([], PrefillChunk(ids[15:], pages, 15, True))
    assert last is not None
    torch.testing.assert_close(last, prefill_alone, rtol=0, atol=LOGPROB_TOL)
