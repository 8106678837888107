"""Who may call what: API keys on every /v1 route, the metrics token on /metrics,
health probes open, and no gateway that starts open by accident.

Real gateways on real sockets against a real nats-server; the routes checked are
read from the application itself, so a /v1 route added later is covered too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testkit import (
    API_KEY,
    METRICS_AUTH,
    MODEL,
    Cluster,
    GatewayFactory,
    client_for,
    make_config,
)

from yb_core.config import ConfigError, NatsConfig, TelemetryConfig
from yb_gateway.app import create_app
from yb_gateway.service import GatewayService
from yb_tools.natsserver import env_without_proxies, free_port

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
# A valid body for each POST route, so "the right key" must mean 200, not 400.
BODIES: dict[str, dict[str, Any]] = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


def unauthorized(response: httpx.Response, code: str = "invalid_api_key") -> dict[str, Any]:
    """The OpenAI error object of a 401, after checking its shape and challenge."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["type"] in ("invalid_request_error", "authentication_error")
    assert error["param"] is None
    assert error["message"]
    return error


def v1_routes(gw: GatewayService) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route the gateway's application serves."""
    routes = []
    for route in create_app(gw.cfg, gw).routes:
        if route.path.startswith("/v1"):
            for method in sorted(getattr(route, "methods", ())):
                if method not in ("HEAD", "OPTIONS"):
                    routes.append((method, route.path))
    return routes


def opened(response: httpx.Response, method: str, path: str) -> None:
    """The right key opened the route: 200 where the call is a valid one (a body from
    BODIES, or a GET without path parameters); elsewhere (an upload, an id in the
    path: `{file_id:str}` names no file) the route's own answer, never a 401."""
    if path in BODIES or (method == "GET" and "{" not in path):
        assert response.status_code == 200, (method, path, response.text)
    else:
        assert response.status_code in (200, 400, 404), (method, path, response.text)
        assert response.status_code == 200 or set(response.json()) == {"error"}


