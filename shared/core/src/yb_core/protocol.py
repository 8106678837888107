"""Point-to-point messages: job hand-offs, KV reservations and token streams.

These travel on core NATS subjects outside the event stream (`yb.job.>`, `yb.tok.>`,
`yb.resend.>`): they carry token ids and text, which must never reach the durable log,
and they are worth nothing once their request is over. Like events they are msgspec
structs in msgpack, one tagged union per conversation, one typed decoder each.

Core NATS delivers at most once: token chunks published while a gateway moves to
another NATS node are lost. Chunks are numbered, the decode instance keeps what it
streamed for a while, and a gateway that sees a gap (or reconnected, or heard nothing
for a while) asks for it again with `ResendTokens`.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from yb_core.events import (
    RequestFinished,
    RequestOutcome,
    RequestScheduled,
    ReusePlan,
    StrictDecoder,
    subject_token,
)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How a request's tokens are chosen; `temperature == 0` means greedy.

    Everything here is the request's own: the state that sampling builds up as tokens
    are generated (the random stream's position, the penalties' token counts, the
    grammar's parse) is never sent. Any engine rebuilds it from these parameters and the
    tokens generated so far, so prefill and decode, or a second decode instance after a
    re-plan, draw exactly what one engine running the whole request would.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    #: Choices generated from the one prompt (its KV computed once, its pages shared).
    n: int = 1
    #: OpenAI's penalties, -2..2, over the tokens each choice has generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Added to the logits of these token ids before sampling (-100..100).
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    #: None: no logprobs. k >= 0: each generated token's logprob and the k likeliest
    #: alternatives' (from the model's distribution, before any processing).
    logprobs: int | None = None
    #: An llguidance grammar (its JSON form, as the gateway built and checked it) that
    #: every generated token must follow; "" leaves generation unconstrained.
    grammar: str = ""
    #: None: the prompt's logprobs are not computed. k >= 0: the prefill computes the
    #: logprob of every prompt token after the first, with its k likeliest alternatives
    #: (completions' `echo` with `logprobs`), from position 0 (no prefix reuse: a cached
    #: prefix has no logits), and they reach the gateway before the first token
    #: (`StartDecode.prompt_logprobs`, then `TokenChunk.prompt_logprobs`).
    prompt_logprobs: int | None = None


class TokenLogprob(msgspec.Struct, array_like=True, gc=False, kw_only=True):
    """A generated token's log-probability and, when asked, its likeliest alternatives
    (`(token id, logprob)`, likeliest first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True, tag=True):
    """Base of point-to-point messages."""


# --- gateway -> prefill -------------------------------------------------------------


class PrefillJob(_Msg, tag="prefill_job"):
    """Everything a prefill instance needs to run one request.

    `decision` is the conductor's recorded decision, so the plan the engine follows is
    exactly the one in the log. `token_subject` is where the decode instance streams
    tokens to (the gateway listens there); `trace_headers` carry the trace context.
    """

    request_id: str
    token_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams
    decision: RequestScheduled
    token_subject: str
    deadline: float
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: Larger runs earlier: the prefill queue orders by priority, then arrival.
    priority: int = 0
    #: 0 for a request's first plan; k after its k-th re-plan.
    attempt: int = 0
    #: The last `generated_tokens` of `token_ids` are output the client already has
    #: (a re-plan continues the request): sampling resumes after them.
    generated_tokens: int = 0
    #: A batch line's job (OpenAI Batch API): the engine may hold its compute
    #: between two layers for a queued job of a higher priority, and resume it after;
    #: what it holds (its pages, its decode reservation, its stream) stays held.
    preemptible: bool = False


class JobAccepted(_Msg, tag="job_accepted"):
    """The instance queued the job; tokens will follow on the token subject."""

    request_id: str
    instance_id: str
    queue_position: int = 0


class JobRefused(_Msg, tag="job_refused"):
    """The instance will not run the job; `retryable` says if another one might."""

    request_id: str
    instance_id: str
    reason: str
    retryable: bool = True


JobReply = JobAccepted | JobRefused


