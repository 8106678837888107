"""How KV blocks travel to and from a kvstore: the request ids of puts and fetches.

A block is one page of every layer: `num_layers` chunks of `page_nbytes`, which in an
engine's cache are not adjacent (`kv[layer, page]`). A *put* therefore sends
`num_layers` buffers straight from the engine's pages (one segment), and the store
lays them side by side in one slot. The transport's segment header carries indices
and sizes but not block keys, so a put's request id names the block and its layout:
`put.<key hex>.<num_layers>.<page_nbytes>.<nonce>`; the store refuses anything else.

A *fetch* (`KVSender.request_fetch`) names its keys (`key_text`) and asks for each
block in `num_layers` chunks, so that each chunk lands in its own engine page: its
request id ends in `.L<num_layers>`, and reservation index `i * num_layers + layer`
is chunk `layer` of the `i`-th key. A pipeline stage holding layers `[a, b)` only
asks for those chunks: the id ends in `.L<num_layers>x<a>-<b>`, and reservation
index `i * (b - a) + (layer - a)` is chunk `layer` of the `i`-th key.

A tensor-parallel engine keeps each layer's page cut across its ranks, in `k` equal
runs of heads (head-major pages: each run is one region of the block's layer chunk,
`yb_core.kv_spec`). It sends and receives each chunk as its `k` pieces: a put's id
ends in `.p<k>` (index `layer * k + j` is piece `j` of chunk `layer`), and a fetch's in
`p<k>` after its layers (index `(i * (b - a) + (layer - a)) * k + j`). The store keeps
the block whole, whatever `k` wrote it, and cuts it for whatever `k` asks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

PUT_PREFIX = "put"


@dataclass(frozen=True, slots=True)
class PutId:
    """A parsed put request id."""

    key: int
    num_layers: int
    page_nbytes: int
    pieces: int = 1

    @property
    def block_nbytes(self) -> int:
        """Bytes of the whole block."""
        return self.num_layers * self.page_nbytes

    def request_id(self) -> str:
        """A fresh request id for one put of this block."""
        nonce = uuid.uuid4().hex[:8]
        rid = f"{PUT_PREFIX}.{self.key:x}.{self.num_layers}.{self.page_nbytes}.{nonce}"
        return rid if self.pieces == 1 else f"{rid}.p{self.pieces}"


def parse_put_id(request_id: str) -> PutId | None:
    """The put a request id describes, or None if it is not a well-formed put."""
    parts = request_id.split(".")
    if len(parts) not in (5, 6) or parts[0] != PUT_PREFIX:
        return None
    pieces = parts[5] if len(parts) == 6 else "p1"
    if not (pieces.startswith("p") and pieces[1:].isdigit()):
        return None
    try:
        put = PutId(int(parts[1], 16), int(parts[2]), int(parts[3]), int(pieces[1:]))
    except ValueError:
        return None
    if put.num_layers <= 0 or put.page_nbytes <= 0 or put.key < 0 or put.pieces <= 0:
        return None
    if put.page_nbytes % put.pieces:
        return None
    return put


def key_text(key: int) -> str:
    """A block key as the fetch protocol carries it."""
    return f"{key:x}"


def parse_key(text: str) -> int | None:
    """The block key in a fetch, or None if malformed."""
    try:
        key = int(text, 16)
    except ValueError:
        return None
    return key if key >= 0 else None


def fetch_request_id(
    base: str, num_layers: int, layers: range | None = None, pieces: int = 1
) -> str:
    """The request id of a fetch of blocks cut into `num_layers` chunks each, of which
    it wants `layers` (all when None), each chunk in `pieces` equal pieces."""
    tail = "" if pieces == 1 else f"p{pieces}"
    if pieces < 1:
        raise ValueError(f"{pieces} pieces")
    if layers is None or (layers.start, layers.stop) == (0, num_layers):
        return f"{base}.L{num_layers}{tail}"
    if not 0 <= layers.start < layers.stop <= num_layers or layers.step != 1:
        raise ValueError(f"layers {layers} of a block of {num_layers}")
    return f"{base}.L{num_layers}x{layers.start}-{layers.stop}{tail}"


def fetch_pieces(request_id: str) -> int | None:
    """Pieces per chunk a fetch asks for (`fetch_request_id`): 1 unless its id says
    more; None when malformed."""
    tail = request_id.rsplit(".", 1)[-1]
    if not tail.startswith("L") or "p" not in tail:
        return 1
    count = tail.rsplit("p", 1)[1]
    return int(count) if count.isdigit() and int(count) > 0 else None


def fetch_layers(request_id: str) -> tuple[int, range] | None:
    """Chunks per block a fetch asks for and which of them it wants: its request id
    ends in `.L<layers>` (all of them) or `.L<layers>x<a>-<b>`; `(1, range(1))` for a
    fetch of whole blocks, None when the ending is malformed."""
    tail = request_id.rsplit(".", 1)[-1]
    if not tail.startswith("L"):
        return 1, range(1)
    tail = tail.split("p", 1)[0]
    count, _, wanted = tail[1:].partition("x")
    if not count.isdigit() or int(count) <= 0:
        return None
    n = int(count)
    if not wanted:
        return n, range(n)
    start, _, stop = wanted.partition("-")
    if not (start.isdigit() and stop.isdigit()) or not 0 <= int(start) < int(stop) <= n:
        return None
    return n, range(int(start), int(stop))
