"""Pipeline stages: one prompt's prefill cut across several engines by layers (CPP).

Mooncake runs a long prompt's prefill over a group of nodes, each holding a contiguous
range of layers (a stage). The prompt is cut into chunks that flow through the stages in
order, so stage 2 computes chunk 1 while stage 1 computes chunk 2; stages exchange only
the hidden states of a chunk at their boundary. With no backward pass the schedule needs
no more than that: each stage computes its chunks in prompt order, and chunk k attends
to the KV of chunks < k already in the stage's own pages.

A stage keeps the KV of its own layers only, in its own `PagedKVCache` (`stage_cache`),
whose layer j is the model's layer `layer_range.start + j`. A cached prefix is reused per
stage: the caller puts the prefix KV of the stage's layers into its pages and starts the
first chunk after it, exactly as `ModelRunner.prefill` does with `num_cached_tokens`.

Between stages a chunk's hidden states are a plain contiguous tensor `[T, hidden]` with
a `HiddenHeader` (msgspec) saying what it is, so a transport can move the bytes as they
lie (`hidden_bytes`, `hidden_from_buffer`). `serve_stage_request` runs one request
through a stage between two such transports (`ChunkSource` in, `ChunkSink` out: the data
plane's `ActivationReceiver` and `ActivationSender` are both), streaming the stage's KV
pages to a `PageSink` as it goes; `prefill_over_stages` is the driver's side of a group.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import torch

from yb_engine.attention import AttentionBackend, host_ints, select_backend
from yb_engine.decoder import Chunk, Decoder, Keep, LayerHook, Step
from yb_engine.kv_cache import PagedKVCache
from yb_engine.loader import LoadedStage


class HiddenHeader(msgspec.Struct, frozen=True, array_like=True):
    """What a hidden-state buffer between two stages holds.

    The buffer is `shape` elements of `dtype` (a torch dtype name, "float32"), row-major
    and contiguous: the hidden states of prompt positions `[start, end)`, the chunk
    number `chunk_index` of request `request_id`'s prompt of `prompt_len` tokens.
    """

    request_id: str
    chunk_index: int
    start: int
    end: int
    prompt_len: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def is_last_chunk(self) -> bool:
        """The chunk that ends the prompt: the last stage returns logits after it."""
        return self.end == self.prompt_len

    @property
    def nbytes(self) -> int:
        """Size of the buffer the header describes."""
        count = 1
        for dim in self.shape:
            count *= dim
        itemsize: int = _torch_dtype(self.dtype).itemsize
        return count * itemsize

    def describing(self, tensor: torch.Tensor) -> HiddenHeader:
        """The same chunk's header for `tensor`: a stage's output for this input, or
        the last stage's logits."""
        return msgspec.structs.replace(
            self, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")
        )

    @classmethod
    def of(
        cls,
        hidden: torch.Tensor,
        *,
        request_id: str,
        chunk_index: int,
        start: int,
        prompt_len: int,
    ) -> HiddenHeader:
        """The header of `hidden`, the states of positions `[start, start + len(hidden))`."""
        return cls(
            request_id=request_id,
            chunk_index=chunk_index,
            start=start,
            end=start + hidden.shape[0],
            prompt_len=prompt_len,
            shape=tuple(hidden.shape),
            dtype=str(hidden.dtype).removeprefix("torch."),
        )


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def hidden_bytes(hidden: torch.Tensor) -> memoryview:
    """The bytes of a CPU hidden-state tensor as they lie in memory (no copy when it is
    contiguous), for a transport to send."""
    if hidden.device.type != "cpu":
        raise ValueError(f"hidden states on {hidden.device}: copy them to the CPU first")
    flat = hidden.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def hidden_from_buffer(
    header: HiddenHeader, buffer: bytes | bytearray | memoryview, device: str | torch.device
) -> torch.Tensor:
    """The tensor `header` describes, from the bytes a transport received."""
    nbytes = memoryview(buffer).nbytes
    if nbytes != header.nbytes:
        raise ValueError(f"hidden-state buffer of {nbytes} bytes; the header says {header.nbytes}")
    tensor = torch.frombuffer(bytearray(buffer), dtype=_torch_dtype(header.dtype))
    return tensor.view(header.shape).to(device)


