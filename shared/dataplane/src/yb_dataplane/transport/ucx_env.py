"""The one place that configures and imports ucxx.

UCX reads its configuration from the environment when the first context is created,
and ucxx sets a few variables of its own at import time; so every module of this
package imports ucxx through here, after `UCX_ENV_DEFAULTS` are in place. Each default
is only a default (`os.environ.setdefault`): an operator can still override any of them.

Why each setting:

- No `UCX_MM_ERROR_HANDLING`: the data plane needs peer-failure detection (a killed
  sender must fail the transfer, not hang it), so every endpoint is created with error
  handling, and UCX then leaves out the transports that do not claim it. By default
  its shared-memory FIFO transports (`mm`: sysv, posix) do not, and they must stay out:
  every sender on the host writes its small messages into one FIFO per receiving
  process, which the receiver reads in order, and a sender killed between taking a
  slot and filling it leaves a slot that never fills. From then on no message from any
  process on the host reaches that receiver (seen: a killed prefill's successor could
  not even say hello to its decode instance). Small messages and handshakes therefore
  go over TCP on loopback, and bulk bytes still move zero-copy by CMA (below);
  `test_processes_share_no_shared_memory_fifo` reads UCX's own protocol report to
  check it.
- `UCX_CMA_MEMORY_INVALIDATE=y`: with error handling, UCX only picks the zero-copy
  rendezvous *get* (the receiver reads the sender's pages with one
  `process_vm_readv`) if the memory domain can revoke remote access to memory whose
  request failed. CMA cannot really revoke, and UCX asks us to promise. The promise is
  safe here: CMA only ever *reads* the sender's pages (nothing remote writes our
  memory), and a read of pages that changed after a failure is caught by the xxh3
  checksum the receiver verifies on every buffer. Without it, intra-host rendezvous is
  "fragmented copy-in copy-out" through a shared bounce buffer: two copies instead of
  one.
- `UCX_WARN_UNUSED_ENV_VARS=n`: ucxx itself sets `UCX_MEMTYPE_CACHE`, which UCX 1.21
  no longer knows, and UCX prints a warning about it in every process.
- `UCX_TCP_CONN_NB=y`: UCX's TCP transport otherwise calls a *blocking* `connect()`
  inside `ucp_ep_create`, on ucxx's progress thread, while it holds the worker's lock.
  Towards a host whose packets are silently dropped (a firewall's DROP) that call
  waits for the kernel's SYN retries (about two minutes): the progress thread stops,
  every other transfer of the process stops with it, and whichever thread asked ucxx
  for something meanwhile (an endpoint, a close) waits in ucxx's
  `Worker::registerGenericPre`, which cannot cancel a callback already running and
  retries forever ("UCXX WARN Could not cancel after 10 attempts, the callback has
  not returned and the process may stop responding"). Seen in the multi-host test:
  prefill-0's event loop froze there and its heartbeats stopped. Non-blocking, the
  connect is finished by the progress thread's event handling and a blackholed peer
  costs only the transfers to it (they fail at their deadlines).
- `UCX_KEEPALIVE_INTERVAL=1s`: connections are made by worker address (no connection
  manager socket whose closing would tell us), so a dead peer process is noticed by
  UCX's keepalive round, by default every 20 s. Within one host a round only checks
  that the peer's process still exists; across hosts it is one small message per
  endpoint: a second is cheap and bounds how long a transfer waits on a dead peer.

Where UCX listens is set per process by `Binding` (the `ucx_host` / `ucx_port` of a
service's config): its network transports use only the interface that holds
`ucx_host` (`NET_DEVICES`) and, when `ucx_port` is set, listen on that TCP port.
Passed to `ucxx.init` as options, so an operator's `UCX_NET_DEVICES` or
`UCX_TCP_PORT_RANGE` in the environment still wins.

ucxx's context is process-global and bound to the event loop that created it (its
progress thread and its notifier thread deliver completions to that loop). Services
run one loop per process; tests run one loop per test. `acquire()` therefore
initialises ucxx for the running loop, and the last `release()` shuts it down again.
Completions are delivered through Python futures (`enable_python_future=True`):
without them, every pending receive (such as the idle receive for the next control
message) spins the event loop with `sleep(0)` and burns a whole core (measured: 98%
CPU while idle, 1% with futures).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

T = TypeVar("T")

UCX_ENV_DEFAULTS: Final[dict[str, str]] = {
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_KEEPALIVE_INTERVAL": "1s",
    "UCX_TCP_CONN_NB": "y",
}

for _key, _value in UCX_ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

import ucxx  # noqa: E402  (must follow the environment set-up above)
import ucxx.core  # noqa: E402
import ucxx.exceptions  # noqa: E402
from ucxx._lib import libucxx as _ucx_api  # noqa: E402
from ucxx._lib_async import application_context as _app_context  # noqa: E402
from ucxx._lib_async import continuous_ucx_progress as _progress  # noqa: E402
from ucxx._lib_async.endpoint import Endpoint as _Endpoint  # noqa: E402

from yb_core.netaddr import interface_of, is_wildcard  # noqa: E402

log = logging.getLogger(__name__)

#: How long ucxx's progress thread may sleep in `epoll_wait` with nothing to do (ms).
#: ucxx's own value, 1 ms, wakes every UCX process a thousand times a second while
#: idle (measured: 12 ms of CPU a second per process, about 70 ms a second for an idle
#: `yb up` cluster of five UCX processes). Nothing waits on that wake-up: every
#: operation posted from the event loop is signalled to the thread (delayed
#: submission, on in the thread mode), every completion and arrival is an event on the
#: worker's file descriptor, and `ucp_worker_arm` refuses to sleep while UCX has work
#: pending. What is left for the timeout is UCX's own timers (keep-alive every
#: `UCX_KEEPALIVE_INTERVAL`, 1 s), which it bounds at this value.
PROGRESS_EPOLL_TIMEOUT_MS: Final = 10


class _ThreadMode(_progress.ProgressTask):  # type: ignore[misc]  # ucxx is untyped
    """ucxx's thread progress mode (`continuous_ucx_progress.ThreadMode`) with
    `PROGRESS_EPOLL_TIMEOUT_MS` instead of its fixed 1 ms; installed below for every
    context this process makes."""

    def __init__(
        self, worker: Any, event_loop: asyncio.AbstractEventLoop, polling_mode: bool = False
    ) -> None:
        super().__init__(worker, event_loop)
        worker.set_progress_thread_start_callback(_progress._create_context)
        worker.start_progress_thread(
            polling_mode=polling_mode, epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS
        )
        weakref.finalize(self, worker.stop_progress_thread)


if getattr(_app_context, "ThreadMode", None) is _progress.ThreadMode:
    # Where a ucxx version lays this out differently, its own progress thread stays.
    _app_context.ThreadMode = _ThreadMode

#: How long the event loop's thread waits for ucxx to close an endpoint (s) before it
#: leaves the close to the thread doing it. A healthy progress thread closes in
#: microseconds; a stuck one could hold the caller for ucxx's own bounds (up to tens
#: of seconds, or for ever when a callback it waits on is stuck).
CLOSE_WAIT_S: Final = 0.5
#: ucxx's own bound for each step of a close (ns), on the closing thread.
CLOSE_PERIOD_NS: Final = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Binding:
    """Where this process's UCX transports may be reached.

    `devices`: the network devices UCX may use (`""`: all of them); `tcp_port`: the
    port its TCP transport listens on (0: any free one).
    """

    devices: str = ""
    tcp_port: int = 0

    @classmethod
    def for_host(cls, host: str, port: int = 0) -> Binding:
        """The binding for a service's `ucx_host` and `ucx_port`.

        A wildcard host means every device. Any other host must be an address of this
        machine (ValueError otherwise, naming it): UCX then uses its interface only.
        """
        if not 0 <= port < 65536:
            raise ValueError(f"ucx_port out of range: {port}")
        if is_wildcard(host):
            return cls("", port)
        device = interface_of(host)
        if device is None:
            raise ValueError(
                f"ucx_host {host!r} is not an address of any interface of this machine"
            )
        return cls(device, port)

    def options(self) -> dict[str, str]:
        """`ucxx.init` options for this binding."""
        options: dict[str, str] = {}
        if self.devices:
            options["NET_DEVICES"] = self.devices
        if self.tcp_port:
            options["TCP_PORT_RANGE"] = f"{self.tcp_port}-{self.tcp_port}"
        return options


#: Every error ucxx raises for a failed or cancelled operation derives from this.
UCXError: Final[type[Exception]] = ucxx.exceptions.UCXError
#: A message longer than the buffer posted for it (the receive consumed it anyway).
UCXTruncated: Final[tuple[type[Exception], ...]] = (
    ucxx.exceptions.UCXMessageTruncatedError,
    ucxx.exceptions.UCXMsgTruncated,
)


def _raw_api() -> tuple[Any, Any, Any] | None:
    """ucxx's request-level building blocks, for `Link`'s posted operations (see there).

    None if this ucxx version lays them out differently; `Link` then falls back to
    ucxx's public coroutines.
    """
    try:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull
    except ImportError:
        return None
    return Array, Tag, TagMaskFull


#: (Array, Tag, TagMaskFull), or None.
RAW_API: Final = _raw_api()


def refill_futures() -> None:
    """Top up ucxx's pool of Python futures (one is taken per posted request).

    ucxx keeps at most 100 ready and refills them from its notifier thread; a segment
    of hundreds of pages posted at once empties the pool, and ucxx then refills it
    itself with a warning printed per request. Calling this every few dozen posts
    keeps the pool full (it is cheap when it is).
    """
    ctx = ucxx.core._ctx
    worker = getattr(ctx, "worker", None) if ctx is not None else None
    populate = getattr(worker, "populate_python_futures_pool", None)
    if populate is not None:
        populate()


def forget_traceback(exc: BaseException) -> None:
    """Strip the traceback frames off a caught ucxx exception and its whole chain.

    ucxx completes requests through futures that its C++ worker keeps, and the
    exception object set on such a future is the very one raised to us; Python appends
    every frame it passes through to that object's traceback. Left alone, those frames
    (with the buffers, endpoints and the ucxx context they reference) live as long as
    ucxx keeps the future: KV memory stays pinned and `ucxx.reset()` refuses. So each
    ucxx exception we catch is stripped here and replaced by one of our own.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