class JobFailed(Exception):
    """An engine's job that cannot complete (a prefill's, or a decode instance's
    piggybacked one); `status` is the HTTP status the client should see, and
    `failed_instance` the instance at fault when it is not the one that ran the job
    (a decode instance that refused its pages), for the gateway's re-plan to avoid."""

    def __init__(self, reason: str, status: int = 503, failed_instance: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.failed_instance = failed_instance


def failed_job(
    job: PrefillJob, exc: JobFailed, instance_id: str
) -> tuple[TokenChunk, RequestFinished]:
    """How an engine ends a job that never reached decode's stream: the error chunk
    for the request's token subject (its status tells the gateway whether to
    re-plan) and the `RequestFinished` for the log (cancelled for a 499)."""
    prompt_tokens = len(job.token_ids) - job.generated_tokens
    chunk = TokenChunk(
        request_id=job.request_id,
        seq=0,
        finished=True,
        finish_reason="error",
        error=exc.reason,
        error_status=exc.status,
        prompt_tokens=prompt_tokens,
        attempt=job.attempt,
        failed_instance=exc.failed_instance,
    )
    outcome: RequestOutcome = "cancelled" if exc.status == 499 else "failed"
    finished = RequestFinished(
        request_id=job.request_id,
        instance_id=instance_id,
        outcome=outcome,
        reason=exc.reason,
        prompt_tokens=prompt_tokens,
        attempt=job.attempt,
    )
    return chunk, finished


# --- a prefill group's lead -> its other stages --------------------------------------


class StageJob(_Msg, tag="stage_job"):
    """The lead of a prefill group asks one of its other stages to run a request.

    The stage reserves pages for the prompt (`prompt_len` tokens) in its own layers,
    loads the planned prefix of its layers (`reuse`, over `block_hashes`; whole blocks
    come from the kvstore and it keeps its layers' share), answers `StageReady`, then
    takes the request's chunks from the stage before it over UCX, computes its layers,
    passes each chunk's output to `next_instance` (the next stage; the lead, for the
    last stage's logits) and streams its layers' pages into decode's reservation
    (`decode_address`, `num_pages` pages a layer, as `KVReserved` lays them out). The
    last stage (`last`) commits that reservation once every stage before it is done.
    Blocks `first_put`, `first_put + 1`, ... of the prompt go into the block store at
    `store_address` too: `puts` are their put request ids, every stage sending its
    layers of each (the last one committing them). Every wait ends by `deadline`
    (wall clock). `head_cuts`: the reservation's (`KVReserved.head_cuts`: a
    tensor-parallel decode instance takes each page in runs of heads).
    """

    request_id: str
    lead_instance: str
    next_instance: str
    last: bool
    prompt_len: int
    deadline: float
    decode_instance: str
    decode_address: str
    num_pages: int
    block_hashes: list[int] = msgspec.field(default_factory=list)
    head_cuts: list[int] = msgspec.field(default_factory=list)
    reuse: list[ReusePlan] = msgspec.field(default_factory=list)
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    store_address: str = ""
    first_put: int = 0
    puts: list[str] = msgspec.field(default_factory=list)


class StageReady(_Msg, tag="stage_ready"):
    """The stage holds the request's pages, with the first `reused_blocks` blocks of
    its layers loaded; it waits for the chunks."""

    request_id: str
    instance_id: str
    reused_blocks: int = 0


class StageRefused(_Msg, tag="stage_refused"):
    """The stage will not run the request (no pages, shutting down, not its group)."""

    request_id: str
    instance_id: str
    reason: str


class StageAbort(_Msg, tag="stage_abort"):
    """The lead gives up a request it sent a stage (published, no reply): the stage
    ends it and frees its pages, instead of waiting for chunks until the deadline."""

    request_id: str
    reason: str


StageReply = StageReady | StageRefused
StageControl = StageJob | StageAbort


# --- prefill -> decode --------------------------------------------------------------


class ReserveKV(_Msg, tag="reserve_kv"):
    """Prefill asks the decode instance to set aside pages for a prompt's KV.

    The decode instance reserves `num_tokens` worth of pages and posts UCX receives
    into them; it accepts KV bytes for this request only, of exactly those sizes.

    `head_cuts`: the KV head boundaries each page travels cut at, so that each piece is
    a run of heads one rank holds on either side (tensor-parallel instances of any
    degrees; the sender merges both sides' cuts). Empty: whole pages.

    `wait_s`: how long the decode instance may wait for pages to free before it
    answers, when too few are free now (the requester waits longer than this for the
    answer). The conductor admits on a prediction of decode's pages, which can run
    short for a moment; a request that waits is late, one refused has failed. 0: the
    answer comes at once.
    """

    request_id: str
    prefill_instance: str
    num_tokens: int
    sampling: SamplingParams
    token_subject: str
    deadline: float
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    ttft_started: float = 0.0
    #: As on `PrefillJob`: decode admits higher priorities first when pages are short;
    #: a reservation of a newer attempt replaces an older one of the same request.
    priority: int = 0
    attempt: int = 0
    generated_tokens: int = 0
    head_cuts: list[int] = msgspec.field(default_factory=list)
    wait_s: float = 0.0
    #: As on `PrefillJob`: a line of the Batch API, whose decoding gives its batch
    #: slot up to a waiting request of a higher priority (`yb_engine.batcher`).
    preemptible: bool = False


class KVReserved(_Msg, tag="kv_reserved"):
    """Pages are reserved: send `num_layers * num_pages` page buffers of `page_nbytes`,
    each cut at the reservation's `head_cuts` into `k = len(head_cuts) - 1` pieces.

    Buffer index `(layer * k + j) * num_pages + i` is piece `j` of page `i` of the
    request in layer `layer` (k is 1 for whole pages: `layer * num_pages + i`). Piece
    by piece, then page by page: one rank's pieces of consecutive pages lie back to
    back on either side, so they travel as one UCX message.
    """

    request_id: str
    ucx_address: str
    num_pages: int
    num_layers: int
    page_nbytes: int
    block_size: int
    # The reservation's layout (`Reservation.breaks()`): buffer indices whose page does
    # not follow the previous index's in memory. None from an older decode instance.
    breaks: list[int] | None = None
    #: The decode instance takes the hand-over (`StartDecode`, encoded) as the note of
    #: the KV's UCX commit (`KVSender.commit`'s `note`), not as a control message
    #: after it: one round trip and four NATS messages less per request. False from
    #: an older decode instance, which only takes it as a control message.
    handover_on_commit: bool = False
    #: The cuts the reservation was made with (`ReserveKV.head_cuts`); empty: whole pages.
    head_cuts: list[int] = msgspec.field(default_factory=list)


class ReserveRefused(_Msg, tag="reserve_refused"):
    """The decode instance cannot hold the request now (no pages, shutting down...)."""

    request_id: str
    reason: str


ReserveReply = KVReserved | ReserveRefused


class StartDecode(_Msg, tag="start_decode"):
    """Prefill committed the KV over UCX; decode may admit the request.

    `first_token` is the token prefill sampled from the last prompt position. Sent as
    a control message after the commit, or as the commit's note
    (`KVReserved.handover_on_commit`).
    """

    request_id: str
    first_token: int
    prompt_tokens: int
    reused_tokens: int = 0
    #: With `n` > 1, every choice's first token (`first_token` is choice 0's).
    first_tokens: list[int] = msgspec.field(default_factory=list)
    #: When the request asked for logprobs: one per choice's first token.
    first_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    #: The hand-over's trace context, when it rides on the commit (a control message
    #: carries it in its NATS headers).
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    #: With `SamplingParams.prompt_logprobs`: prompt tokens 1..n-1's logprobs, in order
    #: (token 0 has none); decode streams them ahead of the first token.
    prompt_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


class AbortReservation(_Msg, tag="abort_reservation"):
    """Prefill gave up on a request before it started decoding; free its pages."""

    request_id: str
    reason: str


class DecodeAck(_Msg, tag="decode_ack"):
    """Reply to `StartDecode`/`AbortReservation`: `ok` or the reason it is not."""

    request_id: str
    ok: bool
    reason: str = ""


DecodeControl = ReserveKV | StartDecode | AbortReservation
DecodeReply = KVReserved | ReserveRefused | DecodeAck

# --- decode -> gateway --------------------------------------------------------------


class TokenChunk(_Msg, tag="token_chunk"):
    """Newly generated tokens of one choice of one request, numbered so loss or
    reordering shows.

    `seq` numbers the chunks of one attempt's stream, across its choices, from 0; a
    re-planned request (`attempt` > 0) streams anew from 0, and its gateway drops what
    comes late from an older attempt. `finished` ends choice `index`; the stream ends
    when all `n` choices have finished, and an `error` ends the whole stream.
    `logprobs`, when the request asked for them, has one entry per token id.
    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`) are the next entries of
    the prompt's logprobs (prompt tokens 1..n-1, in order), split over chunks of at most
    `PROMPT_LOGPROBS_PER_CHUNK` entries that carry no token, all of them before the
    stream's first token. `failed_instance`, on an error chunk, names the instance at
    fault when it is not the one the gateway would blame by the stream's phase (empty:
    the prefill instance before the first token, the decode instance after).
    """

    request_id: str
    seq: int
    token_ids: list[int] = msgspec.field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str = ""
    error_status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0
    attempt: int = 0
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    failed_instance: str = ""


#: The most prompt logprobs one `TokenChunk` carries: a long prompt's take several
#: chunks, each well under NATS's 1 MiB message limit.
PROMPT_LOGPROBS_PER_CHUNK: Final = 1024


# --- gateway -> decode --------------------------------------------------------------


class ResendTokens(_Msg, tag="resend_tokens"):
    """A gateway missed chunks of a stream: publish them again from `from_seq` on.

    The decode instance publishes what it still holds on the stream's own token
    subject, which only the gateway it is addressed to may read, and answers with
    `TokensResent`; the answer itself carries no text, because any gateway may ask
    (request ids are in the log) while only the addressed one may read the tokens.
    """

    request_id: str
    from_seq: int


#: What a decode instance knows of a stream: `unknown` (never there, or its retention
#: ran out), `pending` (KV reserved, no token yet), `streaming` or `finished`.
StreamState = Literal["unknown", "pending", "streaming", "finished"]


class TokensResent(_Msg, tag="tokens_resent"):
    """Reply to `ResendTokens`: the stream's state and the chunks it still holds.

    Chunks `first_seq` to `next_seq - 1` are held; those from `max(from_seq,
    first_seq)` on were published again before this reply (`resent` of them). A
    `first_seq` above the asked `from_seq` means the chunks in between are gone.
    """

    request_id: str
    state: StreamState
    first_seq: int = 0
    next_seq: int = 0
    resent: int = 0


JOB_SUBJECT_PREFIX: Final = "yb.job"
TOKEN_SUBJECT_PREFIX: Final = "yb.tok"
RESEND_SUBJECT_PREFIX: Final = "yb.resend"


def prefill_job_subject(instance_id: str) -> str:
    """Where a prefill instance takes jobs."""
    return f"{JOB_SUBJECT_PREFIX}.prefill.{subject_token(instance_id)}"


def prefill_stage_subject(instance_id: str) -> str:
    """Where a stage of a prefill group takes its lead's `StageJob`s."""
    return f"{JOB_SUBJECT_PREFIX}.stage.{subject_token(instance_id)}"


def decode_control_subject(instance_id: str) -> str:
    """Where a decode instance takes reservations and start/abort messages."""
    return f"{JOB_SUBJECT_PREFIX}.decode.{subject_token(instance_id)}"


def token_subject(gateway_id: str, request_id: str) -> str:
    """Where the tokens of one request are streamed to its gateway."""
    return f"{TOKEN_SUBJECT_PREFIX}.{subject_token(gateway_id)}.{subject_token(request_id)}"


def token_subjects(gateway_id: str) -> str:
    """The token subjects of every request of one gateway (a wildcard)."""
    return f"{TOKEN_SUBJECT_PREFIX}.{subject_token(gateway_id)}.*"


def resend_subject(decode_instance: str) -> str:
    """Where a decode instance takes `ResendTokens` from gateways.

    Its own prefix, not the decode's job subject: gateways may ask for resends, but
    must not send the reservations and starts that only prefill may send.
    """
    return f"{RESEND_SUBJECT_PREFIX}.{subject_token(decode_instance)}"


_encoder = msgspec.msgpack.Encoder()
job_decoder: StrictDecoder[PrefillJob] = StrictDecoder(PrefillJob)
job_reply_decoder: StrictDecoder[JobReply] = StrictDecoder(JobReply)
stage_control_decoder: StrictDecoder[StageControl] = StrictDecoder(StageControl)
stage_reply_decoder: StrictDecoder[StageReply] = StrictDecoder(StageReply)
decode_control_decoder: StrictDecoder[DecodeControl] = StrictDecoder(DecodeControl)
decode_reply_decoder: StrictDecoder[DecodeReply] = StrictDecoder(DecodeReply)
token_decoder: StrictDecoder[TokenChunk] = StrictDecoder(TokenChunk)
resend_decoder: StrictDecoder[ResendTokens] = StrictDecoder(ResendTokens)
resend_reply_decoder: StrictDecoder[TokensResent] = StrictDecoder(TokensResent)


def encode(message: msgspec.Struct) -> bytes:
    """Serialize any protocol message."""
    return _encoder.encode(message)
