"""Bounds on slow HTTP clients, enforced where the bytes are: the connection's protocol.

uvicorn bounds neither a client that trickles its request nor one that stops reading
its response. Its keep-alive timer is armed only after a response and restarts at
every byte received, so a request head or body sent a byte at a time holds the
connection forever. A response whose client does not read fills the kernel's send
buffer, then the transport's; the transport pauses writing and uvicorn's `send()`
waits for it to resume, for as long as the connection lives. The request behind it
keeps its KV pages and its decode slot all that time.

`guarded_protocol()` returns uvicorn's HTTP protocol class (the one `http="auto"`
picks) with two deadlines per connection:

- Read deadline (`gateway.body_timeout_s`): armed when the connection opens and when
  a response completes (the next request of a kept-alive connection starts there).
  When it fires, a request whose head or body is still incomplete is answered 408
  and the connection closed. The application sees a request once its head is in and
  reads the whole body before it admits anything, so such a request never reaches
  the bus: the handler's wait for the body ends with the disconnect. A connection on
  which nothing at all arrived is closed without an answer.
- Stall deadline (`gateway.stream_stall_timeout_s`): armed when the transport pauses
  writing (the kernel's send buffer and our `send_buffer_bytes` above it are full)
  and disarmed when it resumes, so a client that reads, however slowly, only has to
  make room once per deadline. When it fires the connection is aborted (RST, the
  buffered bytes dropped): uvicorn reports the disconnect to the application, which
  cancels the request on the bus as for any client that leaves (`completions`), and
  decode frees its pages and its batch slot.

Invariants: a connection is dropped at most once, each drop is counted
(`yb_gateway_slow_client_drops_total{reason}`) and logged with its request id; every
timer is cancelled when the connection is lost. What a stalled client costs the
gateway is bounded: the kernel's send buffer (`socket_send_buffer_bytes`, or the
kernel's autotuned size), `send_buffer_bytes`, and the token chunks that reach its
session during the stall deadline (never more than its `max_tokens`).

The subclass relies on what uvicorn's two HTTP protocols (httptools and h11) share:
`cycle` (`more_body`, `response_started`, `disconnected`, `message_event`, `scope`),
`transport`, `loop`, `on_response_complete`, `pause_writing`/`resume_writing`; the
tests exercise it on the one installed.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from yb_core.config import GatewayConfig
from yb_core.telemetry import get_logger
from yb_gateway.metrics import REQUEST_TIMEOUT, STREAM_STALL, GatewayMetrics
from yb_gateway.schemas import ErrorBody, ErrorDetail

if TYPE_CHECKING:
    # Type-checked against the httptools protocol, built on whichever uvicorn picks.
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _ProtocolBase
else:
    _ProtocolBase = object

log = get_logger(__name__)

# Where a drop is noted in the request's scope state (litestar's `request.state`), so
# the endpoint can say why the request ended.
DROPPED_STATE_KEY = "yb_client_dropped"


@dataclass(frozen=True)
class ClientLimits:
    """The slow-client settings of one gateway (see `GatewayConfig`)."""

    body_timeout_s: float
    stall_timeout_s: float
    send_buffer_bytes: int
    socket_send_buffer_bytes: int

    @classmethod
    def from_config(cls, gcfg: GatewayConfig) -> ClientLimits:
        """The limits of `gcfg`; bad values are a `ValueError` (the config file's
        loader refuses them earlier, a struct built in code is checked here)."""
        if not gcfg.body_timeout_s > 0 or not gcfg.stream_stall_timeout_s > 0:
            raise ValueError("gateway.body_timeout_s and stream_stall_timeout_s must be > 0")
        if gcfg.send_buffer_bytes < 1024 or gcfg.socket_send_buffer_bytes < 0:
            raise ValueError(
                "gateway.send_buffer_bytes must be >= 1024 and socket_send_buffer_bytes >= 0"
            )
        return cls(
            body_timeout_s=gcfg.body_timeout_s,
            stall_timeout_s=gcfg.stream_stall_timeout_s,
            send_buffer_bytes=gcfg.send_buffer_bytes,
            socket_send_buffer_bytes=gcfg.socket_send_buffer_bytes,
        )


def _timeout_answer(limit_s: float, what: str) -> bytes:
    body = msgspec.json.encode(
        ErrorBody(
            error=ErrorDetail(
                message=f"The request {what} did not arrive within body_timeout_s={limit_s:g}s.",
                type="invalid_request_error",
                param=None,
                code="request_timeout",
            )
        )
    )
    head = (
        b"HTTP/1.1 408 Request Timeout\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n" % len(body)
    )
    return head + body


class _SlowClientGuard(_ProtocolBase):
    """The deadlines, mixed in before uvicorn's protocol (see the module docstring)."""

    limits: ClientLimits  # set on the class `guarded_protocol` builds
    metrics: GatewayMetrics
    _read_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    # The request cycle when the read deadline was armed: the same one at expiry means
    # no new request head arrived since.
    _armed_cycle: Any = None
    _bytes_since_armed = False
    _dropped = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        # Our buffer above the kernel's: the transport pauses writing past it.
        transport.set_write_buffer_limits(high=limits.send_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # An answer is several small writes (the head, each SSE chunk, the last
            # chunk). Under Nagle's algorithm each waits for the ACK of the one before,
            # which a client's delayed ACK holds back up to 40 ms: the end of every
            # answer on a kept-alive connection arrived that much late. uvicorn leaves
            # the option off on the sockets it accepts.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if limits.socket_send_buffer_bytes:
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, limits.socket_send_buffer_bytes
                )
        self._arm_read_deadline(None)

    def data_received(self, data: bytes) -> None:
        self._bytes_since_armed = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        completed = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline(completed)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None and not self._dropped:
            self.metrics.stalled.inc()
            self._stall_timer = self.loop.call_later(self.limits.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_stall()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._disarm_stall()
        super().connection_lost(exc)

    # --- the deadlines ---------------------------------------------------------------

    def _arm_read_deadline(self, cycle: Any) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._armed_cycle = cycle
        self._bytes_since_armed = False
        self._read_timer = self.loop.call_later(self.limits.body_timeout_s, self._read_expired)

    def _read_expired(self) -> None:
        self._read_timer = None
        if self._dropped or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is self._armed_cycle:  # no request head since the deadline was armed
            if not self._bytes_since_armed:
                # Idle: nobody is owed an answer (a pooled client may not expect one).
                self.transport.close()
                return
            what = "head"
        elif cycle.more_body and not cycle.response_started:
            what = "body"
        else:
            return  # read in time; what follows is the response's (the stall deadline)
        self._drop(
            REQUEST_TIMEOUT,
            f"request {what} not in within body_timeout_s",
            cycle if what == "body" else None,
        )
        if what == "body":
            # The handler waits for the rest of the body: it hears of the disconnect
            # now, and nothing it might send goes out.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(_timeout_answer(self.limits.body_timeout_s, what))
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # a client that reads nothing would hold it open
        else:
            self.transport.close()

    def _stalled(self) -> None:
        self._disarm_stall()
        if self._dropped or self.transport.is_closing():
            return
        self._drop(
            STREAM_STALL,
            f"client did not read for stream_stall_timeout_s={self.limits.stall_timeout_s:g}s",
            self.cycle,
        )
        # Abort, not close: a graceful close waits for the buffer to drain, which a
        # client that does not read never lets happen.
        self.transport.abort()

    def _disarm_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
            self.metrics.stalled.dec()

    def _drop(self, reason: str, message: str, cycle: Any) -> None:
        """Count and log a drop; note it in `cycle`'s request state (None: the
        request never got a cycle, its head did not arrive)."""
        self._dropped = True
        self.metrics.slow_client_drops.labels(reason).inc()
        request_id = None
        state = cycle.scope.get("state") if cycle is not None else None
        if isinstance(state, dict):
            state[DROPPED_STATE_KEY] = message
            request_id = state.get("request_id")
        log.warning(
            "slow_client_dropped",
            reason=reason,
            detail=message,
            request_id=request_id,
            client=f"{self.client[0]}:{self.client[1]}" if self.client else None,
        )


def guarded_protocol(limits: ClientLimits, metrics: GatewayMetrics) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the slow-client deadlines of `limits`."""
    guarded: type[asyncio.Protocol] = type(
        "GuardedHTTPProtocol",
        (_SlowClientGuard, AutoHTTPProtocol),
        {"limits": limits, "metrics": metrics},
    )
    return guarded