def stage_cache(
    stage: LoadedStage,
    num_pages: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> PagedKVCache:
    """A page pool for the stage's layers only (its layer j is the model's layer
    `stage.layer_range.start + j`); dtype and device default to the stage's."""
    start, end = stage.layer_range.start, stage.layer_range.end
    stage_arch = msgspec.structs.replace(
        stage.config,
        num_layers=end - start,
        layer_windows=stage.config.layer_windows[start:end],
    )
    return PagedKVCache(
        stage_arch,
        num_pages,
        block_size,
        dtype=stage.dtype if dtype is None else dtype,
        device=stage.device if device is None else device,
    )


def chunk_spans(prompt_len: int, num_cached_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """The `[start, end)` of each chunk the uncached part of a prompt is computed in."""
    if not 0 <= num_cached_tokens < prompt_len:
        raise ValueError(
            f"num_cached_tokens={num_cached_tokens} must be in [0, {prompt_len}): "
            "the last prompt token must be computed to get its logits"
        )
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    return [
        (start, min(start + chunk_size, prompt_len))
        for start in range(num_cached_tokens, prompt_len, chunk_size)
    ]


class StageRunner:
    """Computes chunks of prompts through one stage's layers, over the stage's pages.

    Not thread-safe, like `ModelRunner`: one thread drives it, and leaves
    `torch.set_num_threads` to the caller.
    """

    def __init__(
        self,
        stage: LoadedStage,
        cache: PagedKVCache,
        backend: AttentionBackend | None = None,
    ) -> None:
        arch = stage.config
        layer_range = stage.layer_range
        layer_range.check(arch)
        if cache.spec != arch.kv_spec(cache.spec.dtype, layer_range.start, layer_range.end):
            raise ValueError(
                f"KV cache {cache.spec} does not fit layers "
                f"[{layer_range.start}, {layer_range.end}) of {arch.model_id}"
            )
        self.device = torch.device(stage.device)
        if cache.device.type != self.device.type:
            raise ValueError(f"KV cache on {cache.device}, stage on {stage.device}")
        self.stage = stage
        self.arch = arch
        self.layer_range = layer_range
        self.weights = stage.weights
        self.cache = cache
        self.dtype = stage.dtype
        self.is_first = layer_range.is_first
        self.is_last = layer_range.is_last(arch)
        if backend is None:
            backend = select_backend(
                self.device, cache.block_size, self.dtype, arch, cache_dtype=cache.dtype
            )
        self.backend = backend
        self.decoder = Decoder(
            arch,
            self.weights.layers,
            first_layer=layer_range.start,
            embed=self.weights.embed,
            final_norm=self.weights.final_norm,
            lm_head=self.weights.lm_head,
            cache=cache,
            backend=backend,
            dtype=self.dtype,
            device=self.device,
        )

    def forward(
        self,
        inputs: torch.Tensor,
        block_table: Sequence[int],
        start: int,
        prompt_len: int,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor | None:
        """Compute prompt positions `[start, start + len(inputs))` through this stage.

        `inputs` is the chunk's token ids (int64 `[T]`) on the first stage, the previous
        stage's hidden states `[T, hidden]` on the others. Positions before `start` must
        have this stage's KV in `block_table`'s pages already (a cached prefix, earlier
        chunks); the chunk's KV is written there. After each layer has written it,
        `layer_hook(layer, start, end)` runs with the model's layer index.

        Returns the chunk's hidden states `[T, hidden]` for the next stage; on the last
        stage, the float32 logits `[vocab]` after the prompt's last token when the chunk
        ends the prompt, else None.
        """
        arch = self.arch
        t = inputs.shape[0]
        end = start + t
        if t == 0 or start < 0 or end > prompt_len:
            raise ValueError(
                f"chunk [{start}, {end}) is empty or outside the prompt [0, {prompt_len})"
            )
        if prompt_len > arch.max_position:
            raise ValueError(
                f"prompt of {prompt_len} tokens exceeds max_position {arch.max_position}"
            )
        expected = (t,) if self.is_first else (t, arch.hidden)
        if tuple(inputs.shape) != expected:
            what = "token ids" if self.is_first else "hidden states"
            raise ValueError(f"{what} of shape {tuple(inputs.shape)}, expected {expected}")
        final_chunk = end == prompt_len
        with torch.inference_mode():
            plan = self.backend.plan_prefill(block_table, start, end, self.cache.block_size)
            # As in ModelRunner: the model's last layer matters only at the prompt's
            # last token (its logits); every token's K/V is written.
            keep: Keep = "all" if not self.is_last else "last" if final_chunk else "none"
            step = Step(
                positions=torch.arange(start, end, device=self.device),
                chunks=[Chunk(plan, 0, t, keep, layer_hook)],
            )
            decoder = self.decoder
            if self.weights.embed is not None:
                x = decoder.embed(inputs.to(self.device))
            else:
                x = inputs.to(device=self.device, dtype=self.dtype)
            x = decoder.forward(x, step)
            if not self.is_last:
                return x
            if not final_chunk:
                return None
            return decoder.logits(x[-1:])[0]


def check_group(stages: Sequence[StageRunner]) -> None:
    """Raise unless `stages` hold contiguous layer ranges covering the whole model."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    arch = stages[0].arch
    expected = 0
    for stage in stages:
        if stage.arch.model_id != arch.model_id:
            raise ValueError(f"stages of {arch.model_id} and {stage.arch.model_id} in one group")
        if stage.layer_range.start != expected:
            raise ValueError(
                f"stage [{stage.layer_range.start}, {stage.layer_range.end}) does not "
                f"follow layer {expected}"
            )
        expected = stage.layer_range.end
    if expected != arch.num_layers:
        raise ValueError(f"the stages end at layer {expected} of {arch.num_layers}")


def run_pipeline(
    stages: Sequence[StageRunner],
    token_ids: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    num_cached_tokens: int = 0,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Prefill `token_ids` through a group of stages in one thread; the last stage's
    logits `[vocab]` after the prompt.

    `block_tables[i]` are stage i's pages for the prompt, holding the stage's KV of the
    first `num_cached_tokens` tokens already. Each chunk goes through every stage before
    the next starts; a pipelined run (each stage in its own process) computes the same
    numbers, since every stage still sees its chunks in prompt order.
    """
    check_group(stages)
    if len(block_tables) != len(stages):
        raise ValueError(f"{len(block_tables)} block tables for {len(stages)} stages")
    n = len(token_ids)
    ids = host_ints(list(token_ids), torch.int64, stages[0].device)
    logits: torch.Tensor | None = None
    for start, end in chunk_spans(n, num_cached_tokens, chunk_size):
        out: torch.Tensor | None = ids[start:end]
        for stage, table in zip(stages, block_tables, strict=True):
            assert out is not None
            out = stage.forward(out, table, start, n)
        logits = out
    assert logits is not None
    return logits


T = TypeVar("T")


class ChunkSource(Protocol):
    """Where a stage takes its chunks from (the previous stage, or the driver)."""

    async def receive(
        self, request_id: str, chunk_index: int, *, deadline_s: float
    ) -> tuple[HiddenHeader, Any]:
        """Chunk `chunk_index` of `request_id`: its header and its bytes."""
        ...

    async def wait_closed(self, request_id: str, *, deadline_s: float) -> bool:
        """Wait for the sender to end `request_id`: True when it sent every chunk."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is held for `request_id`."""
        ...


class ChunkSink(Protocol):
    """Where a stage sends its chunks (the next stage, or the driver for the logits)."""

    async def open(self, request_id: str, *, deadline_s: float) -> None:
        """Announce `request_id` before its first chunk."""
        ...

    async def send(
        self,
        request_id: str,
        chunk_index: int,
        header: HiddenHeader,
        payload: Any,
        *,
        deadline_s: float,
    ) -> None:
        """Send one chunk; `payload` must not change until this returns."""
        ...

    async def close(self, request_id: str, *, complete: bool, deadline_s: float) -> None:
        """End `request_id`: every chunk sent (`complete`), or given up."""
        ...


class PageSink(Protocol):
    """One request's KV reservation at decode (or the kvstore), laid out as the KV
    protocol says: buffer `layer * num_pages + i` is page i of the request in the
    model's layer `layer` (each in `k` pieces, `(layer * k + j) * num_pages + i`, when
    the reservation cuts pages at a tensor-parallel decode's runs of heads)."""

    async def send(self, items: Sequence[tuple[int, Any]], *, deadline_s: float) -> None:
        """Send (index, page) items; the pages must not change until this returns."""
        ...

    async def commit(self, *, deadline_s: float) -> None:
        """Declare the reservation complete."""
        ...


class UpstreamFailed(RuntimeError):
    """The previous stage ended a request without sending all of it."""


def _raise_failed(tasks: set[asyncio.Task[None]]) -> None:
    """Forget the transfers in `tasks` that finished; raise the first one's error."""
    for task in [t for t in tasks if t.done()]:
        tasks.discard(task)
        task.result()


async def _unless_failed(work: Awaitable[T], moving: set[asyncio.Task[None]]) -> T:
    """`work`'s result, unless a transfer in `moving` fails first: then its error."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            _raise_failed(moving)
            if task.done():
                return task.result()
            await asyncio.wait({task, *moving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()


async def serve_stage_request(
    runner: StageRunner,
    request_id: str,
    block_table: Sequence[int],
    inbound: ChunkSource,
    outbound: ChunkSink,
    *,
    wait_s: float,
    kv: PageSink | None = None,
    commit_kv: bool = False,
    blocks: Sequence[tuple[int, PageSink]] = (),
    compute: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    kv_cuts: Sequence[int] | None = None,
) -> int:
    """Run request `request_id` through `runner`'s stage: chunks from `inbound`, in
    prompt order, the stage's output to `outbound`.

    Each chunk is computed on a worker thread (`compute(fn, *args)`: by default a fresh
    one each time; a service gives the stage's own thread, whose queue it can drain
    before reusing pages) while the previous chunk's output and KV pages still move,
    so this stage computes chunk i+1 while the next stage computes chunk i. With
    `kv`, the stage's pages go there as soon as the chunks filled them (its layers
    only); `commit_kv` (the last stage's job) commits that reservation
    once every earlier stage closed the request complete, which each does only after
    its own pages were sent, so every stage's layers are in.

    `blocks` are puts of the prompt's full blocks into a block store, (block index,
    the put's reservation), each holding every layer, index = the model's layer (the
    kvstore's put layout): every stage sends its layers of each, and the stage that
    commits the KV commits them too. An earlier stage sends its share before it closes
    the request complete, so when the last stage has seen the request closed, every
    share before its own is in; it sends its own and commits after closing, once the
    next hop has what it waits for. A block put that fails only leaves the block out
    of the store: it is counted in the returned number (0: every put this stage sent
    or committed went through), never raised.

    Every wait is bounded by `wait_s`. Failing (the neighbour's connection broke, a
    deadline, an upstream abort), the request is closed downstream as aborted, so the
    stages after this one end it too, and the error is raised.
    """
    cache = runner.cache
    cuts = list(kv_cuts) if kv_cuts else cache.head_cuts
    k = len(cuts) - 1
    moving: set[asyncio.Task[None]] = set()

    def spawn(work: Coroutine[Any, Any, None]) -> None:
        moving.add(asyncio.ensure_future(work))

    await outbound.open(request_id, deadline_s=wait_s)
    try:
        pages_sent = 0
        chunk_index = 0
        while True:
            # A transfer of an earlier chunk that fails (the next stage died) ends the
            # request now, not when the next chunk comes.
            header, payload = await _unless_failed(
                inbound.receive(request_id, chunk_index, deadline_s=wait_s), moving
            )
            inputs = hidden_from_buffer(header, payload, runner.device)
            out = await compute(
                runner.forward, inputs, block_table, header.start, header.prompt_len
            )
            _raise_failed(moving)
            if out is not None:
                out = out.cpu()
                spawn(
                    outbound.send(
                        request_id,
                        chunk_index,
                        header.describing(out),
                        hidden_bytes(out),
                        deadline_s=wait_s,
                    )
                )
            if kv is not None:
                # Only whole pages (and the prompt's last, partial one): a page the next
                # chunk still writes into must not move yet.
                num_pages = cache.pages_for(header.prompt_len)
                filled = num_pages if header.is_last_chunk else header.end // cache.block_size
                for j in range(len(runner.layer_range)):
                    layer = runner.layer_range.start + j
                    pages = range(pages_sent, filled)
                    pieces = [cache.pieces(j, block_table[i], cuts) for i in pages]
                    items = [
                        ((layer * k + p) * num_pages + i, of_page[p])
                        for p in range(k)
                        for i, of_page in zip(pages, pieces, strict=True)
                    ]
                    if items:
                        spawn(kv.send(items, deadline_s=wait_s))
                pages_sent = max(pages_sent, filled)
            if header.is_last_chunk:
                break
            chunk_index += 1
        await asyncio.gather(*moving)
        moving.clear()
        if not await inbound.wait_closed(request_id, deadline_s=wait_s):
            raise UpstreamFailed(f"the previous stage aborted {request_id}")
        failed_puts = 0
        if not commit_kv:
            failed_puts += await _put_blocks(runner, block_table, blocks, wait_s, commit=False)
        if kv is not None and commit_kv:
            await kv.commit(deadline_s=wait_s)
        await outbound.close(request_id, complete=True, deadline_s=wait_s)
        if commit_kv:
            failed_puts += await _put_blocks(runner, block_table, blocks, wait_s, commit=True)
        return failed_puts
    except BaseException:
        for task in moving:
            task.cancel()
        await asyncio.gather(*moving, return_exceptions=True)
        # The next stage may be what failed: telling it is best effort.
        with contextlib.suppress(Exception):
            await outbound.close(request_id, complete=False, deadline_s=wait_s)
        raise
    finally:
        inbound.forget(request_id)


async def _put_blocks(
    runner: StageRunner,
    block_table: Sequence[int],
    blocks: Sequence[tuple[int, PageSink]],
    wait_s: float,
    *,
    commit: bool,
) -> int:
    """Send this stage's layers of each block to its put (and commit it); how many
    failed. All at once: a put is one small round trip."""
    cache, layers = runner.cache, runner.layer_range

    async def put(block: int, sink: PageSink) -> None:
        items = [
            (layers.start + j, cache.page_view(j, block_table[block])) for j in range(len(layers))
        ]
        await sink.send(items, deadline_s=wait_s)
        if commit:
            await sink.commit(deadline_s=wait_s)

    results = await asyncio.gather(
        *(put(block, sink) for block, sink in blocks), return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # a cancellation, not a failed put
    return sum(isinstance(result, Exception) for result in results)


async def prefill_over_stages(
    first: ChunkSink,
    last: ChunkSource,
    request_id: str,
    token_ids: Sequence[int],
    *,
    num_cached_tokens: int = 0,
    chunk_size: int = 512,
    wait_s: float,
) -> torch.Tensor:
    """The driver's side of a group: feed `token_ids` in chunks to the first stage
    (`first`) and return the logits `[vocab]` the last stage sends back (`last`).

    The stages must hold the KV of the first `num_cached_tokens` tokens already.
    """
    n = len(token_ids)
    spans = chunk_spans(n, num_cached_tokens, chunk_size)
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    await first.open(request_id, deadline_s=wait_s)
    try:
        for index, (start, end) in enumerate(spans):
            piece = ids[start:end]
            header = HiddenHeader.of(
                piece, request_id=request_id, chunk_index=index, start=start, prompt_len=n
            )
            await first.send(request_id, index, header, hidden_bytes(piece), deadline_s=wait_s)
    except BaseException:
        # The stages end the request too, rather than wait for chunks that will not come.
        with contextlib.suppress(Exception):
            await first.close(request_id, complete=False, deadline_s=wait_s)
        last.forget(request_id)
        raise
    try:
        await first.close(request_id, complete=True, deadline_s=wait_s)
        header, payload = await last.receive(request_id, len(spans) - 1, deadline_s=wait_s)
        if not await last.wait_closed(request_id, deadline_s=wait_s):
            raise UpstreamFailed(f"the last stage aborted {request_id}")
        return hidden_from_buffer(header, payload, "cpu")
    finally:
        last.forget(request_id)
