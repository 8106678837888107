"""Issue 17's sampling features in the engine, on the tiny model: logprobs, penalties,
logit_bias, a JSON-schema grammar, n = 3, priorities and resuming after k tokens.

The claim under test is that they survive disaggregation: for greedy and seeded
sampling, a request run whole on one engine gives the tokens, text and logprobs it
gives when a prefill engine computes the prompt and samples the first tokens, the KV
is copied into another engine's (differently numbered) pages and that engine's batcher
decodes the rest; and a request re-planned after k tokens continues as if nothing
happened.
"""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest
import torch

from yb_core.protocol import SamplingParams, TokenLogprob
from yb_engine import (
    ChoiceState,
    DecodeBatcher,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    TokenOutput,
    sample_first_tokens,
    tiny_random_model,
)
from yb_text.grammar import json_schema_grammar

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_random_model(0)


class Engine:
    """One engine's cache, allocator, runner and batcher."""

    def __init__(self, model: LoadedModel, num_pages: int = 256, max_batch: int = 8) -> None:
        self.model = model
        self.cache = PagedKVCache(model.config, num_pages, BLOCK)
        self.alloc = PageAllocator(num_pages)
        self.runner = ModelRunner(model, self.cache)
        self.batcher = DecodeBatcher(self.runner, self.alloc, model.tokenizer, max_batch)

    def prefill(
        self, ids: list[int], params: SamplingParams, generated: int = 0
    ) -> tuple[list[int], list[int], list[TokenLogprob | None]]:
        """What a prefill engine does: the prompt's KV, every choice's first token."""
        pages = self.alloc.allocate(self.cache.pages_for(len(ids)))
        logits = self.runner.prefill(ids, pages)
        first = sample_first_tokens(
            logits,
            params,
            ids[len(ids) - generated :] if generated else [],
            tokenizer=self.model.tokenizer,
            eos_token_ids=self.model.config.eos_token_ids,
        )
        return pages, [s.token_id for s in first], [s.logprob for s in first]

    def run(self) -> dict[tuple[str, int], list[TokenOutput]]:
        out: dict[tuple[str, int], list[TokenOutput]] = {}
        while self.batcher.has_work():
            for o in self.batcher.step():
                out.setdefault((o.request_id, o.index), []).append(o)
        return out


def admit(
    engine: Engine,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    *,
    prefill_on: Engine | None = None,
    generated: int = 0,
    priority: int = 0,
) -> None:
    """Prefill on `prefill_on` (this engine when None), copy the KV over, decode here."""
    source = prefill_on or engine
    pages, firsts, logprobs = source.prefill(ids, params, generated)
    if source is not engine:
        mine = engine.alloc.allocate(len(pages))
        engine.cache.kv[:, mine] = source.cache.kv[:, pages]
        source.alloc.free(pages)
        pages = mine
    engine.batcher.add(
        rid,
        ids,
        pages,
        firsts[0],
        params,
        first_tokens=firsts if params.n > 1 else None,
        first_logprobs=[lp for lp in logprobs if lp is not None] or None,
        generated_tokens=generated,
        priority=priority,
    )


def whole(model: LoadedModel, ids: list[int], params: SamplingParams) -> list[list[TokenOutput]]:
    engine = Engine(model)
    admit(engine, "r", ids, params)
    outs = engine.run()
    assert engine.alloc.num_used == 0
    return [outs[("r", i)] for i in range(params.n)]


def split(model: LoadedModel, ids: list[int], params: SamplingParams) -> list[list[TokenOutput]]:
    prefill, decode = Engine(model), Engine(model)
    decode.alloc.allocate(37)  # so the decode engine's page ids differ from prefill's
    admit(decode, "r", ids, params, prefill_on=prefill)
    outs = decode.run()
    assert decode.alloc.num_used == 37 and decode.batcher.kv_pages_used == 0
    return [outs[("r", i)] for i in range(params.n)]


