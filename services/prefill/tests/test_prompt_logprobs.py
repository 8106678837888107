"""A prompt's own logprobs (completions' `echo` with `logprobs`) through real services:
a prefill and a decode instance on a real bus, the KV over real UCX, the tiny model.

The prefill computes them from every row's logits (`ModelRunner.prefill(...,
all_logits=True)`), the hand-over carries them to decode, and decode streams them
ahead of the first token. They must equal what the engine computes directly (1e-5),
also when the prompt's prefix is cached and the decision plans to reuse it: such a
request computes its prompt from the first token (a reused prefix has no logits),
which is counted. Jobs that cannot compute them refuse them with the reason: a decode
batch (piggybacking) and a prefill group; a batch of short prompts never takes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch
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
from yb_decode import piggyback
from yb_decode.service import DecodeService
from yb_engine import LoadedModel, ModelRunner, PageAllocator, PagedKVCache
from yb_prefill.batching import take_group
from yb_prefill.prompt_logprobs import prompt_logprobs
from yb_prefill.service import PrefillService

BLOCK = 16
CHUNK = 32
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
class Served:
    """What a request's stream gave."""

    prompt_logprobs: list[pr.TokenLogprob] = field(default_factory=list)
    #: How many chunks carried prompt logprobs (all before the first token).
    prompt_chunks: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    cached_tokens: int = 0


@dataclass
class Split:
    bus: Bus
    prefill: PrefillService
    decode: DecodeService

    @property
    def model(self) -> LoadedModel:
        return self.decode.worker.engine.model

    async def run(
        self,
        ids: list[int],
        params: pr.SamplingParams,
        reuse: list[ev.ReusePlan] | None = None,
    ) -> Served:
        """Send a job as a gateway would and read its stream to its end."""
        rid = f"req-{uuid.uuid4().hex[:8]}"
        subject = pr.token_subject("gw", rid)
        chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

        async def on_chunk(msg: Msg) -> None:
            chunks.put_nowait(pr.token_decoder.decode(msg.data))

        sub = await self.bus.subscribe(subject, cb=on_chunk)
        job = pr.PrefillJob(
            request_id=rid,
            token_ids=ids,
            block_hashes=block_hashes(ids, BLOCK, model_identity(MODEL.name)),
            sampling=params,
            decision=ev.RequestScheduled(
                request_id=rid,
                gateway_id="gw",
                prefill_instance="prefill-0",
                decode_instance="decode-0",
                time=time.time(),
                reuse=reuse or [],
                reused_blocks=sum(plan.num_blocks for plan in reuse or []),
            ),
            token_subject=subject,
            deadline=time.time() + 2 * DEADLINE_S,
        )
        served = Served()
        finished: set[int] = set()
        try:
            reply = await self.bus.request(
                pr.prefill_job_subject("prefill-0"), pr.encode(job), timeout_s=DEADLINE_S
            )
            assert isinstance(pr.job_reply_decoder.decode(reply.data), pr.JobAccepted)
            seq = 0
            async with asyncio.timeout(DEADLINE_S):
                while len(finished) < params.n:
                    chunk = await chunks.get()
                    assert not chunk.error, chunk.error
                    assert chunk.seq == seq
                    seq += 1
                    if chunk.prompt_logprobs:
                        # Ahead of every token, carrying nothing else.
                        assert not served.tokens and not chunk.token_ids and not chunk.finished
                        served.prompt_logprobs += chunk.prompt_logprobs
                        served.prompt_chunks += 1
                    if chunk.token_ids or chunk.finished:
                        served.tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
                    served.cached_tokens = max(served.cached_tokens, chunk.cached_tokens)
                    if chunk.finished:
                        finished.add(chunk.index)
        finally:
            await sub.unsubscribe()
        return served


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


def reference(model: LoadedModel, ids: list[int], top: int) -> list[pr.TokenLogprob]:
    """The prompt's logprobs computed here, straight from the engine: every row's
    logits of one prefill, log-softmax in float32, row i scoring token i + 1."""
    cache = PagedKVCache(model.config, 64, BLOCK)
    pages = PageAllocator(64).allocate(cache.pages_for(len(ids)))
    logits = ModelRunner(model, cache).prefill(ids, pages, chunk_size=CHUNK, all_logits=True)
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i in range(1, len(ids)):
        values, top_ids = logp[i - 1].topk(top)
        out.append(
            pr.TokenLogprob(
                token_id=ids[i],
                logprob=float(logp[i - 1, ids[i]]),
                top=list(zip(top_ids.tolist(), values.tolist(), strict=True)),
            )
        )
    return out


def assert_equal(got: list[pr.TokenLogprob], want: list[pr.TokenLogprob]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.token_id == b.token_id, i
        assert abs(a.logprob - b.logprob) < 1e-5, (i, a.logprob, b.logprob)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], i
        assert all(abs(p - q) < 1e-5 for (_, p), (_, q) in zip(a.top, b.top, strict=True)), i


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def counted(counter: object) -> float:
    """A prometheus counter's total."""
    (metric,) = counter.collect()  # type: ignore[attr-defined]
    return float(next(s.value for s in metric.samples if s.name.endswith("_total")))


GREEDY = pr.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


