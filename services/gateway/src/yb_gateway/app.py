"""The litestar application: routes, access guard, error translation, OpenAPI.

Handlers are thin: they decode the body into its typed struct and hand over to
`CompletionsEndpoint` (or `batch_routes.BatchApi` for files and batches), or answer
from what `GatewayView` shows of the gateway.
Bodies are decoded here with msgspec in strict mode rather than through litestar's
`data` parameter, whose conversion is lax (`"10"` would pass as an int) and whose
errors do not have OpenAI's shape; the OpenAPI document still shows the request
schemas (`_operation_with_body`).

Who may call what is `auth.AccessPolicy`: health probes are public, `/metrics` needs
the metrics token, everything else (the OpenAI routes, the OpenAPI document, and any
route added later unless marked) an API key. The document declares the schemes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import (
    Example,
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from yb_core.config import YbConfig
from yb_core.telemetry import render_metrics
from yb_gateway import __version__
from yb_gateway.auth import (
    OPERATOR,
    OPERATOR_SECURITY,
    PUBLIC,
    SECURITY_COMPONENTS,
    AccessPolicy,
)
from yb_gateway.batch_routes import BatchApi, batch_handlers
from yb_gateway.completions import CompletionsEndpoint
from yb_gateway.errors import (
    ApiError,
    handle_api_error,
    handle_unexpected,
    make_http_exception_handler,
)
from yb_gateway.prompt import PromptEncoder
from yb_gateway.runner import decode_body
from yb_gateway.schemas import (
    REFUSED_FIELDS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)

_ERRORS = {
    400: ResponseSpec(ErrorBody, description="Malformed body, bad field, or a limit exceeded"),
    401: ResponseSpec(ErrorBody, description="Missing or wrong API key"),
    404: ResponseSpec(ErrorBody, description="Unknown model"),
    413: ResponseSpec(ErrorBody, description="Body larger than max_body_bytes"),
    429: ResponseSpec(ErrorBody, description="Rejected by the conductor; see Retry-After"),
    503: ResponseSpec(ErrorBody, description="Bus, scheduler or engines unavailable"),
    504: ResponseSpec(ErrorBody, description="The engines did not answer within the deadline"),
}

# A streamed completion answers 200 with server-sent events instead of one JSON body.
# The schema is one parsed event's (as OpenAPI 3.2's `itemSchema`, which tools read
# from `schema` on 3.1): `data` is a chunk's JSON, or `[DONE]` last; an `error` event
# carries an OpenAI error object.
_SSE = OpenAPIMediaType(
    schema=Schema(
        type=OpenAPIType.OBJECT,
        required=["data"],
        properties={
            "data": Schema(
                type=OpenAPIType.STRING,
                description="a completion chunk as JSON, an error object, or `[DONE]`",
            ),
            "event": Schema(type=OpenAPIType.STRING, enum=["message", "error"]),
        },
    )
)


def _inline_schema(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """msgspec's JSON schema of `kind` with its `$defs` inlined.

    litestar rebuilds `components.schemas` from its own registry, so references to
    definitions of ours would dangle; the request structs are not recursive, so
    inlining is exact.
    """
    schema = msgspec.json.schema(kind)
    defs: dict[str, Any] = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    for key, rule in REFUSED_FIELDS.get(kind, {}).items():
        for field in _fields_at(resolved, key.split(".")):
            field["description"] = f"Not implemented by this server: accepts only {rule.accepts}."
    return resolved


def _fields_at(node: Any, names: list[str]) -> Iterator[dict[str, Any]]:
    """The schemas of the fields at the dotted path `names`, through arrays and unions."""
    if not isinstance(node, dict):
        return
    if not names:
        yield node
        return
    properties = node.get("properties", {})
    if names[0] in properties:
        yield from _fields_at(properties[names[0]], names[1:])
    for inner in [node.get("items"), *node.get("anyOf", [])]:
        yield from _fields_at(inner, names)


def _operation_with_body(kind: type[msgspec.Struct], example: dict[str, Any]) -> type[Operation]:
    """An OpenAPI operation class that documents `kind` as the JSON request body, with
    a working `example` (for the served model), and a 200 that may also be SSE."""
    body = RequestBody(
        content={
            "application/json": OpenAPIMediaType(
                schema=_inline_schema(kind),  # type: ignore[arg-type]
                examples={"served model": Example(value=example)},
            )
        },
        required=True,
    )

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = body
            ok = (self.responses or {}).get("200")
            content = getattr(ok, "content", None)
            if content is not None:
                content["text/event-stream"] = _SSE

    return WithBody


class GatewayView(Protocol):
    """What the HTTP application reads of its gateway, each time a route asks."""

    @property
    def started_at(self) -> int:
        """When the gateway started (Unix seconds): the model card's `created`."""
        ...

    @property
    def encoder(self) -> PromptEncoder | None:
        """The tokenizer (its vocabulary is on the model card); None until loaded."""
        ...

    @property
    def registry(self) -> CollectorRegistry:
        """The collectors `/metrics` exposes."""
        ...

    @property
    def completions(self) -> CompletionsEndpoint:
        """The two generation endpoints."""
        ...

    @property
    def batches(self) -> BatchApi:
        """The Batch API (`/v1/files`, `/v1/batches`)."""
        ...

    def readiness(self) -> dict[str, Any]:
        """What `/readyz` reports: `ready`, and what is missing when not."""
        ...