def prompt(n: int, seed: int) -> list[int]:
    ids: list[int] = torch.randint(
        3, 256, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return ids


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def text(outs: list[TokenOutput]) -> str:
    return "".join(o.text_delta for o in outs)


def same(a: list[list[TokenOutput]], b: list[list[TokenOutput]]) -> None:
    """Same tokens, text and finish per choice; logprobs equal to 1e-4."""
    assert len(a) == len(b)
    for choice_a, choice_b in zip(a, b, strict=True):
        assert tokens(choice_a) == tokens(choice_b)
        assert text(choice_a) == text(choice_b)
        assert choice_a[-1].finish_reason == choice_b[-1].finish_reason
        assert_logprobs_close(choice_a, choice_b)


def assert_logprobs_close(a: list[TokenOutput], b: list[TokenOutput]) -> None:
    la = [o.logprob for o in a if o.token_id is not None]
    lb = [o.logprob for o in b if o.token_id is not None]
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert (x is None) == (y is None)
        if x is None or y is None:
            continue
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(x.top, y.top, strict=True))


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(seed=7, temperature=1.2, top_p=0.95, max_tokens=16, ignore_eos=True)
MODES = pytest.mark.parametrize("base", [GREEDY, SEEDED], ids=["greedy", "seeded"])


def with_(base: SamplingParams, **changes: object) -> SamplingParams:
    return msgspec.structs.replace(base, **changes)


@MODES
def test_logprobs_are_the_raw_distribution_and_cross_the_split(
    model: LoadedModel, base: SamplingParams
) -> None:
    ids = prompt(11, 1)
    params = with_(base, logprobs=3, temperature=base.temperature and 2.0)
    (one,) = whole(model, ids, params)
    same([one], split(model, ids, params))
    assert all(o.logprob is not None and len(o.logprob.top) == 3 for o in one)
    # The first token's logprob is log_softmax of the prompt's raw logits, whatever the
    # temperature did to the draw.
    runner = ModelRunner(model, PagedKVCache(model.config, 8, BLOCK))
    raw = torch.log_softmax(runner.prefill(ids, list(range(8))).float(), -1)
    first = one[0].logprob
    assert first is not None and first.token_id == one[0].token_id
    assert abs(first.logprob - float(raw[first.token_id])) < 1e-5
    assert [t for t, _ in first.top] == raw.topk(3).indices.tolist()
    off = whole(model, ids, with_(params, logprobs=None))[0]
    assert tokens(off) == tokens(one) and all(o.logprob is None for o in off)


@MODES
def test_penalties_count_the_choices_tokens_and_cross_the_split(
    model: LoadedModel, base: SamplingParams
) -> None:
    ids = prompt(9, 2)
    free = tokens(whole(model, ids, with_(base, max_tokens=24))[0])
    params = with_(base, max_tokens=24, frequency_penalty=1.5, presence_penalty=1.0)
    (one,) = whole(model, ids, params)
    same([one], split(model, ids, params))
    assert tokens(one) != free
    # Repeats are what penalties cut.
    assert max(Counter(tokens(one)).values()) <= max(Counter(free).values())


def test_penalty_arithmetic_is_openais() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 3.0})
    state = ChoiceState.rebuild(params, [1, 1, 2])
    row = torch.zeros(6)
    state.process(row)
    assert row.tolist() == [0.0, -1.25, -0.75, 0.0, 3.0, 0.0]


@MODES
def test_logit_bias_forces_a_token(model: LoadedModel, base: SamplingParams) -> None:
    ids = prompt(7, 3)
    params = with_(base, logit_bias={42: 100.0}, max_tokens=6)
    (one,) = whole(model, ids, params)
    assert tokens(one) == [42] * 6
    same([one], split(model, ids, params))
    banned = tokens(whole(model, ids, with_(base, max_tokens=6))[0])[0]
    params = with_(base, logit_bias={banned: -100.0}, max_tokens=6)
    assert banned not in tokens(whole(model, ids, params)[0])


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
#: A tool call as the gateway's tool grammar asks for one: the function's name and
#: arguments that follow its parameters' schema.
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@MODES
@pytest.mark.parametrize("schema", [SCHEMA, TOOL_CALL], ids=["schema", "tool_call"])
def test_grammar_output_parses_follows_the_schema_and_crosses_the_split(
    model: LoadedModel, base: SamplingParams, schema: dict[str, object]
) -> None:
    ids = prompt(10, 4)
    params = with_(base, grammar=json_schema_grammar(schema), max_tokens=120, ignore_eos=False)
    (one,) = whole(model, ids, params)
    same([one], split(model, ids, params))
    assert one[-1].finish_reason == "stop"  # the grammar ended the choice
    value = json.loads(text(one))
    if schema is SCHEMA:
        assert set(value) == {"ok", "color", "n"}
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99
    else:
        assert value["name"] == "get_weather"
        assert value["arguments"]["city"] in ("Paris", "Oslo")
        assert value["arguments"]["days"] in (1, 2, 3)


