"""Issue 17's sampling features through real services: a prefill instance and a decode
instance on a real bus, the prompt's KV over real UCX, the tiny model.

Each request is sent as a gateway would (a `PrefillJob` on the bus, its chunks read
from its token subject) and must give what one engine running it whole in this process
gives: the same tokens, text and finish per choice, logprobs equal to 1e-4, with
greedy and seeded sampling. Covered: a JSON-schema grammar with logprobs, n = 3 with
logprobs, and a re-planned request resuming after k delivered tokens; and a decode
instance making way for a newer attempt of a request it holds. Last, a decode instance
with `piggyback` taking jobs itself: refusing those it cannot run in its batch, and
giving one engine's output for one whose planned prefix it cannot fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus
from yb_core.config import (
    DecodeEngineConfig,
    ModelConfig,
    NatsConfig,
    PrefillEngineConfig,
    TelemetryConfig,
    YbConfig,
)
from yb_core.hashing import block_hashes, model_identity
from yb_core.service import Service
from yb_decode.service import DecodeService
from yb_engine import (
    DecodeBatcher,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    TokenOutput,
    sample_first_tokens,
)
from yb_prefill.service import PrefillService
from yb_text.grammar import json_schema_grammar

BLOCK = 16
CHUNK = 32
#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0
MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=BLOCK, max_model_len=1024)


def cfg(nats: NatsConfig, instance: str) -> YbConfig:
    return YbConfig(
        instance_id=instance,
        host="h0",
        nats=nats,
        model=MODEL,
        prefill=PrefillEngineConfig(
            num_kv_pages=64, threads=1, chunk_size=CHUNK, load_report_interval_s=0.5
        ),
        decode=DecodeEngineConfig(num_kv_pages=128, threads=1, load_report_interval_s=0.5),
        telemetry=TelemetryConfig(log_json=False),
    )


@dataclass
class Choice:
    """What one choice of a request gave."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[pr.TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    #: The text each output added (one engine's run only).
    deltas: list[str] = field(default_factory=list)


@dataclass
class Split:
    """A prefill and a decode service in this process."""

    bus: Bus
    prefill: PrefillService
    decode: DecodeService

    @property
    def model(self) -> LoadedModel:
        return self.decode.worker.engine.model

    async def run(
        self, tokens: list[int], params: pr.SamplingParams, *, generated: int = 0, attempt: int = 0
    ) -> list[Choice]:
        """Send a job as a gateway would; each choice's output, read from its chunks."""
        rid = f"req-{uuid.uuid4().hex[:8]}"
        subject = pr.token_subject("gw", rid)
        chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

        async def on_chunk(msg: Msg) -> None:
            chunks.put_nowait(pr.token_decoder.decode(msg.data))

        sub = await self.bus.subscribe(subject, cb=on_chunk)
        job = pr.PrefillJob(
            request_id=rid,
            token_ids=tokens,
            block_hashes=block_hashes(tokens, BLOCK, model_identity(MODEL.name)),
            sampling=params,
            decision=ev.RequestScheduled(
                request_id=rid,
                gateway_id="gw",
                prefill_instance="prefill-0",
                decode_instance="decode-0",
                time=time.time(),
            ),
            token_subject=subject,
            deadline=time.time() + 2 * DEADLINE_S,
            attempt=attempt,
            generated_tokens=generated,
        )
        choices = [Choice() for _ in range(params.n)]
        try:
            reply = await self.bus.request(
                pr.prefill_job_subject("prefill-0"), pr.encode(job), timeout_s=DEADLINE_S
            )
            assert isinstance(pr.job_reply_decoder.decode(reply.data), pr.JobAccepted)
            seq = 0
            async with asyncio.timeout(DEADLINE_S):
                while any(c.finish is None for c in choices):
                    chunk = await chunks.get()
                    assert not chunk.error, chunk.error
                    assert (chunk.seq, chunk.attempt) == (seq, attempt)
                    # The client's prompt, without the output a resumed request had.
                    assert chunk.prompt_tokens == len(tokens) - generated
                    seq += 1
                    choice = choices[chunk.index]
                    assert choice.finish is None
                    choice.tokens += chunk.token_ids
                    choice.text += chunk.text
                    choice.logprobs += chunk.logprobs
                    if chunk.finished:
                        choice.finish = chunk.finish_reason
        finally:
            await sub.unsubscribe()
        return choices


@pytest.fixture
async def split(bus: Bus, nats_config: NatsConfig) -> AsyncIterator[Split]:
    services: list[Service] = []
    try:
        decode = DecodeService(cfg(nats_config, "decode-0"))
        prefill = PrefillService(cfg(nats_config, "prefill-0"))
        for service in (decode, prefill):
            services.append(service)
            await service.start()
        yield Split(bus, prefill, decode)
    finally:
        for service in reversed(services):
            with contextlib.suppress(Exception):
                await service.stop()