async def call(client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
    body = BODIES.get(path)
    return await client.request(method, path, json=body if method == "POST" else None, **kw)


async def test_every_v1_route_needs_a_right_key(gateway: GatewayService, cluster: Cluster) -> None:
    routes = v1_routes(gateway)
    assert ("GET", "/v1/models") in routes and ("POST", "/v1/chat/completions") in routes
    async with client_for(gateway, key=None) as anonymous:
        for method, path in routes:
            error = unauthorized(await call(anonymous, method, path))
            assert "didn't provide" in error["message"], (method, path)
            for wrong in ({"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
                error = unauthorized(await call(anonymous, method, path, headers=wrong))
                assert error["message"] == "Incorrect API key provided.", (method, path)
            # A right key in the wrong scheme is still no key.
            basic = {"Authorization": f"Basic {API_KEY}"}
            unauthorized(await call(anonymous, method, path, headers=basic))
            # A prefix or an extension of the key is not the key.
            for near in (API_KEY[:-1], API_KEY + "x"):
                bearer = {"Authorization": f"Bearer {near}"}
                unauthorized(await call(anonymous, method, path, headers=bearer))
    async with client_for(gateway) as bearer:
        for method, path in routes:
            opened(await call(bearer, method, path), method, path)
    async with client_for(gateway, key=None, headers={"x-api-key": API_KEY}) as header:
        for method, path in routes:
            opened(await call(header, method, path), method, path)
    async with client_for(gateway, key=None, headers={"authorization": f"bearer {API_KEY}"}) as lc:
        assert (await lc.get("/v1/models")).status_code == 200


async def test_health_and_readiness_are_open(gateway: GatewayService) -> None:
    async with client_for(gateway, key=None) as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        # Open, and honest: no engine is up in this test, so not ready.
        ready = await anonymous.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False


async def test_metrics_need_the_metrics_token_not_an_api_key(gateway: GatewayService) -> None:
    async with client_for(gateway, key=None) as anonymous:
        unauthorized(await anonymous.get("/metrics"), "invalid_metrics_token")
        ok = await anonymous.get("/metrics", headers=METRICS_AUTH)
        assert ok.status_code == 200 and "yb_gateway_requests_total" in ok.text
    async with client_for(gateway) as api_client:  # an API key opens the API, not metrics
        error = unauthorized(await api_client.get("/metrics"), "invalid_metrics_token")
        assert error["type"] == "authentication_error"


async def test_metrics_are_closed_without_a_token(gateway_factory: GatewayFactory) -> None:
    gw = await gateway_factory(telemetry=TelemetryConfig(), wait_bus=False)
    async with client_for(gw) as client:
        error = unauthorized(await client.get("/metrics"), "invalid_metrics_token")
        assert "no metrics token is configured" in error["message"]
        # An empty token must not match the empty "configured" token.
        empty = {"Authorization": "Bearer"}
        unauthorized(await client.get("/metrics", headers=empty), "invalid_metrics_token")


async def test_openapi_document_needs_a_key_and_declares_the_schemes(
    gateway: GatewayService,
) -> None:
    async with client_for(gateway, key=None) as anonymous:
        unauthorized(await anonymous.get("/schema/openapi.json"))
    async with client_for(gateway) as client:
        doc = (await client.get("/schema/openapi.json")).json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["ApiKeyBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["ApiKeyBearer"]["description"],
    }
    assert schemes["ApiKeyHeader"]["in"] == "header"
    assert schemes["ApiKeyHeader"]["name"] == "x-api-key"
    paths = doc["paths"]
    either_key = [{"ApiKeyBearer": []}, {"ApiKeyHeader": []}]
    assert paths["/v1/models"]["get"]["security"] == either_key
    assert paths["/v1/chat/completions"]["post"]["security"] == either_key
    assert paths["/v1/completions"]["post"]["security"] == either_key
    assert paths["/metrics"]["get"]["security"] == [{"MetricsToken": []}]
    assert "security" not in paths["/healthz"]["get"]
    assert "security" not in paths["/readyz"]["get"]
    assert "401" in paths["/v1/chat/completions"]["post"]["responses"]


async def test_keys_from_a_file(
    gateway_factory: GatewayFactory, cluster: Cluster, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\nfile-key-1\n\n  file-key-2  # rotated in\n")
    gw = await gateway_factory(api_keys=[], api_keys_file=str(keys))
    for key in ("file-key-1", "file-key-2"):
        async with client_for(gw, key=key) as client:
            assert (await client.get("/v1/models")).status_code == 200
    async with client_for(gw) as client:  # the testkit's key is not configured here
        unauthorized(await client.get("/v1/models"))
    async with client_for(gw, key="# one key per line") as client:
        unauthorized(await client.get("/v1/models"))


async def test_an_open_api_must_be_asked_for(
    gateway_factory: GatewayFactory, nats_config: NatsConfig
) -> None:
    keyless = GatewayService(make_config(nats_config, api_keys=[]))
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        create_app(keyless.cfg, keyless)
    gw = await gateway_factory(api_keys=[], allow_unauthenticated=True, wait_bus=False)
    async with client_for(gw, key=None) as anonymous:
        assert (await anonymous.get("/v1/models")).status_code == 200
        # Opening the API does not open the operator routes.
        unauthorized(await anonymous.get("/metrics"), "invalid_metrics_token")
        doc = (await anonymous.get("/schema/openapi.json")).json()
    assert "security" not in doc["paths"]["/v1/models"]["get"]


def test_gateway_process_without_keys_refuses_to_start(tmp_path: Path) -> None:
    # The real entry point, as `yb up` or a container runs it: it must exit with a
    # message saying what to set, not serve an open API.
    env = env_without_proxies()
    for name in list(env):
        if name.startswith("YB_"):
            del env[name]
    env.update(
        {
            "YB_GATEWAY__PORT": str(free_port()),
            "YB_NATS__URL": f"nats://127.0.0.1:{free_port()}",
            "YB_MODEL__SOURCE": "tiny-random",
            "YB_TELEMETRY__LOG_JSON": "false",
        }
    )
    proc = subprocess.run(
        [sys.executable, "-m", "yb_gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "no API key configured" in output, output[-3000:]
    assert "YB_GATEWAY__API_KEYS" in output
