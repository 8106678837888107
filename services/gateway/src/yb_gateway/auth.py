"""Who may call which route of the gateway.

Every route has an access level, set with `opt` on its handler:

- `public`: the health probes (`/healthz`, `/readyz`), which load balancers and
  orchestrators call without credentials. They reveal liveness and what is missing
  for readiness, nothing about requests.
- `api` (the default, so a new route is protected unless marked otherwise): the
  OpenAI API and its OpenAPI document. One of the API keys, sent as
  `Authorization: Bearer <key>` (what OpenAI clients send) or `x-api-key: <key>`.
- `operator`: `/metrics` and any admin route. The metrics token
  (`telemetry.metrics_token`), deliberately not an API key: a client's key must not
  read operational data of the whole cluster. With no token configured these routes
  are closed.

A gateway without API keys does not start unless `gateway.allow_unauthenticated`
says an open API is intended. Keys are compared in constant time. Failures answer
401 in OpenAI's error format with `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.spec import Components, SecurityRequirement, SecurityScheme
from litestar.status_codes import HTTP_401_UNAUTHORIZED

from yb_core.auth import bearer_token, matches_any
from yb_core.config import ConfigError, YbConfig
from yb_gateway.errors import INVALID_REQUEST, ApiError

Access = Literal["public", "api", "operator"]

PUBLIC: Final[dict[str, Any]] = {"access": "public"}
OPERATOR: Final[dict[str, Any]] = {"access": "operator"}

_API_BEARER = "ApiKeyBearer"
_API_HEADER = "ApiKeyHeader"
_METRICS_BEARER = "MetricsToken"

#: The OpenAPI security schemes the document declares (components.securitySchemes).
SECURITY_COMPONENTS: Final = Components(
    security_schemes={
        _API_BEARER: SecurityScheme(
            type="http",
            scheme="bearer",
            description="One of the gateway's API keys (`gateway.api_keys`, "
            "`gateway.api_keys_file`; `yb up` writes one to <data dir>/secrets/api_key).",
        ),
        _API_HEADER: SecurityScheme(
            type="apiKey",
            name="x-api-key",
            security_scheme_in="header",
            description="The same API key, in the `x-api-key` header instead.",
        ),
        _METRICS_BEARER: SecurityScheme(
            type="http",
            scheme="bearer",
            description="The metrics/admin token (`telemetry.metrics_token`), not an API key.",
        ),
    }
)
#: Either spelling of an API key.
API_SECURITY: Final[list[SecurityRequirement]] = [{_API_BEARER: []}, {_API_HEADER: []}]
OPERATOR_SECURITY: Final[list[SecurityRequirement]] = [{_METRICS_BEARER: []}]


def _unauthorized(message: str, *, code: str, kind: str = INVALID_REQUEST) -> ApiError:
    return ApiError(
        HTTP_401_UNAUTHORIZED,
        message,
        type=kind,
        code=code,
        headers={"WWW-Authenticate": "Bearer"},
    )


def missing_api_key() -> ApiError:
    """401: the request carries no API key at all."""
    return _unauthorized(
        "You didn't provide an API key. Send it as `Authorization: Bearer <key>` "
        "(or `x-api-key: <key>`).",
        code="invalid_api_key",
    )


def wrong_api_key() -> ApiError:
    """401: the request carries a key that is not one of the gateway's."""
    return _unauthorized("Incorrect API key provided.", code="invalid_api_key")


def operator_token_required(configured: bool) -> ApiError:
    """401: an operator route (metrics, admin) without the metrics token."""
    if configured:
        message = "This route needs the metrics token: `Authorization: Bearer <token>`."
    else:
        message = (
            "This route is closed: no metrics token is configured "
            "(set telemetry.metrics_token or telemetry.metrics_token_file)."
        )
    return _unauthorized(message, code="invalid_metrics_token", kind="authentication_error")


def presented_api_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The key a request presents: a Bearer token, else the `x-api-key` header."""
    token = bearer_token(connection.headers.get("authorization", ""))
    return token or connection.headers.get("x-api-key", "").strip()


class AccessPolicy:
    """The gateway's credentials and the litestar guard that enforces them."""

    def __init__(self, api_keys: list[str], operator_token: str, *, open_api: bool) -> None:
        self._api_keys = [k.encode() for k in api_keys]
        self._operator = [operator_token.encode()] if operator_token else []
        self.open_api = open_api and not api_keys

    @classmethod
    def from_config(cls, cfg: YbConfig) -> AccessPolicy:
        """The policy of a gateway's configuration; `ConfigError` if it has no API key
        and an open API was not asked for."""
        keys = cfg.gateway.resolved_api_keys()
        if not keys and not cfg.gateway.allow_unauthenticated:
            raise ConfigError(
                "gateway: no API key configured, refusing to serve an open API. Set "
                "gateway.api_keys (YB_GATEWAY__API_KEYS=key1,key2) or "
                "gateway.api_keys_file, or set gateway.allow_unauthenticated=true "
                "(YB_GATEWAY__ALLOW_UNAUTHENTICATED=true) if that is intended."
            )
        return cls(keys, cfg.telemetry.resolved_metrics_token(), open_api=not keys)

    def api_security(self) -> list[SecurityRequirement] | None:
        """What the OpenAPI document declares for `api` routes (None when open)."""
        return None if self.open_api else API_SECURITY

    async def guard(
        self, connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
    ) -> None:
        """Raise 401 unless the request may call `handler`.

        A coroutine although it never waits: litestar runs a plain function guard in
        a worker thread, a thread hop on every request for a check of microseconds."""
        access: Access = handler.opt.get("access", "api")
        if access == "public":
            return
        if access == "operator":
            token = bearer_token(connection.headers.get("authorization", ""))
            if not matches_any(token, self._operator):
                raise operator_token_required(bool(self._operator))
            return
        if self.open_api:
            return
        presented = presented_api_key(connection)
        if not presented:
            raise missing_api_key()
        if not matches_any(presented, self._api_keys):
            raise wrong_api_key()