def one_engine(model: LoadedModel, ids: list[int], params: pr.SamplingParams) -> list[Choice]:
    """The request run whole on one engine in this process: prefill (chunked as the
    prefill instance chunks) and the decode batcher on the same cache."""
    cache = PagedKVCache(model.config, 64, BLOCK)
    allocator = PageAllocator(64)
    runner = ModelRunner(model, cache)
    batcher = DecodeBatcher(runner, allocator, model.tokenizer, 8)
    pages = allocator.allocate(cache.pages_for(len(ids)))
    first = sample_first_tokens(
        runner.prefill(ids, pages, chunk_size=CHUNK),
        params,
        tokenizer=model.tokenizer,
        eos_token_ids=model.config.eos_token_ids,
    )
    batcher.add(
        "r",
        ids,
        pages,
        first[0].token_id,
        params,
        first_tokens=[s.token_id for s in first],
        first_logprobs=[s.logprob for s in first if s.logprob is not None] or None,
    )
    outs: list[TokenOutput] = []
    while batcher.has_work():
        outs += batcher.step()
    choices = [Choice() for _ in range(params.n)]
    for out in outs:
        choice = choices[out.index]
        if out.token_id is not None:
            choice.tokens.append(out.token_id)
        choice.text += out.text_delta
        choice.deltas.append(out.text_delta)
        if out.logprob is not None:
            choice.logprobs.append(out.logprob)
        if out.finished:
            choice.finish = "length" if out.finish_reason == "kv_exhausted" else out.finish_reason
    return choices


def assert_same(served: list[Choice], expected: list[Choice]) -> None:
    assert len(served) == len(expected)
    for i, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert (got.tokens, got.text, got.finish) == (want.tokens, want.text, want.finish), i
        assert len(got.logprobs) == len(want.logprobs)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(a.top, b.top, strict=True))


def prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


