"""Continuous batching on the tiny model: first token, EOS, stop strings, max_tokens,
page growth and exhaustion, abort, and batch-equals-solo."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from yb_core.protocol import SamplingParams
from yb_engine import (
    DecodeBatcher,
    DecodeSeq,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    Sampler,
    TokenOutput,
    new_generator,
    tiny_random_model,
)
from yb_engine import batcher as batcher_module
from yb_text.detokenize import IncrementalDetokenizer, StopStringFilter

BLOCK = 4  # small pages, so decoding crosses page boundaries often


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_random_model(0)


class Engine:
    """A runner, an allocator and a batcher over one cache, as a decode service has."""

    def __init__(self, model: LoadedModel, num_pages: int = 256, max_batch: int = 8) -> None:
        self.model = model
        self.cache = PagedKVCache(model.config, num_pages, BLOCK)
        self.alloc = PageAllocator(num_pages)
        self.runner = ModelRunner(model, self.cache)
        self.batcher = DecodeBatcher(self.runner, self.alloc, model.tokenizer, max_batch)

    def add(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        preemptible: bool = False,
    ) -> int:
        """Prefill like the prefill engine does, then hand the request to the batcher."""
        pages = self.alloc.allocate(self.cache.pages_for(len(ids)))
        logits = self.runner.prefill(ids, pages)
        first = Sampler().sample(logits[None], [params], [new_generator(params)])[0]
        self.batcher.add(rid, ids, pages, first, params, priority=priority, preemptible=preemptible)
        return first

    def run(self) -> dict[str, list[TokenOutput]]:
        out: dict[str, list[TokenOutput]] = {}
        while self.batcher.has_work():
            for o in self.batcher.step():
                assert not out.get(o.request_id) or not out[o.request_id][-1].finished
                out.setdefault(o.request_id, []).append(o)
        return out


def prompt(n: int, seed: int) -> list[int]:
    ids: list[int] = torch.randint(
        0, 256, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return ids


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def text(outs: list[TokenOutput]) -> str:
    return "".join(o.text_delta for o in outs)


def solo(model: LoadedModel, ids: list[int], params: SamplingParams) -> list[TokenOutput]:
    engine = Engine(model)
    engine.add("solo", ids, params)
    return engine.run()["solo"]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_first_token_is_reported_first_and_max_tokens_counts_it(model: LoadedModel) -> None:
    engine = Engine(model)
    first = engine.add("r", prompt(9, 1), GREEDY)
    assert engine.alloc.num_used == 3
    step1 = engine.batcher.step()
    assert step1[0].token_id == first
    assert len(step1) == 2  # the first token, and the second from this step's decode
    outs = step1 + engine.run()["r"]
    assert len(tokens(outs)) == GREEDY.max_tokens
    assert [o.finished for o in outs] == [False] * (GREEDY.max_tokens - 1) + [True]
    assert outs[-1].finish_reason == "length"
    expected = model.tokenizer.decode(tokens(outs), skip_special_tokens=True)
    assert text(outs) == expected
    assert engine.alloc.num_used == 0 and engine.batcher.kv_pages_used == 0
    assert engine.batcher.last_step_seconds > 0


def test_max_tokens_one_ends_at_the_first_token(model: LoadedModel) -> None:
    engine = Engine(model)
    first = engine.add("r", prompt(5, 2), SamplingParams(temperature=0, max_tokens=1))
    (out,) = engine.batcher.step()
    assert (out.token_id, out.finished, out.finish_reason) == (first, True, "length")
    assert not engine.batcher.has_work() and engine.alloc.num_used == 0


def test_batch_with_waiting_requests_equals_solo_runs(model: LoadedModel) -> None:
    params = [GREEDY] * 4 + [SamplingParams(seed=5, temperature=0.9, max_tokens=24)]
    prompts = [prompt(n, 10 + i) for i, n in enumerate([3, 30, 11, 57, 21])]
    engine = Engine(model, max_batch=3)  # two requests must wait for a slot
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add(f"r{i}", ids, p)
    assert engine.batcher.num_waiting == 5
    batched = engine.run()
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        assert tokens(batched[f"r{i}"]) == tokens(solo(model, ids, p)), f"request r{i}"
    assert engine.alloc.num_used == 0


def test_a_preemptible_request_gives_its_slot_to_a_higher_priority(model: LoadedModel) -> None:
    """Two batch lines fill the batch; an interactive request takes the newest one's
    slot at once, which waits with its KV and goes on once a slot frees: every
    request's tokens are its solo run's. A request of the lines' own priority, or one
    not pre-emptible, takes no slot."""
    engine = Engine(model, max_batch=2)
    now = [0.0]
    engine.batcher.clock = lambda: now[0]
    long = msgspec.structs.replace(GREEDY, max_tokens=12)
    lines = {f"line{i}": prompt(9 + i, 40 + i) for i in range(2)}
    for rid, ids in lines.items():
        engine.add(rid, ids, long, priority=-1, preemptible=True)
    out: dict[str, list[TokenOutput]] = {}

    def step() -> None:
        for o in engine.batcher.step():
            out.setdefault(o.request_id, []).append(o)

    for _ in range(3):
        step()
    same = prompt(7, 50)
    engine.add("same", same, GREEDY, priority=-1)  # the lines' priority: waits
    step()
    assert engine.batcher.num_waiting == 1 and engine.batcher.preemptions == 0
    chat = prompt(5, 51)
    engine.add("chat", chat, GREEDY)
    before = {rid: len(tokens(out.get(rid, []))) for rid in lines}
    step()
    # The newest line gave its slot up and made no progress; the other ran.
    assert engine.batcher.preemptions == 1
    assert len(tokens(out["line1"])) == before["line1"]
    assert len(tokens(out["line0"])) == before["line0"] + 1
    assert tokens(out["chat"])
    while engine.batcher.has_work():
        step()
    for rid, ids, p in [*((r, i, long) for r, i in lines.items()), ("chat", chat, GREEDY)]:
        assert tokens(out[rid]) == tokens(solo(model, ids, p)), rid
    assert tokens(out["same"]) == tokens(solo(model, same, GREEDY))
    assert engine.alloc.num_used == 0


def test_a_preemptible_request_paused_long_enough_pauses_no_more(model: LoadedModel) -> None:
    engine = Engine(model, max_batch=1)
    now = [0.0]
    engine.batcher.clock = lambda: now[0]
    line = prompt(9, 60)
    engine.add(
        "line", line, msgspec.structs.replace(GREEDY, max_tokens=40), preemptible=True, priority=-1
    )
    engine.batcher.step()
    engine.add("chat0", prompt(5, 61), msgspec.structs.replace(GREEDY, max_tokens=40))
    engine.batcher.step()
    assert engine.batcher.preemptions == 1 and engine.batcher.num_waiting == 1
    now[0] = batcher_module.MAX_PAUSED_S
    # Overdue: it takes the next slot ahead of a request of a higher priority, and
    # then keeps it.
    engine.batcher.abort("chat0")
    engine.add("chat1", prompt(5, 62), GREEDY)
    outs = engine.batcher.step()
    assert any(o.request_id == "line" and o.token_id is not None for o in outs)
    engine.add("chat2", prompt(5, 63), GREEDY)
    engine.batcher.step()
    assert engine.batcher.preemptions == 1
    assert engine.batcher.num_running == 1 and engine.batcher.num_waiting == 2
    for rid in ("line", "chat1", "chat2"):
        engine.batcher.abort(rid)
    engine.batcher.step()
    assert engine.alloc.num_used == 0


def test_seeded_request_continues_the_stream_prefill_started(model: LoadedModel) -> None:
    """Prefill's first draw plus the batcher's draws equal one generator's draws."""
    ids = prompt(10, 12)
    params = SamplingParams(seed=3, temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = solo(model, ids, params)
    cache = PagedKVCache(model.config, 16, BLOCK)
    runner = ModelRunner(model, cache)
    table = list(range(16))
    gen = new_generator(params)
    expected = [Sampler().sample(runner.prefill(ids, table)[None], [params], [gen])[0]]
    for pos in range(len(ids), len(ids) + 15):
        logits = runner.decode([DecodeSeq(table, pos, expected[-1])])
        expected.append(Sampler().sample(logits, [params], [gen])[0])
    assert tokens(outs) == expected


def with_eos(model: LoadedModel, eos: int) -> LoadedModel:
    config = msgspec.structs.replace(model.config, eos_token_ids=(eos,))
    return dataclasses.replace(model, config=config)


def test_eos_stops_unless_ignored(model: LoadedModel) -> None:
    ids = prompt(12, 3)
    free_run = tokens(solo(model, ids, GREEDY))
    # an EOS id that first appears at index k > 1 of the free run
    k = next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i])
    eos_model = with_eos(model, free_run[k])
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = solo(eos_model, ids, params)
    assert tokens(outs) == free_run[: k + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].token_id == free_run[k]
    assert text(outs) == model.tokenizer.decode(free_run[:k], skip_special_tokens=True)
    ignored = solo(eos_model, ids, msgspec.structs.replace(params, ignore_eos=True))
    assert tokens(ignored) == free_run


