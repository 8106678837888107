"""Pytest fixtures for every package's tests: real nats-server, real bus.

Loaded as a plugin (`-p yb_shared.testing` in the workspace's pytest settings), like
nats.py's own test helpers: each test gets a fresh nats-server on a free port with a
temporary JetStream store, and a connected `Bus` with the event stream set up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from yb_shared.bus import Bus
from yb_shared.config import NatsConfig, TelemetryConfig
from yb_shared.natsserver import NatsServer
from yb_shared.telemetry import configure_logging


def pytest_configure(config: pytest.Config) -> None:
    """Tests log warnings and worse, as console lines (pytest shows them on failure)."""
    configure_logging("test", "test", TelemetryConfig(log_level="warning", log_json=False))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A running nats-server with JetStream, stopped after the test."""
    server = NatsServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_config(nats_server: NatsServer) -> NatsConfig:
    """Client settings pointing at the test's server, with short test timeouts."""
    return NatsConfig(
        url=nats_server.url,
        request_timeout_s=2.0,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.5,
        duplicate_window_s=60.0,
    )


@pytest.fixture
async def bus(nats_config: NatsConfig) -> AsyncIterator[Bus]:
    """A connected bus with the event stream created."""
    connected = await Bus.connect(nats_config, "test", timeout_s=10)
    await connected.ensure_stream()
    try:
        yield connected
    finally:
        await connected.close()
