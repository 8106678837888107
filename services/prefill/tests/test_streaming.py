"""Layer streaming's ordering: no page goes to UCX before its layer's event completed.

On CUDA that event is a `torch.cuda.Event` recorded by `on_layer`; here it is a fake
whose completion the test controls, which tests our logic (what waits for what),
not a GPU. The sender is a recorder: what matters is when `send` is called and with
which pages.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest
import torch

from yb_dataplane.transport import PeerAddress, TransferTimeout
from yb_prefill.streaming import LayerStreamer, cuda_layer_event

BLOCK = 4
LAYERS = 2


class FakeEvent:
    """A recorded event: `query()` is False until the test calls `complete()`."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def complete(self) -> None:
        self.done = True


class FakeCache:
    """What the streamer reads of a `PagedKVCache`."""

    def __init__(self, pages: int, device: str = "cpu") -> None:
        self.block_size = BLOCK
        self.num_layers = LAYERS
        self.device = torch.device(device)
        self.kv = torch.zeros(LAYERS, pages, 1, 2, BLOCK, 2)
        self.head_cuts = [0, 1]
        self.page_nbytes = self.kv[0, 0].numel() * self.kv.element_size()

    def pieces(self, layer: int, page: int, cuts: list[int]) -> list[torch.Tensor]:
        return [self.kv[layer, page, a:b] for a, b in itertools.pairwise(cuts)]


class RecordingSender:
    """Records each segment's reservation indices, in the order `send` was called."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []
        self.items: list[list[tuple[int, Any]]] = []
        self.committed_with: list[bool] = []
        self.commits = 0
        #: The note of each commit, in order (on a segment's or on its own).
        self.notes: list[bytes] = []

    async def send(
        self,
        peer: PeerAddress,
        request_id: str,
        items: Sequence[tuple[int, Any]],
        *,
        deadline_s: float,
        receiver_breaks: Collection[int] | None = None,
        commit: bool = False,
        note: bytes = b"",
    ) -> None:
        assert deadline_s > 0
        assert commit or not note
        self.sent.append([index for index, _ in items])
        self.items.append(list(items))
        self.committed_with.append(commit)
        if commit:
            self.notes.append(note)

    async def commit(
        self, peer: PeerAddress, request_id: str, *, deadline_s: float, note: bytes = b""
    ) -> None:
        self.commits += 1
        self.notes.append(note)


async def until(holds: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until `holds()` (bounded: a broken ordering fails, it does not hang)."""
    async with asyncio.timeout(timeout_s):
        while not holds():
            await asyncio.sleep(0.001)