_bound_loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
_binding: Binding | None = None
_users = 0
_lock = threading.Lock()


def acquire(binding: Binding | None = None) -> Any:
    """Return the ucxx module, initialised for the running event loop.

    Every KVReceiver and KVSender holds one acquisition while it is open and gives it
    back with `release()`; when the last one goes, ucxx's threads are stopped and its
    context is reset, so a later user (a later test, on its own loop) starts afresh.
    Raises RuntimeError while ucxx is held by users on another, still running loop.

    `binding` applies when this call creates the context (a receiver passes its own;
    a sender, which only connects out, passes none). A context made already with a
    different binding keeps it, with a warning: UCX's transports are fixed per
    context.
    """
    global _bound_loop, _users, _binding
    loop = asyncio.get_running_loop()
    with _lock:
        bound = _bound_loop() if _bound_loop is not None else None
        if ucxx.core._ctx is not None and bound is not loop:
            if _users > 0 and bound is not None and not bound.is_closed():
                raise RuntimeError(
                    "ucxx is in use from another event loop; a process uses UCX from one "
                    "loop at a time (close every KVReceiver and KVSender first)"
                )
            _shutdown()
            _users = 0  # whoever held it lived on a loop that is gone
        if ucxx.core._ctx is None:
            ucxx.init(
                options=(binding or Binding()).options(),
                env_takes_precedence=True,
                progress_mode="thread",
                enable_python_future=True,
            )
            _bound_loop = weakref.ref(loop)
            _binding = binding
        elif binding is not None and binding != _binding:
            log.warning(
                "UCX was initialised with %s already; %s cannot apply to this process",
                _binding,
                binding,
            )
        _users += 1
        return ucxx


