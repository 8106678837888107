"""Making a connection without a listener, and ending one the peer can see.

`connect` is the sender's half of the handshake in `wire`: an endpoint from the
receiver's worker address, a `Hello` on the receiver's hello tag, the `Welcome` on
this side's REPLY tag. The receiver's half is `KVReceiver._welcome`.

`Goodbyes` tells a peer that a connection it still holds was dropped here: closing a
UCX endpoint made from a worker address sends nothing, and the peer would otherwise
keep receives posted (and a sender its unanswered segments) until its deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from yb_dataplane.transport import ucx_env
from yb_dataplane.transport.address import PeerAddress
from yb_dataplane.transport.errors import PeerUnreachable
from yb_dataplane.transport.link import Link, full_tag
from yb_dataplane.transport.ucx_env import UCXError, forget_traceback
from yb_dataplane.transport.wire import (
    PROTOCOL_VERSION,
    REPLY_TAG,
    Bye,
    Hello,
    Welcome,
    encode_frame,
)

log = logging.getLogger(__name__)

#: How long a goodbye may take; it is a courtesy, the peer's deadlines still hold.
_BYE_TIMEOUT_S: Final = 2.0


def new_tag_base() -> int:
    """A fresh, random base for a tag space (never 0: 0 means "not known yet")."""
    return secrets.randbits(64) | 1


def frame_array(frame: bytearray) -> np.ndarray:
    """A control frame as the uint8 array UCX sends from."""
    return np.frombuffer(frame, dtype=np.uint8)


async def connect(
    ucx: Any,
    peer: PeerAddress,
    *,
    name: str,
    timeout_s: float,
    on_abort: Callable[[Link, bool], None] | None = None,
) -> Link:
    """The sender's half of the handshake: a ready `Link` to `peer`, or PeerUnreachable.

    Bounded by `timeout_s`: a receiver that is gone (its worker address names a dead
    process) or does not answer is reported as unreachable when it passes.
    """
    try:
        # Made off the loop's thread and bounded (`ucx_env.create_endpoint`).
        endpoint = await ucx_env.create_endpoint(peer.worker, timeout_s=timeout_s)
    except TimeoutError:
        raise PeerUnreachable(f"{peer.label}: no UCX endpoint within {timeout_s:.1f}s") from None
    except (UCXError, RuntimeError, ValueError) as exc:
        forget_traceback(exc)
        raise PeerUnreachable(f"cannot reach {peer.label}: {exc}") from None
    log.debug("%s: endpoint made; saying hello", name)
    link = Link(
        endpoint, name, recv_base=new_tag_base(), peer_worker=peer.worker, on_abort=on_abort
    )
    hello = Hello(PROTOCOL_VERSION, ucx_env.worker_address(), link.recv_base, name)
    try:
        async with asyncio.timeout(timeout_s):
            await endpoint.send(
                frame_array(encode_frame(hello)), tag=peer.hello_tag, force_tag=True
            )
            reply = await link.recv_frame(REPLY_TAG)
    except TimeoutError:
        link.abort(notify=False)
        raise PeerUnreachable(
            f"{peer.label} did not answer the connection within {timeout_s:.1f}s"
        ) from None
    except UCXError as exc:
        forget_traceback(exc)
        link.abort(notify=False)
        raise PeerUnreachable(f"cannot connect to {peer.label}: {exc}") from None
    except BaseException:  # PeerUnreachable, FrameError, cancellation
        link.abort(notify=False)
        raise
    if not isinstance(reply, Welcome) or reply.recv_base == 0:
        link.abort(notify=False)
        why = reply.reason if isinstance(reply, Welcome) else type(reply).__name__
        raise PeerUnreachable(f"{peer.label} refused the connection: {why}")
    link.send_base = reply.recv_base
    return link


class Goodbyes:
    """Sends `Bye` to the peers of dropped links; owns those sends until `close()`.

    Pass `on_abort` as a link's `on_abort`; `tag` is the peer's tag that reads it
    (CTRL for a receiver's links, REPLY for a sender's).
    """

    def __init__(self, tag: int) -> None:
        self._tag = tag
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def on_abort(self, link: Link, notify: bool) -> None:
        if not notify or self._closed or not link.peer_worker or not link.send_base:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (interpreter shutdown): the peer's keepalive will do
        task = loop.create_task(
            self._say_bye(link.peer_worker, full_tag(link.send_base, self._tag), link.name),
            name=f"bye:{link.name}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _say_bye(self, worker: bytes, ucx_tag: int, name: str) -> None:
        endpoint: Any = None
        try:
            async with asyncio.timeout(_BYE_TIMEOUT_S):
                # Towards a peer that may be unreachable (why the link was dropped):
                # made off the loop's thread, so a stuck connect costs only this task.
                endpoint = await ucx_env.create_endpoint(worker, timeout_s=_BYE_TIMEOUT_S)
                frame = frame_array(encode_frame(Bye(f"{name} dropped")))
                await endpoint.send(frame, tag=ucx_tag, force_tag=True)
        except (TimeoutError, UCXError, RuntimeError, ValueError) as exc:
            forget_traceback(exc)
            log.debug("goodbye from %s not delivered: %s", name, exc)
        finally:
            if endpoint is not None:
                ucx_env.abort_endpoint(endpoint, f"goodbye from {name}")

    async def close(self) -> None:
        """Let the goodbyes in flight finish (each is bounded), then refuse new ones."""
        self._closed = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