def streamer(
    sender: RecordingSender,
    events: list[FakeEvent] | None,
    *,
    num_tokens: int = 2 * BLOCK,
    deadline_s: float = 30.0,
    cache: Any = None,
    commit_last: bool = False,
    whole_below: int = 0,
) -> LayerStreamer:
    def record() -> FakeEvent:
        assert events is not None
        event = FakeEvent()
        events.append(event)
        return event

    pages = -(-num_tokens // BLOCK)
    return LayerStreamer(
        asyncio.get_running_loop(),
        sender,  # type: ignore[arg-type]
        PeerAddress("127.0.0.1", 1, b"w"),
        "req",
        cache or FakeCache(pages),
        list(range(pages)),
        num_tokens,
        0,
        deadline_s,
        layer_event=record if events is not None else None,
        commit_last=commit_last,
        whole_below=whole_below,
    )


async def test_pages_wait_for_their_layers_event() -> None:
    sender = RecordingSender()
    events: list[FakeEvent] = []
    s = streamer(sender, events)
    s.start()
    # The runner's hook runs on the engine thread.
    await asyncio.to_thread(s.on_layer, 0, 0, 2 * BLOCK)
    assert len(events) == 1
    # The sending task is waiting on layer 0's event, and has sent nothing.
    await until(lambda: events[0].queries >= 3)
    assert sender.sent == []

    await asyncio.to_thread(s.on_layer, 1, 0, 2 * BLOCK)
    await until(lambda: len(events) == 2 and events[1].queries >= 1)
    # Layer 1 finishing first releases layer 1 only; layer 0 still waits for its own.
    events[1].complete()
    await until(lambda: sender.sent == [[2, 3]])
    assert events[0].queries >= 1 and not events[0].done
    events[0].complete()
    await until(lambda: len(sender.sent) == 2)
    assert sender.sent == [[2, 3], [0, 1]]

    await s.finish()
    assert s.pages_sent == 4 and sender.commits == 1


async def test_merged_segments_wait_for_every_event_in_them() -> None:
    sender = RecordingSender()
    events: list[FakeEvent] = []
    s = streamer(sender, events)
    # Both layers are queued before the task runs: one segment, two events.
    s.on_layer(0, 0, 2 * BLOCK)
    s.on_layer(1, 0, 2 * BLOCK)
    s.start()
    await until(lambda: events[0].queries >= 2)
    events[0].complete()
    await until(lambda: events[1].queries >= 2)
    assert sender.sent == []
    events[1].complete()
    await s.finish()
    assert sender.sent == [[0, 1, 2, 3]]


async def test_a_layer_that_never_finishes_fails_at_the_deadline_unsent() -> None:
    sender = RecordingSender()
    events: list[FakeEvent] = []
    s = streamer(sender, events, deadline_s=0.3)
    s.start()
    await asyncio.to_thread(s.on_layer, 0, 0, 2 * BLOCK)
    with pytest.raises(TransferTimeout):
        await s.finish()
    assert sender.sent == [] and sender.commits == 0


async def test_cpu_records_no_event_and_cuda_does_by_default() -> None:
    sender = RecordingSender()
    cpu = streamer(sender, None)
    assert cpu._layer_event is None
    cpu.start()
    await asyncio.to_thread(cpu.on_layer, 0, 0, 2 * BLOCK)
    await asyncio.to_thread(cpu.on_layer, 1, 0, 2 * BLOCK)
    await cpu.finish()
    assert sorted(i for seg in sender.sent for i in seg) == [0, 1, 2, 3]
    # A CUDA cache gets real CUDA events (not created here: no GPU needed to check).
    cuda = streamer(sender, None, cache=FakeCache(2, device="cuda"))
    assert cuda._layer_event is cuda_layer_event


@pytest.mark.cuda
async def test_cuda_layer_event_follows_the_launched_kernels() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(8):
        a = a @ a / 2048
    event = cuda_layer_event()
    event.synchronize()  # type: ignore[attr-defined]
    assert event.query()


@pytest.mark.parametrize("commit_last", [False, True])
async def test_the_segment_that_completes_the_request_carries_the_commit(
    commit_last: bool,
) -> None:
    """With `commit_last`, the last page queued goes out alone with the commit, after
    the sends before it returned; without, `finish()` commits on its own."""
    sender = RecordingSender()
    s = streamer(sender, None, commit_last=commit_last)  # 2 layers of 2 pages
    s.start()
    s.on_layer(0, 0, 2 * BLOCK)
    await until(lambda: len(sender.sent) == 1)
    s.on_layer(1, 0, 2 * BLOCK)
    await asyncio.sleep(0)  # the hook queues from the loop's next turn, as from a thread
    await s.finish()
    assert sender.sent == [[0, 1], [2, 3]]
    assert sender.committed_with == [False, commit_last]
    assert sender.commits == (0 if commit_last else 1)
    assert s.pages_sent == 4


@pytest.mark.parametrize("commit_last", [True, False])
async def test_the_commit_waits_for_the_hand_over_and_carries_it(commit_last: bool) -> None:
    """Directed with `hand_over`, the commit (on the last segment, or `finish()`'s
    own) leaves only with the note `hand_over()` gives: the first token is sampled
    after the last layer's pages were queued."""
    sender = RecordingSender()
    s = LayerStreamer(
        asyncio.get_running_loop(),
        sender,  # type: ignore[arg-type]
        None,
        "req",
        FakeCache(2),  # type: ignore[arg-type]
        [0, 1],
        2 * BLOCK,
        0,
        30.0,
        commit_last=commit_last,
        whole_below=0,
    )
    s.start()
    s.direct(PeerAddress("127.0.0.1", 1, b"w"), None, hand_over=True)
    s.on_layer(0, 0, 2 * BLOCK)
    await until(lambda: len(sender.sent) == 1)
    s.on_layer(1, 0, 2 * BLOCK)
    for _ in range(20):
        await asyncio.sleep(0)
    # Every page is queued, the first token is not sampled yet: no commit has left.
    assert sender.notes == []
    assert sender.sent == ([[0, 1]] if commit_last else [[0, 1], [2, 3]])
    s.hand_over(b"start")
    await s.finish()
    assert sender.sent == [[0, 1], [2, 3]]
    assert sender.notes == [b"start"]
    assert sender.committed_with == [False, commit_last]


async def test_a_hand_over_that_never_comes_fails_the_commit_at_the_deadline() -> None:
    sender = RecordingSender()
    s = LayerStreamer(
        asyncio.get_running_loop(),
        sender,  # type: ignore[arg-type]
        None,
        "req",
        FakeCache(1),  # type: ignore[arg-type]
        [0],
        BLOCK,
        0,
        0.2,
        commit_last=True,
    )
    s.start()
    s.direct(PeerAddress("127.0.0.1", 1, b"w"), None, hand_over=True)
    s.on_layer(0, 0, BLOCK)
    s.on_layer(1, 0, BLOCK)
    with pytest.raises(TransferTimeout):
        await s.finish()
    assert sender.notes == [] and sender.sent == []


@pytest.mark.parametrize(
    ("whole_below", "segments"), [(1 << 20, [[0, 1, 2, 3]]), (255, [[0, 1], [2, 3]])]
)
async def test_a_small_request_goes_out_whole_with_its_commit(
    whole_below: int, segments: list[list[int]]
) -> None:
    """Up to `whole_below` bytes of KV (4 pages of 64 bytes here), the pages wait for
    each other and leave in one segment that commits; above, layer by layer."""
    sender = RecordingSender()
    s = streamer(sender, None, commit_last=True, whole_below=whole_below)
    s.start()
    s.on_layer(0, 0, 2 * BLOCK)
    for _ in range(20):
        await asyncio.sleep(0)
    assert sender.sent == segments[:-1]  # whole: nothing before the last layer
    s.on_layer(1, 0, 2 * BLOCK)
    await asyncio.sleep(0)  # the hook queues from the loop's next turn, as from a thread
    await s.finish()
    assert sender.sent == segments
    assert sender.committed_with == [False] * (len(segments) - 1) + [True]
    assert sender.commits == 0 and s.pages_sent == 4


async def test_pages_cut_at_head_runs_go_as_pieces_at_their_indices() -> None:
    # Two KV heads, cut between them (a tensor-parallel side): each page is two
    # pieces, index `(layer * num_pages + i) * 2 + j`, each a view of its heads.
    cache = FakeCache(2)
    cache.kv = torch.arange(LAYERS * 2 * 2 * 2 * BLOCK * 2, dtype=torch.float32).view(
        LAYERS, 2, 2, 2, BLOCK, 2
    )
    cache.head_cuts = [0, 2]
    cache.page_nbytes = cache.kv[0, 0].numel() * 4
    sender = RecordingSender()
    s = LayerStreamer(
        asyncio.get_running_loop(),
        sender,  # type: ignore[arg-type]
        PeerAddress("127.0.0.1", 1, b"w"),
        "req",
        cache,  # type: ignore[arg-type]
        [1, 0],
        2 * BLOCK,
        0,
        30.0,
        cuts=[0, 1, 2],
    )
    s.start()
    await asyncio.to_thread(s.on_layer, 1, 0, 2 * BLOCK)
    await until(lambda: sender.sent == [[4, 5, 6, 7]])
    items = sender.items[0]
    assert torch.equal(items[0][1], cache.kv[1, 1, 0:1])  # page 1 of the table first
    assert torch.equal(items[3][1], cache.kv[1, 0, 1:2])
    await s.abort()