@MODES
def test_n_choices_share_the_prompt_and_cross_the_split(
    model: LoadedModel, base: SamplingParams
) -> None:
    ids = prompt(10, 5)  # 10 tokens: two full pages shared, the third copied
    # Hot, so the seeded choices part ways (the tiny model's logits are peaked).
    params = with_(base, n=3, logprobs=1, max_tokens=12, temperature=base.temperature and 4.0)
    choices = whole(model, ids, params)
    same(choices, split(model, ids, params))
    assert all(len(tokens(c)) == 12 and c[-1].finish_reason == "length" for c in choices)
    # Choice 0 is what the request with n = 1 would draw.
    assert tokens(choices[0]) == tokens(whole(model, ids, with_(params, n=1))[0])
    if base is SEEDED:
        assert len({tuple(tokens(c)) for c in choices}) == 3
    else:
        assert all(tokens(c) == tokens(choices[0]) for c in choices)


def test_n_choices_end_on_their_own_and_free_shared_pages_last(model: LoadedModel) -> None:
    ids = prompt(10, 6)
    params = with_(SEEDED, n=3, max_tokens=30, stop=["a", "e", "o"])
    engine = Engine(model)
    admit(engine, "r", ids, params)
    assert engine.alloc.num_used == 3 + 2  # the prompt's pages and two copies
    ended: dict[int, str | None] = {}
    while engine.batcher.has_work():
        for o in engine.batcher.step():
            if o.finished:
                ended[o.index] = o.finish_reason
        if len(ended) == 1:
            # One choice gone: the shared pages stay for the others.
            assert engine.alloc.num_used >= 2
    assert set(ended) == {0, 1, 2} and engine.alloc.num_used == 0


def test_n_choices_run_out_of_pages_one_at_a_time(model: LoadedModel) -> None:
    """Out of pages, the newest choice ends with kv_exhausted; the others go on and the
    choices that finished hold the same tokens as with pages to spare."""
    ids = prompt(10, 13)
    params = with_(SEEDED, n=3, max_tokens=24, temperature=4.0)
    roomy = whole(model, ids, params)
    # 3 prompt pages + 2 copies = 5; 11 pages let the choices grow by 6 pages together.
    engine = Engine(model, num_pages=11)
    admit(engine, "r", ids, params)
    small = Engine(model, num_pages=4)
    pages = small.alloc.allocate(3)
    with pytest.raises(ValueError, match="no pages for 3 choices"):
        small.batcher.add("x", ids, pages, 1, params, first_tokens=[1, 2, 3])
    assert small.alloc.num_used == 3 and not small.batcher.has_work()  # nothing taken
    outs = engine.run()
    reasons = [outs[("r", i)][-1].finish_reason for i in range(3)]
    assert "kv_exhausted" in reasons and "length" in reasons
    for i, reason in enumerate(reasons):
        got = tokens(outs[("r", i)])
        assert got == tokens(roomy[i])[: len(got)]
        assert (reason == "length") == (len(got) == 24)
    assert engine.alloc.num_used == 0