def held() -> Any:
    """The ucxx module, for code that runs while its owner holds an `acquire()`."""
    return ucxx


def worker_address() -> bytes:
    """This process's UCX worker address (after `acquire()`)."""
    return bytes(ucxx.get_worker_address().tobytes())


def address_from(worker: bytes) -> Any:
    """A peer's worker address as ucxx takes it (`create_endpoint_from_worker_address`)."""
    from ucxx._lib.libucxx import UCXAddress

    return UCXAddress.create_from_buffer(worker)


def _on_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run `fn` on a daemon thread of its own; its result as a future.

    A thread per call, not a pool: a call stuck in ucxx must not hold up the next.
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever awaits the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def create_endpoint(worker: bytes, *, timeout_s: float) -> Any:
    """A ucxx `Endpoint` to the worker address `worker`, made off the loop's thread.

    ucxx creates endpoints synchronously (`ucp_ep_create` on its progress thread,
    which the calling thread waits for). Here a thread of its own waits instead, and
    the caller gets TimeoutError after `timeout_s` (or its own cancellation) whatever
    ucxx does: an endpoint that is made after that is closed by its thread, never
    handed out. Raises what ucxx raises for a bad address or a failed create.
    """
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()  # what ucxx's own create_endpoint* does first
    address = address_from(worker)
    made = _on_thread(
        lambda: _ucx_api.UCXEndpoint.create_from_worker_address(ctx.worker, address, True),
        "yb-ucx-connect",
    )
    try:
        raw = await asyncio.wait_for(asyncio.wrap_future(made), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        # Runs at once if it finished meanwhile, else when it does: never leak it.
        made.add_done_callback(_close_late)
        raise
    return _Endpoint(endpoint=raw, ctx=ctx, tags=None)


def _close_late(made: concurrent.futures.Future[Any]) -> None:
    if made.cancelled() or made.exception() is not None:
        return
    raw = made.result()
    _on_thread(lambda: raw.close_blocking(CLOSE_PERIOD_NS, 1), "yb-ucx-close")


def abort_endpoint(endpoint: Any, name: str) -> bool:
    """Close a ucxx `Endpoint` now, cancelling every request posted on it.

    The close runs on a thread of its own; the caller waits for it at most
    `CLOSE_WAIT_S`. True if it finished in that time: UCX then no longer reads or
    writes any buffer posted on the endpoint. False if it did not (ucxx's progress
    thread is stuck): the close is abandoned to its thread and logged, and it still
    cancels the endpoint's requests before ucxx progresses anything else (ucxx runs
    queued closes before its next progress round), so a stuck progress thread that
    comes back does not complete them into buffers their owner has taken back.
    """
    done = threading.Event()

    def close() -> None:
        try:
            endpoint.abort(period=CLOSE_PERIOD_NS, max_attempts=1)
        except Exception:  # the endpoint is going away either way
            log.debug("endpoint abort failed on %s", name, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=close, name="yb-ucx-close", daemon=True).start()
    if done.wait(CLOSE_WAIT_S):
        return True
    log.warning(
        "closing the UCX endpoint of %s did not finish in %.1fs (UCX progress is stuck); "
        "left to finish on its own thread",
        name,
        CLOSE_WAIT_S,
    )
    return False


def release() -> None:
    """Give back one `acquire()`; the last one shuts ucxx down."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            _shutdown()


def _shutdown() -> None:
    global _bound_loop, _binding
    if ucxx.core._ctx is None:
        return
    _binding = None
    _stop_notifier()
    try:
        ucxx.reset()
    except Exception:  # ucxx's UCXError, listing what still references the context
        # reset() has dropped its reference already; the old context lives on until
        # those references go, and the next acquire() creates a new one.
        log.warning("ucxx context still referenced at shutdown", exc_info=True)
    _bound_loop = None


def _stop_notifier() -> None:
    """Stop ucxx's notifier thread promptly.

    The thread waits up to a second for request completions; waking the worker's
    notifier first makes the stop immediate instead of costing that second.
    """
    ctx = ucxx.core._ctx
    if ctx is None:
        return
    worker = getattr(ctx, "worker", None)
    if worker is None or getattr(ctx, "notifier_thread", None) is None:
        return
    worker.stop_request_notifier_thread()
    ucxx.stop_notifier_thread()
    # The thread may have been between two waits when it was woken; stopping once more
    # after it is gone leaves the worker's notifier marked stopped, so the worker's
    # destructor does not warn that it had to stop it itself.
    worker.stop_request_notifier_thread()


def _at_exit() -> None:
    # The notifier thread is not a daemon: without this, the interpreter waits for it
    # forever at exit. `threading._register_atexit` hooks run before non-daemon threads
    # are joined (concurrent.futures uses the same hook for the same reason).
    with contextlib.suppress(Exception):  # best effort at interpreter exit
        _stop_notifier()


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