def test_stop_string_cuts_the_text_before_it(model: LoadedModel) -> None:
    ids = prompt(8, 4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = text(solo(model, ids, params))
    assert len(full) > 20
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.find(stop)
    outs = solo(model, ids, msgspec.structs.replace(params, stop=["never-there", stop]))
    assert outs[-1].finish_reason == "stop"
    assert text(outs) == full[:cut]
    assert len(tokens(outs)) < 40


def test_pages_run_out_newest_request_ends_with_kv_exhausted(model: LoadedModel) -> None:
    ids_old, ids_new = prompt(8, 5), prompt(8, 6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    # 8-token prompts take 2 pages each; 12 pages let them grow to 48 tokens together,
    # not to 2 * 38.
    engine = Engine(model, num_pages=12)
    engine.add("old", ids_old, params)
    engine.add("new", ids_new, params)
    outs = engine.run()
    assert outs["new"][-1].finish_reason == "kv_exhausted"
    assert outs["new"][-1].token_id is None
    assert "KV cache exhausted" in (outs["new"][-1].message or "")
    assert outs["old"][-1].finish_reason == "length"
    # the survivor's KV was never touched by the other request
    assert tokens(outs["old"]) == tokens(solo(model, ids_old, params))
    assert tokens(outs["new"]) == tokens(solo(model, ids_new, params))[: len(tokens(outs["new"]))]
    assert engine.alloc.num_used == 0


def test_abort_frees_pages_and_is_reported(model: LoadedModel) -> None:
    engine = Engine(model)
    engine.add("a", prompt(9, 7), GREEDY)
    engine.add("b", prompt(9, 8), GREEDY)
    engine.batcher.step()
    used = engine.alloc.num_used
    assert engine.batcher.abort("a")
    assert not engine.batcher.abort("a") and not engine.batcher.abort("nobody")
    assert engine.alloc.num_used < used and engine.batcher.num_running == 1
    outs = engine.batcher.step()
    assert outs[0] == TokenOutput("a", None, "", True, "abort")
    assert [o.request_id for o in outs[1:]] == ["b"]


def test_add_validates_before_taking_ownership(model: LoadedModel) -> None:
    engine = Engine(model)
    engine.add("a", prompt(4, 9), GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.batcher.add("a", prompt(4, 9), [7], 1, GREEDY)
    with pytest.raises(ValueError, match="cannot hold"):
        engine.batcher.add("b", prompt(9, 9), [7, 8], 1, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.batcher.add("c", prompt(4, 9), [7], 1, SamplingParams(max_tokens=0))


def test_incremental_detokenizer_holds_incomplete_characters(model: LoadedModel) -> None:
    tok = model.tokenizer
    sentence = "the café in 東京 is 🙂 ok"
    ids = tok.encode(sentence)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == sentence
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # the byte-level tokens of 東 alone are not text yet


def test_stop_filter_holds_possible_stop_prefixes() -> None:
    f = StopStringFilter(["o W", "xyz"])
    assert f.feed("Hel") == ("Hel", False)
    assert f.feed("lo Wo") == ("l", True)
    g = StopStringFilter(["abc"])
    assert g.feed("xab") == ("x", False)  # "ab" might become "abc"
    assert g.feed("d") == ("abd", False)
    assert g.feed("a") == ("", False)
    assert g.flush() == "a"
    h = StopStringFilter(["ab", "b"])
    assert h.feed("xab") == ("x", True)  # the earliest stop wins