SCHEMA = {
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
GREEDY = pr.SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = pr.SamplingParams(seed=11, temperature=3.0, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("base", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_sampling_features_give_one_engines_output_through_the_split(
    split: Split, base: pr.SamplingParams
) -> None:
    model = split.model
    # A grammar (a tool call's shape) with logprobs: JSON that parses and validates.
    ids = prompt(1, 2 * BLOCK + 5)
    params = msgspec.structs.replace(
        base, grammar=json_schema_grammar(SCHEMA), logprobs=2, max_tokens=120, ignore_eos=False
    )
    (call,) = served = await split.run(ids, params)
    assert_same(served, one_engine(model, ids, params))
    assert call.finish == "stop"
    value = json.loads(call.text)
    assert value["name"] == "get_weather" and value["arguments"]["days"] in (1, 2, 3)

    # n = 3 with logprobs, the prompt's last page partly filled (so copied per choice).
    ids = prompt(2, 3 * BLOCK + 7)
    params = msgspec.structs.replace(base, n=3, logprobs=1)
    served = await split.run(ids, params)
    assert_same(served, one_engine(model, ids, params))

    # Re-planned after k delivered tokens: prompt plus those tokens prefilled anew,
    # attempt 1; the rest is the undisturbed run's rest.
    ids = prompt(3, BLOCK + 3)
    params = msgspec.structs.replace(base, logprobs=2, frequency_penalty=0.5, max_tokens=16)
    (whole,) = one_engine(model, ids, params)
    k = 5
    (rest,) = await split.run(ids + whole.tokens[:k], params, generated=k, attempt=1)
    assert whole.tokens[:k] + rest.tokens == whole.tokens
    assert rest.finish == "length"  # max_tokens counted the delivered tokens
    # The client had the text of the first k outputs: the rest follows it exactly.
    assert "".join(whole.deltas[:k]) + rest.text == whole.text
    assert len(rest.logprobs) == len(whole.logprobs) - k
    for a, b in zip(rest.logprobs, whole.logprobs[k:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    # All pages back: the decode instance's and the prefill's beyond its cache.
    deadline = time.monotonic() + DEADLINE_S
    while split.decode.worker.engine.allocator.num_used and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert split.decode.worker.engine.allocator.num_used == 0


async def test_decode_makes_way_for_a_newer_attempt(split: Split) -> None:
    """A reservation of attempt 1 replaces the attempt-0 one held; attempt 0 again is
    refused; the pages of the replaced one are freed."""
    worker = split.decode.worker
    ids = prompt(4, 2 * BLOCK + 1)

    async def reserve(attempt: int) -> pr.DecodeReply:
        message = pr.ReserveKV(
            request_id="r-replan",
            prefill_instance="prefill-0",
            num_tokens=len(ids),
            sampling=pr.SamplingParams(max_tokens=4),
            token_subject=pr.token_subject("gw", "r-replan"),
            deadline=time.time() + DEADLINE_S,
            prompt_token_ids=ids,
            attempt=attempt,
        )
        reply = await split.bus.request(
            pr.decode_control_subject("decode-0"), pr.encode(message), timeout_s=DEADLINE_S
        )
        return pr.decode_reply_decoder.decode(reply.data)

    assert isinstance(await reserve(0), pr.KVReserved)
    assert worker.engine.allocator.num_used == 3
    assert isinstance(await reserve(1), pr.KVReserved)
    assert worker.engine.allocator.num_used == 3  # the old reservation's pages freed
    refused = await reserve(0)
    assert isinstance(refused, pr.ReserveRefused) and "attempt 1" in refused.reason
    assert worker._pending["r-replan"].reserve.attempt == 1
    abort = pr.AbortReservation(request_id="r-replan", reason="test over")
    await split.bus.request(
        pr.decode_control_subject("decode-0"), pr.encode(abort), timeout_s=DEADLINE_S
    )
    assert worker.engine.allocator.num_used == 0


# --- the same request prefilled inside the decode batch (piggybacking) ----------------
#
# A decode instance with `piggyback` takes jobs on its prefill job subject: a job of a
# decision that is not piggybacked, or of a prefill group, is refused with its reason;
# a piggybacked job whose planned prefix cannot be fetched (its kvstore is not up)
# computes those blocks instead and gives one engine's tokens.

DECODE = "decode-0"


def piggyback_cfg(nats: NatsConfig) -> YbConfig:
    config = cfg(nats, DECODE)
    config.decode = msgspec.structs.replace(config.decode, piggyback=True)
    return config


@pytest.fixture
async def decode(nats_config: NatsConfig) -> AsyncIterator[DecodeService]:
    service = DecodeService(piggyback_cfg(nats_config))
    await service.start()
    try:
        yield service
    finally:
        with contextlib.suppress(Exception):
            await service.stop()


def job(ids: list[int], params: pr.SamplingParams, decision: ev.RequestScheduled) -> pr.PrefillJob:
    return pr.PrefillJob(
        request_id=decision.request_id,
        token_ids=ids,
        block_hashes=block_hashes(ids, BLOCK, model_identity(MODEL.name)),
        sampling=params,
        decision=decision,
        token_subject=pr.token_subject("gw", decision.request_id),
        deadline=time.time() + 2 * DEADLINE_S,
    )


def decision(**fields: object) -> ev.RequestScheduled:
    base = ev.RequestScheduled(
        request_id=f"req-{uuid.uuid4().hex[:8]}",
        gateway_id="gw",
        prefill_instance=DECODE,
        decode_instance=DECODE,
        time=time.time(),
        piggyback=True,
    )
    return msgspec.structs.replace(base, **fields)


async def hand(bus: Bus, sent: pr.PrefillJob) -> pr.JobReply:
    reply = await bus.request(pr.prefill_job_subject(DECODE), pr.encode(sent), timeout_s=DEADLINE_S)
    return pr.job_reply_decoder.decode(reply.data)


async def test_jobs_it_cannot_run_inside_its_batch_are_refused_with_the_reason(
    bus: Bus, decode: DecodeService
) -> None:
    ids = prompt(1, 40)
    params = pr.SamplingParams(temperature=0.0, max_tokens=4)
    cases = {
        "not piggybacked": decision(piggyback=False, prefill_instance="prefill-0"),
        "planned for prefill-1 and decode-0": decision(prefill_instance="prefill-1"),
        "prefill group": decision(prefill_stages=[DECODE, "prefill-1"]),
    }
    for expected, planned in cases.items():
        reply = await hand(bus, job(ids, params, planned))
        assert isinstance(reply, pr.JobRefused), (expected, reply)
        assert expected in reply.reason and not reply.retryable, (expected, reply.reason)
    too_long = msgspec.structs.replace(params, max_tokens=MODEL.max_model_len)
    reply = await hand(bus, job(ids, too_long, decision()))
    assert isinstance(reply, pr.JobRefused) and "exceeds" in reply.reason, reply


async def test_a_prefix_it_cannot_fetch_is_computed_and_the_tokens_are_one_engines(
    bus: Bus, decode: DecodeService
) -> None:
    ids = prompt(2, 3 * BLOCK + 5)
    params = pr.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2, logprobs=2)
    # Two blocks planned from a kvstore that never announced itself.
    plan = [ev.ReusePlan(source_instance="kvstore-9", tier="dram", first_block=0, num_blocks=2)]
    sent = job(ids, params, decision(reuse=plan, reused_blocks=2))
    chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

    async def on_chunk(msg: Msg) -> None:
        chunks.put_nowait(pr.token_decoder.decode(msg.data))

    sub = await bus.subscribe(sent.token_subject, cb=on_chunk)
    try:
        assert isinstance(await hand(bus, sent), pr.JobAccepted)
        choices = [Choice() for _ in range(params.n)]
        seq = 0
        async with asyncio.timeout(DEADLINE_S):
            while any(c.finish is None for c in choices):
                chunk = await chunks.get()
                assert not chunk.error, chunk.error
                assert chunk.seq == seq and chunk.cached_tokens == 0
                assert chunk.prompt_tokens == len(ids)
                seq += 1
                choice = choices[chunk.index]
                choice.tokens += chunk.token_ids
                choice.text += chunk.text
                choice.logprobs += chunk.logprobs
                if chunk.finished:
                    choice.finish = chunk.finish_reason
    finally:
        await sub.unsubscribe()
    assert_same(choices, one_engine(decode.worker.engine.model, ids, params))
    # Nothing is held once the request ended.
    assert decode.worker.engine.allocator.num_used == 0