@MODES
def test_resume_after_k_tokens_continues_the_same_output(
    model: LoadedModel, base: SamplingParams
) -> None:
    ids = prompt(9, 7)
    params = with_(base, max_tokens=20, logprobs=2, frequency_penalty=0.7, stop=["zzz"])
    (full,) = whole(model, ids, params)
    for k in (1, 6):
        delivered = full[:k]
        # A re-plan: the prompt plus the k tokens the client has, prefilled anew on one
        # engine, decoded on another.
        prefill, decode = Engine(model), Engine(model)
        resumed_ids = ids + tokens(delivered)
        admit(decode, "r", resumed_ids, params, prefill_on=prefill, generated=k)
        rest = decode.run()[("r", 0)]
        assert tokens(delivered) + tokens(rest) == tokens(full), f"k={k}"
        assert text(delivered) + text(rest) == text(full)
        assert rest[-1].finish_reason == "length"  # max_tokens counted the k tokens
        assert_logprobs_close(full[k:], rest)


def test_resume_with_a_grammar_keeps_the_parse(model: LoadedModel) -> None:
    ids = prompt(8, 8)
    params = with_(SEEDED, grammar=json_schema_grammar(SCHEMA), max_tokens=60, ignore_eos=False)
    (full,) = whole(model, ids, params)
    k = 5
    engine = Engine(model)
    admit(engine, "r", ids + tokens(full[:k]), params, generated=k)
    rest = engine.run()[("r", 0)]
    assert tokens(full[:k]) + tokens(rest) == tokens(full)
    json.loads(text(full[:k]) + text(rest))


def test_waiting_requests_are_admitted_by_priority_then_arrival(model: LoadedModel) -> None:
    engine = Engine(model, max_batch=1)
    params = with_(GREEDY, max_tokens=3)
    for rid, priority in (("low", 0), ("high", 5), ("mid", 1), ("high2", 5)):
        admit(engine, rid, prompt(5, 9), params, priority=priority)
    finished: list[str] = []
    while engine.batcher.has_work():
        finished += [o.request_id for o in engine.batcher.step() if o.finished]
    assert finished == ["high", "high2", "mid", "low"]


def test_out_of_pages_ends_the_lowest_priority_first(model: LoadedModel) -> None:
    params = with_(GREEDY, max_tokens=30)
    engine = Engine(model, num_pages=12)
    admit(engine, "old-low", prompt(8, 10), params, priority=0)
    admit(engine, "new-high", prompt(8, 11), params, priority=3)
    outs = engine.run()
    assert outs[("old-low", 0)][-1].finish_reason == "kv_exhausted"
    assert outs[("new-high", 0)][-1].finish_reason == "length"


def test_discard_frees_and_reports_nothing(model: LoadedModel) -> None:
    engine = Engine(model)
    admit(engine, "r", prompt(6, 12), with_(SEEDED, n=2))
    engine.batcher.step()
    assert engine.batcher.discard("r") and not engine.batcher.discard("r")
    assert engine.alloc.num_used == 0 and engine.batcher.step() == []


# --- the real vocabulary: SmolLM2 -------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    from yb_core.model_files import default_model_cache_dir
    from yb_engine import ensure_default_model, load_model

    return load_model(ensure_default_model(default_model_cache_dir()))


def chat(model: LoadedModel, question: str) -> list[int]:
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids: list[int] = model.tokenizer.encode(text, add_special_tokens=False)
    return ids


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@pytest.mark.slow
@MODES
def test_smollm2_json_n3_logprobs_through_the_split(
    smol: LoadedModel, base: SamplingParams
) -> None:
    """The real tokenizer's 49k tokens under a JSON schema: every choice's text parses
    and follows it, the same on one engine and split, to the logprob."""
    ids = chat(smol, "Describe a fictional programmer as JSON with name, age and languages.")
    params = with_(
        base,
        temperature=base.temperature and 0.8,
        grammar=json_schema_grammar(PERSON),
        n=3,
        logprobs=2,
        max_tokens=200,
        ignore_eos=False,
    )
    choices = whole(smol, ids, params)
    same(choices, split(smol, ids, params))
    for choice in choices:
        assert choice[-1].finish_reason == "stop"
        value = json.loads(text(choice))
        assert set(value) == {"name", "age", "languages"}
        assert isinstance(value["name"], str) and 0 <= value["age"] <= 130
        assert all(isinstance(x, str) for x in value["languages"])