def create_app(cfg: YbConfig, gw: GatewayView) -> Litestar:
    """The HTTP application of one gateway.

    Raises `ConfigError` when the gateway has no API key and an open API was not
    asked for (`gateway.allow_unauthenticated`): the process must not start open.
    """
    policy = AccessPolicy.from_config(cfg)
    api_security = policy.api_security()

    @get("/healthz", opt=PUBLIC, tags=["probes"])
    async def healthz() -> dict[str, str]:
        """200 for as long as the process lives."""
        return {"status": "ok"}

    @get(
        "/readyz",
        opt=PUBLIC,
        tags=["probes"],
        responses={
            503: ResponseSpec(
                dict[str, Any], description="Not ready: the report says what is missing"
            )
        },
    )
    async def readyz() -> Response[dict[str, Any]]:
        """200 once requests can be served; 503 with what is missing otherwise."""
        report = gw.readiness()
        status = HTTP_200_OK if report["ready"] else HTTP_503_SERVICE_UNAVAILABLE
        return Response(report, status_code=status)

    @get(
        "/metrics",
        opt=OPERATOR,
        security=OPERATOR_SECURITY,
        tags=["probes"],
        responses={401: ResponseSpec(ErrorBody, description="Missing or wrong metrics token")},
    )
    async def metrics() -> Response[bytes]:
        """Prometheus text exposition of the gateway's registry (needs the metrics token)."""
        return Response(render_metrics(gw.registry), media_type=CONTENT_TYPE_LATEST)

    @get("/v1/models", tags=["openai"], security=api_security, responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        """The one model this gateway serves."""
        return ModelList(
            data=[
                ModelCard(
                    id=cfg.model.name,
                    created=gw.started_at,
                    max_model_len=cfg.model.max_model_len,
                    vocab_size=gw.encoder.vocab_size if gw.encoder is not None else 0,
                )
            ]
        )

    @post(
        "/v1/chat/completions",
        status_code=HTTP_200_OK,
        tags=["openai"],
        operation_class=_operation_with_body(
            ChatCompletionRequest,
            {
                "model": cfg.model.name,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
            },
        ),
        responses=_ERRORS,
        security=api_security,
    )
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[ChatCompletion]:
        """Chat completion; `stream: true` answers with server-sent events."""
        body = decode_body(await request.body(), ChatCompletionRequest)
        return await gw.completions.chat(request, body)

    @post(
        "/v1/completions",
        status_code=HTTP_200_OK,
        tags=["openai"],
        operation_class=_operation_with_body(
            CompletionRequest,
            {"model": cfg.model.name, "prompt": "The capital of France is", "max_tokens": 8},
        ),
        responses=_ERRORS,
        security=api_security,
    )
    async def completions(request: Request[Any, Any, Any]) -> Response[Completion]:
        """Text completion of a string or token-id prompt; `stream: true` for SSE."""
        body = decode_body(await request.body(), CompletionRequest)
        return await gw.completions.complete(request, body)

    return Litestar(
        route_handlers=[
            healthz,
            readyz,
            metrics,
            models,
            chat_completions,
            completions,
            *batch_handlers(gw, cfg, api_security),
        ],
        guards=[policy.guard],
        exception_handlers={
            ApiError: handle_api_error,
            HTTPException: make_http_exception_handler(cfg.gateway.max_body_bytes),
            Exception: handle_unexpected,
        },
        request_max_body_size=cfg.gateway.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="Yuebing gateway",
            version=__version__,
            description="OpenAI-compatible front door of a Yuebing cluster.",
            path="/schema",
            components=SECURITY_COMPONENTS,
        ),
        # Logging is structlog's (configured by the service); litestar must not
        # reconfigure the stdlib root logger.
        logging_config=None,
        debug=False,
    )
