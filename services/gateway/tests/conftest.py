"""Fixtures for the gateway's tests: a real gateway on a real bus, with real peers."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_testkit import (
    Cluster,
    Conductor,
    Engine,
    GatewayFactory,
    client_for,
    make_config,
    start_gateway,
)

from yb_core.bus import Bus
from yb_core.config import NatsConfig, TelemetryConfig
from yb_core.telemetry import configure_tracing
from yb_gateway.service import GatewayService


@pytest.fixture(autouse=True, scope="session")
def _tracing() -> None:
    """A real tracer provider, as `run_service` installs: with no exporter configured,
    spans record nothing, but their context still travels in the job's `trace_headers`."""
    configure_tracing("gateway-test", "test", TelemetryConfig())


@pytest.fixture
async def gateway_factory(nats_config: NatsConfig) -> AsyncIterator[GatewayFactory]:
    """Start gateways with extra `GatewayConfig` settings; all are stopped at the end."""
    started: list[GatewayService] = []

    async def make(
        *, wait_bus: bool = True, nats: NatsConfig | None = None, **settings: Any
    ) -> GatewayService:
        cfg = make_config(nats or nats_config, **settings)
        gw: GatewayService = await start_gateway(cfg, wait_bus=wait_bus)
        started.append(gw)
        return gw

    try:
        yield make
    finally:
        for gw in started:
            await gw.stop()


@pytest.fixture
async def gateway(gateway_factory: GatewayFactory) -> GatewayService:
    """A started gateway with the test settings."""
    gw: GatewayService = await gateway_factory()
    return gw


@pytest.fixture
async def client(gateway: GatewayService) -> AsyncIterator[httpx.AsyncClient]:
    """HTTP client of the `gateway` fixture."""
    async with client_for(gateway) as http:
        yield http


@pytest.fixture
async def cluster(bus: Bus) -> AsyncIterator[Cluster]:
    """A conductor that schedules everything and an engine that answers with WORDS."""
    conductor = Conductor(bus)
    engine = Engine(bus)
    await conductor.start()
    await engine.start()
    try:
        yield Cluster(conductor, engine)
    finally:
        await engine.stop()
        await conductor.stop()
