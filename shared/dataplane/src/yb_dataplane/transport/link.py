"""One UCX endpoint and the operations posted on it: the unit of failure of the data plane.

A `Link` is what both ends hold for a connection. Everything that can go wrong with a
connection (peer died, peer closed, a deadline left UCX operations posted) ends in
`abort()`, which closes the endpoint. Closing is also the only way to take back a
posted UCX operation: ucxx cannot cancel one receive or send, but closing an endpoint
cancels all of its requests. So after `abort()` returns, UCX no longer reads or writes
any buffer that was posted on this link; that is what makes it safe for `cancel()` and
deadlines to hand buffers back to their owners.

Receives are posted *through* the link's endpoint although UCX matches tags across
the whole worker: that is what ties them to the endpoint, so that closing it takes
them back, and what fails them when UCX declares the peer process dead.

Each side of a connection owns a tag space (`wire`): a link sends with tags derived
from the peer's base (`send_base`) and receives with tags derived from its own
(`recv_base`), so messages of different connections never match each other.

Closing an endpoint is not seen by the peer (only a dead process is), so `abort()`
calls the owner's `on_abort` hook, which sends the peer a `Bye` when it is still
worth telling (see `handshake.say_bye`).

Payloads are *posted* (`post_send`, `post_recv`) and awaited later (`Posted.wait`), so
that all the buffers of a segment are in UCX's hands at once. Posting goes straight to
the ucxx endpoint's request API (`tag_send`/`tag_recv` on the endpoint ucxx wraps)
instead of starting one asyncio task per buffer around `Endpoint.send/recv`: measured
with 32 pages of 12 KiB per segment, that halves the per-message cost (3.4-4.2 ms down
to 1.7-1.9 ms per segment). If a ucxx version lacks those internals, `Link` falls back
to one task per buffer around the public coroutines.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import struct
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import numpy as np

from yb_dataplane.transport import ucx_env
from yb_dataplane.transport.errors import PeerUnreachable
from yb_dataplane.transport.ucx_env import (
    RAW_API,
    UCXError,
    UCXTruncated,
    forget_traceback,
    refill_futures,
)
from yb_dataplane.transport.wire import MAX_FRAME, Message, decode_frame, encode_frame

log = logging.getLogger(__name__)

T = TypeVar("T")

# Posts between two top-ups of ucxx's futures pool (it holds 100).
_REFILL_EVERY = 32

_PAIR: Final = struct.Struct("<QQ")


def full_tag(base: int, tag: int) -> int:
    """The UCX tag of message kind `tag` in the tag space starting at `base`."""
    return int.from_bytes(hashlib.blake2b(_PAIR.pack(base, tag), digest_size=8).digest(), "little")


def _size(buffer: Any) -> str:
    size = getattr(buffer, "nbytes", None)
    return f"{size} bytes" if size is not None else "the buffer"


class MessageTruncated(PeerUnreachable):
    """A message longer than the buffer posted for it; UCX consumed it, kept nothing."""


def _settled(buffer: Any, future: asyncio.Future[Any]) -> None:
    # Runs when UCX is done with the request: retrieve a failure so that asyncio does
    # not log it when nobody awaits it (a link aborted mid-segment), and keep `buffer`
    # referenced until then (this callback holds it).
    del buffer
    if not future.cancelled():
        future.exception()


class Posted:
    """A send or receive already handed to UCX; `wait()` for its completion."""

    __slots__ = ("_link", "_request", "_size", "_task")

    def __init__(self, link: Link, request: Any, task: asyncio.Task[None] | None, size: str):
        self._link = link
        self._request = request
        self._task = task
        self._size = size

    async def wait(self) -> None:
        """Wait for completion; raises MessageTruncated or PeerUnreachable."""
        if self._task is not None:
            await self._task
            return
        try:
            await self._request.wait()
        except UCXTruncated as exc:
            forget_traceback(exc)
            raise MessageTruncated(f"{self._link.name}: message larger than {self._size}") from None
        except UCXError as exc:
            forget_traceback(exc)
            raise PeerUnreachable(f"{self._link.name}: transfer failed: {exc}") from None


class Link:
    """A ucxx endpoint plus what is posted and running on it.

    `name` is for logs. `send_base` is the peer's tag space (0 until the handshake
    says it), `recv_base` this side's. `peer_worker` is the peer's worker address,
    kept so that the owner can say goodbye; `on_abort(link, notify)` is called once,
    from `abort()`. Tasks started with `spawn` are owned: `abort()` cancels them,
    `close()` also awaits them.
    """

    def __init__(
        self,
        endpoint: Any,
        name: str,
        *,
        recv_base: int,
        send_base: int = 0,
        peer_worker: bytes = b"",
        on_abort: Callable[[Link, bool], None] | None = None,
    ) -> None:
        self._ep: Any = endpoint
        self.name = name
        self.send_base = send_base
        self.recv_base = recv_base
        self.peer_worker = peer_worker
        self._on_abort = on_abort
        # calloc'd: only the pages a frame actually touches become resident, so a
        # receiver with many senders does not pay MAX_FRAME of memory per connection.
        self._frame = np.zeros(MAX_FRAME, dtype=np.uint8)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._posts = 0
        raw = getattr(endpoint, "_ep", None)
        self._raw: Any = raw if RAW_API is not None and hasattr(raw, "tag_recv") else None

    @property
    def alive(self) -> bool:
        """False once aborted, or once UCX reported an error on the endpoint."""
        return not self._closed and self._ep is not None and bool(self._ep.alive)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start a task owned by this link."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- payloads ----------------------------------------------------------------------

    def post_send(self, buffer: Any, tag: int) -> Posted:
        """Hand `buffer` to UCX for sending with `tag` now; await the result later."""
        return self._post(buffer, tag, send=True)

    def post_recv(self, buffer: Any, tag: int) -> Posted:
        """Post a receive of the message with `tag` into `buffer` now."""
        return self._post(buffer, tag, send=False)

    def _post(self, buffer: Any, tag: int, *, send: bool) -> Posted:
        self._checked()
        if self._raw is None or RAW_API is None:
            coro = self.send_bytes(buffer, tag) if send else self.recv_into(buffer, tag)
            return Posted(self, None, self.spawn(coro, "send" if send else "recv"), "")
        array_type, tag_type, tag_mask_full = RAW_API
        self._posts += 1
        if self._posts % _REFILL_EVERY == 0:
            refill_futures()
        try:
            self._raw.raise_on_error()
            if send:
                ucx_tag = tag_type(full_tag(self.send_base, tag))
                request = self._raw.tag_send(array_type(buffer), ucx_tag)
            else:
                ucx_tag = tag_type(full_tag(self.recv_base, tag))
                request = self._raw.tag_recv(array_type(buffer), ucx_tag, tag_mask_full)
        except UCXError as exc:
            forget_traceback(exc)
            raise PeerUnreachable(f"{self.name}: cannot post: {exc}") from None
        future = getattr(request, "future", None)
        if isinstance(future, asyncio.Future):
            future.add_done_callback(functools.partial(_settled, buffer))
        return Posted(self, request, None, _size(buffer))

    # -- control frames and single messages ----------------------------------------------

    async def send_frame(self, message: Message, tag: int) -> None:
        """Send one control frame; raises PeerUnreachable if the link is broken."""
        await self.send_bytes(encode_frame(message), tag)

    async def recv_frame(self, tag: int) -> Message:
        """Receive the next control frame on `tag` (one at a time per tag)."""
        # Zero the length so that a (protocol-violating) empty message cannot replay the
        # previous frame left in the buffer.
        self._frame[:4] = 0
        await self.recv_into(self._frame, tag)
        return decode_frame(self._frame.data)

    async def send_bytes(self, buffer: Any, tag: int) -> None:
        """Send a buffer with `tag` and wait for it (ucxx's public coroutine).

        Raises PeerUnreachable if the link is broken or closes meanwhile.
        """
        ep = self._checked()
        try:
            await ep.send(buffer, tag=full_tag(self.send_base, tag), force_tag=True)
        except UCXError as exc:
            forget_traceback(exc)
            raise PeerUnreachable(f"{self.name}: send failed: {exc}") from None

    async def recv_into(self, buffer: Any, tag: int) -> None:
        """Receive the message with `tag` into `buffer` (ucxx's public coroutine).

        Raises MessageTruncated for a message longer than `buffer` (the link stays
        usable), PeerUnreachable if the link is broken or closes meanwhile.
        """
        ep = self._checked()
        try:
            await ep.recv(buffer, tag=full_tag(self.recv_base, tag), force_tag=True)
        except UCXTruncated as exc:
            forget_traceback(exc)
            raise MessageTruncated(f"{self.name}: message larger than {_size(buffer)}") from None
        except UCXError as exc:
            forget_traceback(exc)
            raise PeerUnreachable(f"{self.name}: receive failed: {exc}") from None

    def _checked(self) -> Any:
        if self._closed or self._ep is None:
            raise PeerUnreachable(f"{self.name}: link closed")
        return self._ep

    # -- teardown ----------------------------------------------------------------------

    def abort(self, *, notify: bool = True) -> None:
        """Close the endpoint now, cancelling its UCX requests and this link's tasks.

        Synchronous on purpose: callers rely on UCX having let go of every posted
        buffer when it returns. The close itself runs on a thread of its own
        (`ucx_env.abort_endpoint`), waited for at most `ucx_env.CLOSE_WAIT_S`: if
        UCX's progress thread is stuck, the close is left to that thread and logged,
        and this returns anyway (UCX cancels the requests before it progresses
        anything again, so nothing lands in the buffers afterwards).
        `notify=False` when the peer is known to be gone or to have dropped the
        connection itself (no `Bye` is then worth sending).
        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        ep, self._ep = self._ep, None
        self._raw = None
        if ep is not None and not ep.alive:
            notify = False  # UCX declared the peer dead: nobody to tell
        if ep is not None:
            # Off the loop's thread, bounded: a stuck UCX costs this call at most
            # `ucx_env.CLOSE_WAIT_S`, never the process's event loop.
            ucx_env.abort_endpoint(ep, self.name)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if self._on_abort is not None:
            hook, self._on_abort = self._on_abort, None
            hook(self, notify)

    async def close(self) -> None:
        """Abort, then wait for every task of this link to finish."""
        self.abort()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
