"""A kvstore of the pool for tests and benchmarks that drive the data plane directly.

`running_kvstore` starts a real kvstore service (on a real nats-server's bus) and
yields the directory its announcement reached, so a `BlockUploader` or `BlockFetcher`
finds its UCX address as an engine would. `HeldPages` is what an uploader reads the
blocks' pages from (`yb_dataplane.block_upload.HeldBlocks`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from yb_core.bus import Bus
from yb_core.config import KVStoreConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_dataplane.peers import PeerDirectory
from yb_kvstore.service import KVStoreService


class HeldPages:
    """Blocks' pages by key, held for as long as the caller keeps its engine."""

    def __init__(self, pages: dict[int, int]) -> None:
        self.pages = pages

    def page_of(self, key: int) -> int:
        return self.pages[key]

    def release(self, keys: Sequence[int]) -> None:
        del keys


@contextlib.asynccontextmanager
async def running_kvstore(
    bus: Bus, nats: NatsConfig, name: str, dram_blocks: int
) -> AsyncIterator[PeerDirectory]:
    """A kvstore `name` of `dram_blocks` DRAM slots (no SSD) on `nats`, announced in
    the returned directory (read through `bus`); stopped on the way out."""
    service = KVStoreService(
        YbConfig(
            instance_id=name,
            nats=nats,
            kvstore=KVStoreConfig(dram_blocks=dram_blocks, ssd_blocks=0),
            telemetry=TelemetryConfig(log_json=False),
        )
    )
    await service.start()
    peers = PeerDirectory(bus)
    try:
        await peers.open()
        following = asyncio.create_task(peers.run())
        try:
            if await peers.wait_for(name, 30.0) is None:
                raise RuntimeError(f"kvstore {name} did not announce itself within 30s")
            yield peers
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    finally:
        await service.stop()
