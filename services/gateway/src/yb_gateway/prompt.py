"""From an OpenAI request to what the cluster runs: token ids, limits, sampling.

Tokenizer work runs on one dedicated thread. Off the event loop, because a long
prompt or a chat template takes milliseconds that every other stream would wait for;
on a single thread, because a Hugging Face fast tokenizer is not safe to call from
several threads at once (it mutates its truncation/padding state per call and fails
with "Already borrowed"). A short prompt (`INLINE_CHARS`) is tokenized on the event
loop instead when that thread is idle: it takes tens of microseconds, less than the
hop to the thread and back, and with the thread idle no other call can overlap it
(every call is made from the loop).

Encoding goes straight to the fast tokenizer's Rust backend (`encode_text`) when that
backend is in the state `transformers` would put it in for a plain `encode` (no
truncation, no padding, its own special-token splitting): the same ids, without the
Python layers around it (about 60 us a prompt of its 80 on this machine).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from yb_core.config import GatewayConfig, ModelConfig
from yb_core.protocol import SamplingParams
from yb_gateway import structured
from yb_gateway.errors import invalid_request, model_not_found
from yb_gateway.logprobs import TokenTable
from yb_gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolDefinition,
)
from yb_gateway.structured import OutputSpec
from yb_gateway.tiers import ServedTier, resolve_tier
from yb_text.grammar import check_grammar
from yb_text.tokenizer import load_tokenizer

T = TypeVar("T")

#: Prompts (or chat messages, all together) of at most this many characters are
#: tokenized on the event loop when the tokenizer thread is idle.
INLINE_CHARS = 256
#: The most prompts one `/v1/completions` request may list: each is a request of its
#: own in the cluster.
MAX_PROMPTS = 128
#: What the prompt's logprobs of one prompt (`echo` with `logprobs`) may take on the
#: wire, estimated as `PROMPT_LOGPROB_BYTES` a token plus `PROMPT_LOGPROB_TOP_BYTES`
#: an alternative: they travel from prefill to decode in one message (a UCX control
#: frame or a NATS message, each at most 1 MiB).
MAX_PROMPT_LOGPROBS_BYTES = 768 * 1024
PROMPT_LOGPROB_BYTES = 16
PROMPT_LOGPROB_TOP_BYTES = 15


class PromptEncoder:
    """The served model's tokenizer, used from its own thread."""

    def __init__(self, tokenizer: Any, executor: ThreadPoolExecutor, tokens: TokenTable) -> None:
        self._tokenizer = tokenizer
        self._executor = executor
        self.vocab_size = len(tokenizer)
        #: Each token's text and bytes, for logprobs.
        self.tokens = tokens
        self._template_tools = structured.template_uses_tools(
            getattr(tokenizer, "chat_template", None)
        )
        # The call submitted last to the tokenizer thread, which runs them in order:
        # once it is done, the thread is idle.
        self._last: Future[Any] | None = None

    @classmethod
    async def load(
        cls, model: ModelConfig, cache_dir: Path, executor: ThreadPoolExecutor
    ) -> PromptEncoder:
        """Load the tokenizer (seconds: may import torch or convert the model once),
        with the token table (which also readies the grammar library's view of it)."""
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(executor, load_tokenizer, model, cache_dir)
        tokens = await loop.run_in_executor(executor, TokenTable.of, tokenizer)
        return cls(tokenizer, executor, tokens)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        submitted = self._executor.submit(functools.partial(fn, *args, **kwargs))
        self._last = submitted
        return await asyncio.wrap_future(submitted)

    async def _run_short(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`_run`, or `fn` right here for an input of at most `INLINE_CHARS` when the
        tokenizer thread is idle (its last call done, even one whose caller stopped
        waiting)."""
        if chars <= INLINE_CHARS and (self._last is None or self._last.done()):
            return fn(*args, **kwargs)
        return await self._run(fn, *args, **kwargs)

    async def chat(
        self, messages: list[ChatMessage], tools: list[ToolDefinition] | None = None
    ) -> list[int]:
        """Render the chat template (with the assistant's turn opened) and tokenize it;
        `tools` go to the template, or into the system message when it ignores them."""
        conversation = structured.conversation(
            messages, tools or [], template_tools=self._template_tools, text_of=_message_text
        )
        template_tools = (
            structured.template_tools_arg(tools) if tools and self._template_tools else None
        )
        # Tools the template renders count as long: their schemas can be any size.
        chars = INLINE_CHARS + 1 if template_tools else 0
        chars += sum(len(str(m.get("content") or "")) for m in conversation)
        return await self._run_short(chars, self._encode_chat, conversation, template_tools)

    async def check_grammar(self, grammar: str) -> None:
        """Raise `yb_text.grammar.GrammarError` unless `grammar` compiles for this
        tokenizer."""
        await self._run(check_grammar, grammar, self._tokenizer)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included, as they were sent)."""
        text: str = await self._run(self._tokenizer.decode, token_ids)
        return text

    async def text(self, prompt: str) -> list[int]:
        """Tokenize a raw completion prompt (with the tokenizer's special tokens, as
        `transformers` and vLLM do for `/v1/completions`)."""
        return await self._run_short(len(prompt), encode_text, self._tokenizer, prompt, True)

    def _encode_chat(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        try:
            text = self._tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja2 raises its own types, templates `raise_exception`
            raise invalid_request(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # The template already holds every special token (BOS included) it wants.
        return encode_text(self._tokenizer, text, False)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, from the Rust backend itself
    when it is a fast tokenizer's in the state such a call leaves it in (see the
    module docstring); otherwise through `transformers`, which sets that state."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == getattr(tokenizer, "split_special_tokens", None)
    ):
        ids: list[int] = backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids
    encoded: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return encoded


def _message_text(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text":
            raise invalid_request(
                f"Content parts of type `{part.type}` are not supported; only `text`.",
                param=f"messages[{index}].content",
            )
        parts.append(part.text)
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request in the cluster's terms."""

    token_ids: list[int]
    sampling: SamplingParams
    #: The service tier it runs in: its SLOs and priority.
    tier: ServedTier
    stream: bool
    include_usage: bool
    # Every streamed chunk carries the usage so far (vLLM's continuous_usage_stats).
    continuous_usage: bool = False
    #: What the output is held to, and whether it is read as tool calls.
    output: OutputSpec = field(default_factory=OutputSpec)
    #: Completions' `echo`: the prompt's text, which each choice's text starts with.
    echo: str | None = None
    #: Completions' `max_tokens: 0` (with `echo`): the cluster generates one token
    #: (`sampling.max_tokens` is 1), which the answer leaves out.
    echo_only: bool = False
    #: A batch line, due by `batch_deadline` (wall-clock seconds): the conductor
    #: admits it only into idle capacity (`RequestAdmitted.batch`).
    batch: bool = False
    batch_deadline: float = 0.0

    @property
    def priority(self) -> int:
        """Its place in the queues and in shedding: its tier's."""
        return self.tier.priority

    @property
    def n(self) -> int:
        """How many choices are generated."""
        return self.sampling.n

    @property
    def max_tokens(self) -> int:
        """How many tokens may be generated."""
        return self.sampling.max_tokens


def check_common(body: ChatCompletionRequest | CompletionRequest, served_model: str) -> None:
    """Checks that need no tokenizer: the model, and `stream_options` asking only for
    what the request will do. (The decoder has refused already what is not
    implemented.)"""
    if body.model != served_model:
        raise model_not_found(body.model, served_model)
    options = body.stream_options
    if options is None:
        return
    # OpenAI refuses `stream_options` without `stream`; here what asks for nothing
    # (`include_usage: false`) passes, as for the refused fields.
    if not body.stream and (options.include_usage or options.continuous_usage_stats):
        raise invalid_request(
            "`stream_options` only applies to a streamed response; send `stream: true`, "
            "or leave `stream_options` out (a whole response always carries `usage`).",
            param="stream_options",
        )
    # vLLM ignores it then; a client that asked for per-chunk counts would get none.
    if options.continuous_usage_stats and not options.include_usage:
        raise invalid_request(
            "`stream_options.continuous_usage_stats` needs `stream_options.include_usage: "
            "true`: the counts on every chunk come with the final usage chunk.",
            param="stream_options.continuous_usage_stats",
        )


async def prepare(
    body: ChatCompletionRequest | CompletionRequest,
    encoder: PromptEncoder,
    model: ModelConfig,
    gateway: GatewayConfig,
) -> PreparedRequest:
    """`prepare_all` for a request of one prompt (a chat, or a completion of one)."""
    prepared = await prepare_all(body, encoder, model, gateway)
    if len(prepared) != 1:
        raise invalid_request("Expected one prompt.", param="prompt")
    return prepared[0]


async def prepare_all(
    body: ChatCompletionRequest | CompletionRequest,
    encoder: PromptEncoder,
    model: ModelConfig,
    gateway: GatewayConfig,
    tier: ServedTier | None = None,
) -> list[PreparedRequest]:
    """Tokenize and check `body` against the model's and the gateway's limits: one
    request for the cluster per prompt (a completion may list several; each runs as
    a request of its own, its choices numbered after the prompts' before it). `tier`:
    its service tier, when the caller resolved it already (`tiers.resolve_tier`).

    Raises `ApiError` (400) naming the limit a request goes past, and which prompt,
    or the service tier it names that is not served.
    """
    if tier is None:
        tier = resolve_tier(body.service_tier, body.priority, gateway)
    output = OutputSpec()
    echo_only = False
    if isinstance(body, ChatCompletionRequest):
        output = structured.output_spec(body)
        prompts = [
            await encoder.chat(body.messages, body.tools if output.tools != "none" else None)
        ]
        params = ["messages"]
        requested = body.max_completion_tokens or body.max_tokens
        limit_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        top_logprobs = body.top_logprobs or 0
        if top_logprobs and not body.logprobs:
            raise invalid_request("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
        logprobs = top_logprobs if body.logprobs else None
        echoes: list[str | None] = [None]
    else:
        texts, params = completion_prompts(body.prompt)
        prompts = [
            await _completion_prompt(p, param, encoder)
            for p, param in zip(texts, params, strict=True)
        ]
        requested = body.max_tokens
        limit_param = "max_tokens"
        logprobs = body.logprobs
        if requested == 0:
            if not body.echo:
                raise invalid_request(
                    "`max_tokens: 0` generates nothing: it asks only for the prompt back, "
                    "with `echo: true` (and its logprobs with `logprobs`).",
                    param="max_tokens",
                )
            # The cluster always samples a first token: it is left out of the answer.
            echo_only, requested = True, 1
        echoes = [None] * len(prompts)
        if body.echo:
            echoes = [
                p if isinstance(p, str) else await encoder.decode(ids)
                for p, ids in zip(texts, prompts, strict=True)
            ]
    if output.grammar:
        try:
            await encoder.check_grammar(output.grammar)
        except ValueError as exc:  # yb_text.grammar.GrammarError
            raise invalid_request(f"Invalid schema: {exc}", param=output.param) from exc
    # With `echo`, `logprobs` covers the prompt's tokens too.
    prompt_logprobs = logprobs if isinstance(body, CompletionRequest) and body.echo else None
    if requested is not None and requested > gateway.max_max_tokens:
        raise invalid_request(
            f"{limit_param}={requested} exceeds this server's limit of "
            f"max_max_tokens={gateway.max_max_tokens}.",
            param=limit_param,
            code="max_tokens_exceeded",
        )
    limits = [
        _prompt_limit(ids, param, requested, limit_param, prompt_logprobs, model, gateway)
        for ids, param in zip(prompts, params, strict=True)
    ]

    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise invalid_request("Stop sequences must not be empty.", param="stop")
    sampling = SamplingParams(
        max_tokens=0,  # each prompt's own, below
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        n=body.n or 1,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias or {}, encoder.vocab_size),
        logprobs=logprobs,
        grammar=output.grammar,
        prompt_logprobs=prompt_logprobs,
    )
    options = body.stream_options
    include_usage = bool(body.stream and options and options.include_usage)
    return [
        PreparedRequest(
            token_ids=ids,
            sampling=msgspec.structs.replace(sampling, max_tokens=max_tokens),
            tier=tier,
            stream=body.stream,
            include_usage=include_usage,
            continuous_usage=bool(include_usage and options and options.continuous_usage_stats),
            output=output,
            echo=echo,
            echo_only=echo_only,
        )
        for ids, echo, max_tokens in zip(prompts, echoes, limits, strict=True)
    ]


def _prompt_limit(
    token_ids: list[int],
    param: str,
    requested: int | None,
    limit_param: str,
    prompt_logprobs: int | None,
    model: ModelConfig,
    gateway: GatewayConfig,
) -> int:
    """How many tokens one prompt may generate (what was asked, or the default within
    the room its context leaves); 400s naming the prompt (`param`) past a limit."""
    if not token_ids:
        raise invalid_request("The prompt is empty.", param=param)
    prompt_tokens = len(token_ids)
    room = model.max_model_len - prompt_tokens
    # The default must leave room for the prompt; only a prompt that fills the whole
    # context has no room at all.
    max_tokens = min(gateway.default_max_tokens, room) if requested is None else requested
    if max_tokens < 1 or prompt_tokens + max_tokens > model.max_model_len:
        raise invalid_request(
            f"This model's maximum context length is max_model_len={model.max_model_len} "
            f"tokens; the prompt has {prompt_tokens} tokens and {limit_param} asks for "
            f"{max_tokens if requested is not None else 'at least 1'} more.",
            param=param,
            code="context_length_exceeded",
        )
    if prompt_logprobs is not None:
        per_token = PROMPT_LOGPROB_BYTES + PROMPT_LOGPROB_TOP_BYTES * prompt_logprobs
        most = MAX_PROMPT_LOGPROBS_BYTES // per_token
        if prompt_tokens > most:
            raise invalid_request(
                f"`echo` with `logprobs: {prompt_logprobs}` returns the logprobs of at most "
                f"{most} prompt tokens; the prompt has {prompt_tokens}.",
                param="logprobs",
            )
    return max_tokens


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """`logit_bias` with its keys as token ids; 400 for a key that is not one."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"`logit_bias` key {key!r} is not a token id in 0..{vocab_size - 1}.",
                param="logit_bias",
            )
        out[token_id] = value
    return out


_PROMPT_FORMS = (
    "`prompt` is a string, a list of strings, a list of token ids or a list of lists of token ids"
)


def completion_prompts(
    prompt: str | Sequence[str | int | list[int]],
) -> tuple[list[str | list[int]], list[str]]:
    """The prompts a completion's `prompt` holds, in OpenAI's four forms (a string, a
    list of strings, a list of token ids, a list of token-id lists), and the `param`
    that names each in an error (`prompt`, or `prompt[i]` in a list of prompts).
    400 for an empty list, a mix of forms or more than `MAX_PROMPTS` prompts."""
    if isinstance(prompt, str):
        return [prompt], ["prompt"]
    if not prompt:
        raise invalid_request(f"`prompt` is an empty list; {_PROMPT_FORMS}.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]], ["prompt"]
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise invalid_request(
            f"`prompt` mixes strings, token ids and lists; {_PROMPT_FORMS}.", param="prompt"
        )
    if len(prompt) > MAX_PROMPTS:
        raise invalid_request(
            f"`prompt` lists {len(prompt)} prompts; at most {MAX_PROMPTS} are served "
            "in one request.",
            param="prompt",
        )
    prompts: list[str | list[int]] = [p for p in prompt if not isinstance(p, int)]
    return prompts, [f"prompt[{i}]" for i in range(len(prompts))]


async def _completion_prompt(
    prompt: str | list[int], param: str, encoder: PromptEncoder
) -> list[int]:
    if isinstance(prompt, str):
        return await encoder.text(prompt)
    bad = next((t for t in prompt if not 0 <= t < encoder.vocab_size), None)
    if bad is not None:
        raise invalid_request(
            f"Token id {bad} is outside the vocabulary (0..{encoder.vocab_size - 1}).",
            param=param,
        )
    return list(prompt)