async def test_prompt_logprobs_equal_the_engines_and_come_before_the_first_token(
    split: Split, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = prompt(1, 3 * BLOCK + 5)
    params = msgspec.structs.replace(GREEDY, prompt_logprobs=3, logprobs=3, n=2)
    # Split over chunks of at most 10 entries (a long prompt's over several messages).
    monkeypatch.setattr(pr, "PROMPT_LOGPROBS_PER_CHUNK", 10)
    served = await split.run(ids, params)
    assert_equal(served.prompt_logprobs, reference(split.model, ids, 3))
    assert served.prompt_chunks == 6  # 52 entries, 10 a chunk: once, not per choice
    assert [len(t) for t in served.tokens.values()] == [3, 3]
    # Without the ask: none, and the prompt's tokens are not all computed again.
    plain = await split.run(ids, GREEDY)
    assert plain.prompt_logprobs == [] and plain.tokens[0] == served.tokens[0]
    # Top 0: each prompt token's own logprob, no alternatives.
    zero = await split.run(ids, msgspec.structs.replace(GREEDY, prompt_logprobs=0))
    assert_equal(
        zero.prompt_logprobs,
        [msgspec.structs.replace(e, top=[]) for e in reference(split.model, ids, 1)],
    )


async def test_a_cached_prefix_is_computed_again_for_the_prompts_logprobs(split: Split) -> None:
    ids = prompt(2, 4 * BLOCK + 3)
    want = reference(split.model, ids, 2)
    asked = msgspec.structs.replace(GREEDY, prompt_logprobs=2)
    metrics = split.prefill.worker.metrics
    before = counted(metrics.prompt_logprobs_recomputed)

    first = await split.run(ids, asked)
    assert_equal(first.prompt_logprobs, want)
    # Its full blocks stay in the prefill's page cache: a plan reuses them...
    plan = [ev.ReusePlan(source_instance="prefill-0", tier="engine", first_block=0, num_blocks=4)]
    reused = await split.run(ids, GREEDY, reuse=plan)
    assert reused.cached_tokens == 4 * BLOCK and reused.tokens == first.tokens
    # ...but not for a request that asks for the prompt's logprobs: computed whole.
    again = await split.run(ids, asked, reuse=plan)
    assert again.cached_tokens == 0 and again.tokens == first.tokens
    assert_equal(again.prompt_logprobs, want)
    assert counted(metrics.prompt_logprobs_recomputed) - before == 4 * BLOCK
    assert counted(metrics.prompt_logprobs) >= 2


def _job(tokens: int, top: int | None) -> pr.PrefillJob:
    return pr.PrefillJob(
        request_id=f"r{tokens}",
        token_ids=list(range(tokens)),
        block_hashes=[],
        sampling=pr.SamplingParams(prompt_logprobs=top),
        decision=ev.RequestScheduled(
            request_id=f"r{tokens}",
            gateway_id="gw",
            prefill_instance="decode-0",
            decode_instance="decode-0",
            piggyback=True,
        ),
        token_subject="t",
        deadline=0.0,
    )


def test_a_job_asking_for_its_prompts_logprobs_is_computed_alone() -> None:
    def group(tops: list[int | None]) -> int:
        jobs = [_job(4 + i, top) for i, top in enumerate(tops)]
        return take_group(
            jobs, max_jobs=8, max_tokens=64, room_pages=100, pages_for=lambda t: -(-t // BLOCK)
        )

    assert group([None, None, None]) == 3
    assert group([1, None, None]) == 1
    assert group([None, None, 0, None]) == 2


def test_a_decode_batch_refuses_a_job_asking_for_its_prompts_logprobs() -> None:
    refused = piggyback.refusal(
        _job(8, 1), "decode-0", enabled=True, draining=False, max_model_len=1024, now=0.0
    )
    assert refused is not None
    reason, retryable = refused
    assert "prompt's logprobs" in reason and not retryable
    assert (
        piggyback.refusal(
            _job(8, None), "decode-0", enabled=True, draining=False, max_model_len=1024, now=0.0
        )
        is None
    )


def test_prompt_logprobs_read_row_i_for_token_i_plus_one() -> None:
    # Three tokens, a vocabulary of four: row 0 scores token 1, row 1 token 2; the
    # last row scores nothing. Rows may come in parts (a compute split in two calls).
    logits = torch.tensor(
        [[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [9.0, 9.0, 9.0, 9.0]], dtype=torch.float32
    )
    logp = torch.log_softmax(logits, dim=-1)
    out = prompt_logprobs([0, 1, 0], [logits[:1], logits[1:]], 2)
    assert [e.token_id for e in out] == [1, 0]
    assert out[0].logprob == pytest.approx(float(logp[0, 1]))
    assert out[1].logprob == pytest.approx(float(logp[1, 0]))
    assert [t for t, _ in out[0].top] == [3, 2] and [t for t, _ in out[1].top] == [0, 1]
    # The likeliest token's own logprob is exactly its alternative's.
    assert out[1].logprob == out[1].top[0][1]
    assert prompt_logprobs([7], [logits[:1]], 2) == []
    with pytest.raises(ValueError, match="rows"):
        prompt_logprobs([0, 1], [logits], 1)
