"""schemathesis against the gateway's own OpenAPI document: no 5xx, errors as documented.

The gateway runs for real (real HTTP, real NATS) with the test kit's conductor and
engine as peers, and schemathesis (its CLI, in a subprocess, so the gateway keeps its
event loop) generates valid and invalid requests for every documented operation. Its
checks: never a server error, status codes and content types the document declares,
and response bodies that match their declared schemas — for errors that is the
OpenAI error object (`ErrorBody`), so every refusal is in the OpenAI format.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from gateway_testkit import API_KEY, Cluster, client_for

from yb_gateway.service import GatewayService

# The checks this test stands for (see the module docstring), and
# `negative_data_rejection`: a body the schema does not allow (an unknown field among
# them, as the request schemas forbid additional properties) is refused.
# `positive_data_acceptance` is left out: semantic limits (`max_tokens` against the
# context length) refuse requests that are valid by the schema alone.
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)


def _schemathesis() -> str:
    beside = Path(sys.executable).parent / "schemathesis"
    found = str(beside) if beside.exists() else shutil.which("schemathesis")
    if not found:
        pytest.skip("schemathesis is not installed (requirements-dev.txt has it)")
    return found


async def _run_schemathesis(gateway: GatewayService, tmp_path: Path, *headers: str) -> str:
    """Run schemathesis over the OpenAI routes; its output (it must find nothing)."""
    base = f"http://127.0.0.1:{gateway.cfg.gateway.port}"
    # The document itself needs a key; schemathesis reads it from a file, so the same
    # document drives a run with a wrong key too.
    async with client_for(gateway) as http:
        spec = await http.get("/schema/openapi.json")
    assert spec.status_code == 200, spec.text
    spec_path = tmp_path / "openapi.json"
    spec_path.write_bytes(spec.content)
    args = [
        _schemathesis(),
        "run",
        str(spec_path),
        "--url",
        base,
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "40",
        "--seed",
        "20261122",
        # One worker: with two, a run failed inside schemathesis's own example
        # generation with CPython's "AST constructor recursion depth mismatch", an
        # error of `compile` that concurrent threads are the likely trigger of.
        "--workers",
        "1",
        "--request-timeout",
        "20",
        "--generation-database",
        "none",
        "--no-color",
        # The probes take no input and answer 503 by design while engines are missing
        # (tested on their own); /metrics takes the operator token, not an API key.
        "--exclude-path",
        "/readyz",
        "--exclude-path",
        "/healthz",
        "--exclude-path",
        "/metrics",
    ]
    for header in headers:
        args += ["--header", header]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    process = await asyncio.create_subprocess_exec(
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    text = output.decode(errors="replace")
    assert process.returncode == 0, f"schemathesis found failures:\n{text[-12000:]}"
    return text


@pytest.mark.timeout(300)
async def test_schemathesis_finds_no_server_error_and_only_documented_errors(
    gateway: GatewayService, cluster: Cluster, tmp_path: Path
) -> None:
    del cluster  # the peers must run: valid requests then really complete
    async with client_for(gateway) as http:
        spec = (await http.get("/schema/openapi.json")).json()
    operations = [(path, method) for path, item in spec["paths"].items() for method in item]
    assert ("/v1/chat/completions", "post") in operations
    assert ("/v1/completions", "post") in operations

    output = await _run_schemathesis(gateway, tmp_path, f"Authorization: Bearer {API_KEY}")
    # It really exercised the API with the key (a run that reached nothing, or only
    # 401s, would also exit 0).
    tested = re.search(r"Tested:\s*(\d+)", output)
    assert tested and int(tested.group(1)) == 3, output[-3000:]
    assert "Authentication failed" not in output, output[-3000:]
    await _still_serves(gateway)


@pytest.mark.timeout(300)
async def test_schemathesis_without_a_key_gets_documented_401s(
    gateway: GatewayService, tmp_path: Path
) -> None:
    # A wrong key: every protected operation must answer 401 in the documented error
    # format, never a 5xx.
    output = await _run_schemathesis(gateway, tmp_path, "Authorization: Bearer wrong-key")
    assert "Authentication failed: 3 operations returned only 401" in output, output[-3000:]
    await _still_serves(gateway)


async def _still_serves(gateway: GatewayService) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.cfg.gateway.port}") as http:
        assert (await http.get("/healthz")).status_code == 200
