"""Fixtures the transport tests share: a started receiver and a sender, closed after."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from yb_dataplane.transport import KVReceiver, KVSender


@pytest.fixture
async def receiver() -> AsyncIterator[KVReceiver]:
    rx = KVReceiver()
    await rx.start()
    try:
        yield rx
    finally:
        await rx.close()


@pytest.fixture
async def sender() -> AsyncIterator[KVSender]:
    tx = KVSender()
    try:
        yield tx
    finally:
        await tx.close()
