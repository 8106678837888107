"""The few calls of the Docker Engine API the actuator makes, over its unix socket.

Typed at the boundary: the list and inspect answers decode into the structs below
(only the fields the actuator reads; `Config` keeps what a clone copies, `HostConfig`
stays as Docker wrote it, since a clone passes it back whole). Every call has a
deadline, and every failure is a `DockerError` that says which call, what Docker
answered (its status and `message`) or why there was no answer.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

#: Where the Docker daemon listens (mounted into the actuator's container).
DEFAULT_SOCKET = "/var/run/docker.sock"
#: How long one ordinary call may take (list, inspect, create, start, remove).
CALL_TIMEOUT_S = 30.0
#: What a stop may take beyond the grace it gives the container: Docker answers only
#: once the container has exited (killed at the end of the grace).
STOP_MARGIN_S = 30.0


class DockerError(RuntimeError):
    """A Docker API call that failed: `operation` (e.g. "create container ybsmoke-
    prefill-2"), Docker's HTTP `status` (None: no answer at all) and its message."""

    def __init__(self, operation: str, status: int | None, message: str) -> None:
        self.operation = operation
        self.status = status
        self.message = message
        answered = f"Docker answered {status}" if status is not None else "no answer from Docker"
        super().__init__(f"{operation}: {answered}: {message}")


class HealthState(msgspec.Struct, rename="pascal", frozen=True):
    status: str = ""


class ContainerState(msgspec.Struct, rename="pascal", frozen=True):
    """`State` of an inspected container."""

    status: str = ""  # created, running, restarting, exited, ...
    running: bool = False
    restarting: bool = False
    exit_code: int = 0
    health: HealthState | None = None

    @property
    def health_status(self) -> str:
        """healthy, unhealthy, starting, or "" without a health check."""
        return self.health.status if self.health is not None else ""


class ContainerConfig(msgspec.Struct, rename="pascal", omit_defaults=True):
    """The part of a container's `Config` a clone keeps: also the body of a create
    request (with `HostConfig` and `NetworkingConfig` beside it)."""

    image: str
    hostname: str = ""
    domainname: str = ""
    user: str = ""
    env: list[str] = msgspec.field(default_factory=list)
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    working_dir: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    healthcheck: dict[str, Any] | None = None
    exposed_ports: dict[str, Any] | None = None
    stop_signal: str = ""
    stop_timeout: int | None = None
    tty: bool = False
    open_stdin: bool = False


class EndpointSettings(msgspec.Struct, rename="pascal", frozen=True):
    """One network of an inspected container."""

    network_id: str = msgspec.field(default="", name="NetworkID")
    aliases: list[str] | None = None


class NetworkSettings(msgspec.Struct, rename="pascal", frozen=True):
    networks: dict[str, EndpointSettings] = msgspec.field(default_factory=dict)


class ContainerInspect(msgspec.Struct, rename="pascal", frozen=True):
    """`GET /containers/{id}/json`, the fields the actuator reads."""

    id: str
    name: str
    config: ContainerConfig
    host_config: dict[str, Any]
    state: ContainerState
    network_settings: NetworkSettings = NetworkSettings()

    @property
    def labels(self) -> dict[str, str]:
        return self.config.labels


class ContainerSummary(msgspec.Struct, rename="pascal", frozen=True):
    """One row of `GET /containers/json`."""

    id: str
    names: list[str] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    state: str = ""


class CreateRequest(msgspec.Struct, frozen=True):
    """A container to create: its name, its spec, and the networks it joins (the first
    at creation, with the spec, the others connected before it starts: an API before
    1.44 takes one network at creation)."""

    name: str
    config: ContainerConfig
    host_config: dict[str, Any]
    networks: list[tuple[str, list[str]]]  # network name -> aliases on it

    def body(self) -> dict[str, Any]:
        """The JSON body of `POST /containers/create`."""
        body: dict[str, Any] = msgspec.to_builtins(self.config)
        body["HostConfig"] = self.host_config
        if self.networks:
            network, aliases = self.networks[0]
            body["NetworkingConfig"] = {"EndpointsConfig": {network: {"Aliases": aliases}}}
        return body


_SUMMARIES = msgspec.json.Decoder(list[ContainerSummary])
_INSPECT = msgspec.json.Decoder(ContainerInspect)


def error_message(response: httpx.Response) -> str:
    """Docker's own words for a failed call (`{"message": ...}`), else the body."""
    try:
        answer = json.loads(response.content)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("message"), str):
        return str(answer["message"])
    return response.text.strip()[:500] or response.reason_phrase


class DockerApi:
    """An async client of the Docker Engine API on `socket` (or on `transport`, for
    tests that replay recorded answers). Close it with `aclose()`."""

    def __init__(
        self,
        socket: str = DEFAULT_SOCKET,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self._http = httpx.AsyncClient(
            transport=transport or httpx.AsyncHTTPTransport(uds=socket),
            base_url="http://docker",
            timeout=timeout_s,
        )
        self.socket = socket

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200, 201, 204),
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        try:
            response = await self._http.request(
                method,
                path,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
                **kwargs,
            )
        except httpx.TimeoutException as exc:
            raise DockerError(operation, None, f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise DockerError(operation, None, f"{exc!r} (socket {self.socket})") from exc
        if response.status_code not in ok:
            raise DockerError(operation, response.status_code, error_message(response))
        return response

    async def version(self) -> str:
        """The daemon's API version (a first call that says whether it answers)."""
        response = await self._call("ask Docker its version", "GET", "/version")
        return str(response.json().get("ApiVersion", "?"))

    async def containers(self, labels: dict[str, str]) -> list[ContainerSummary]:
        """Every container (running or not) that has all of `labels`."""
        filters = json.dumps({"label": [f"{k}={v}" for k, v in labels.items()]})
        response = await self._call(
            f"list containers {labels}",
            "GET",
            "/containers/json",
            params={"all": "true", "filters": filters},
        )
        return _SUMMARIES.decode(response.content)

    async def inspect(self, container: str) -> ContainerInspect:
        response = await self._call(
            f"inspect container {container}", "GET", f"/containers/{quote(container)}/json"
        )
        return _INSPECT.decode(response.content)

    async def create(self, request: CreateRequest) -> str:
        """Create the container (and join its other networks); its id. Not started."""
        response = await self._call(
            f"create container {request.name}",
            "POST",
            "/containers/create",
            params={"name": request.name},
            json=request.body(),
        )
        container_id = str(response.json()["Id"])
        for network, aliases in request.networks[1:]:
            await self._call(
                f"connect container {request.name} to network {network}",
                "POST",
                f"/networks/{quote(network)}/connect",
                json={"Container": container_id, "EndpointConfig": {"Aliases": aliases}},
            )
        return container_id

    async def start(self, container: str) -> None:
        await self._call(
            f"start container {container}",
            "POST",
            f"/containers/{quote(container)}/start",
            ok=(204, 304),
        )

    async def stop(self, container: str, grace_s: int) -> None:
        """SIGTERM (the container's stop signal), SIGKILL after `grace_s`; returns once
        the container has exited (at most `grace_s` + STOP_MARGIN_S)."""
        await self._call(
            f"stop container {container}",
            "POST",
            f"/containers/{quote(container)}/stop",
            params={"t": str(grace_s)},
            ok=(204, 304),
            timeout_s=grace_s + STOP_MARGIN_S,
        )

    async def remove(self, container: str) -> None:
        await self._call(
            f"remove container {container}", "DELETE", f"/containers/{quote(container)}"
        )
