"""Where a `KVReceiver` can be reached: its UCX worker address and its hello tag.

There is no listening socket behind an address. UCX connects by *worker address* (the
blob of transport addresses a UCX worker publishes: shared-memory segment ids, the
TCP address of each network device it was allowed to use), and the receiver picks
the connections it is offered out of the worker's tag matching with a tag of its own
(`hello_tag`, like a port: one process may run several receivers). So what is
reachable is exactly what the worker's transports expose, on the devices the
receiver was bound to (`ucx_env.Binding`), and nothing listens on 0.0.0.0.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Final

_SCHEME: Final = "ucx://"
#: A UCX worker address is a few hundred bytes (one entry per transport and device);
#: anything far larger is not one.
MAX_WORKER_ADDRESS: Final = 16 << 10


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """A receiver: the host it announced (for people), its hello tag and worker address.

    Events and control messages carry it as a string (`to_wire()`,
    `"ucx://HOST/TAG/WORKER"`: the tag in hex, the worker address in unpadded
    URL-safe base64), which is also `str()`; `parse` reads it back. msgspec structs
    should declare the field as `str` and convert at the edge. `label` is a short
    name for logs.
    """

    host: str
    hello_tag: int
    worker: bytes

    def __post_init__(self) -> None:
        if not self.host or "/" in self.host:
            raise ValueError(f"PeerAddress needs a host without '/': {self.host!r}")
        if not 0 < self.hello_tag < 1 << 64:
            raise ValueError(f"PeerAddress hello tag out of range: {self.hello_tag}")
        if not 0 < len(self.worker) <= MAX_WORKER_ADDRESS:
            raise ValueError(f"PeerAddress worker address of {len(self.worker)} bytes")

    @property
    def label(self) -> str:
        """A short, stable name for logs: the host and a digest of the rest."""
        digest = hashlib.blake2b(self.worker, digest_size=3).hexdigest()
        return f"{self.host}#{digest}.{self.hello_tag & 0xFFFF:04x}"

    def __str__(self) -> str:
        return self.to_wire()

    def to_wire(self) -> str:
        """The string form carried in events and control frames."""
        encoded = base64.urlsafe_b64encode(self.worker).rstrip(b"=").decode()
        return f"{_SCHEME}{self.host}/{self.hello_tag:x}/{encoded}"

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Inverse of `to_wire`; raises ValueError for anything else."""
        text = text.strip()
        if not text.startswith(_SCHEME):
            raise ValueError(f"not a UCX receiver address: {text[:60]!r}")
        parts = text[len(_SCHEME) :].split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"not a UCX receiver address: {text[:60]!r}")
        host, tag, encoded = parts
        try:
            hello_tag = int(tag, 16)
            padded = encoded + "=" * (-len(encoded) % 4)
            worker = base64.b64decode(padded, altchars=b"-_", validate=True)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"not a UCX receiver address: {text[:60]!r}: {exc}") from None
        return cls(host, hello_tag, worker)

    from_wire = parse
