"""Every failure leaves the gateway as an OpenAI error body: `{"error": {...}}`.

Code that finds a problem raises `ApiError` (or one of its constructors below) with
the status and the OpenAI `type`/`code`; litestar's own exceptions (unknown route,
body too large, wrong method) and anything unexpected are translated by the handlers
registered in `exception_handlers`, so a client never sees litestar's default body.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.status_codes import (
    HTTP_400_BAD_REQUEST,
    HTTP_401_UNAUTHORIZED,
    HTTP_404_NOT_FOUND,
    HTTP_413_REQUEST_ENTITY_TOO_LARGE,
    HTTP_429_TOO_MANY_REQUESTS,
    HTTP_500_INTERNAL_SERVER_ERROR,
    HTTP_503_SERVICE_UNAVAILABLE,
)

from yb_core.telemetry import get_logger
from yb_gateway.schemas import ErrorBody, ErrorDetail, Refused

log = get_logger(__name__)

INVALID_REQUEST = "invalid_request_error"

_json = msgspec.json.Encoder()


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        """The OpenAI error object."""
        return ErrorBody(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )

    def to_response(self) -> Response[bytes]:
        """The HTTP response carrying this error."""
        return Response(
            _json.encode(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request cannot be served as sent."""
    return ApiError(HTTP_400_BAD_REQUEST, message, param=param, code=code)


def model_not_found(model: str, served: str) -> ApiError:
    """404: the request names a model this gateway does not serve."""
    return ApiError(
        HTTP_404_NOT_FOUND,
        f"The model `{model}` does not exist; this server serves `{served}`.",
        param="model",
        code="model_not_found",
    )


def unavailable(message: str, *, code: str) -> ApiError:
    """503: the cluster cannot take the request now (bus down, no decision, no engine)."""
    return ApiError(
        HTTP_503_SERVICE_UNAVAILABLE, message, type="service_unavailable_error", code=code
    )


def rejected(reason: str, retry_after_s: float) -> ApiError:
    """429: the conductor turned the request away; the client may retry later."""
    retry_after = max(1, math.ceil(retry_after_s))
    return ApiError(
        HTTP_429_TOO_MANY_REQUESTS,
        f"The cluster is overloaded and rejected the request: {reason}",
        type="rate_limit_error",
        code="request_rejected",
        headers={"Retry-After": str(retry_after)},
    )


def from_decode_error(
    exc: msgspec.DecodeError, refused: Mapping[str, Refused] | None = None
) -> ApiError:
    """400 for a body that is not valid JSON or does not fit the request schema.

    msgspec ends its messages with `- at `$.field[0].x``; that path becomes `param`.
    An unknown field (`code: unknown_parameter`) and a field of `refused` sent with a
    value it does not accept (`code: unsupported_parameter`) get messages of their own,
    with `param` the field's path.
    """
    message = str(exc)
    path = ""
    head, sep, tail = message.rpartition(" - at `$")
    if sep:
        # A map's value is `[...]` in msgspec's paths (`logit_bias[...]`): the field
        # is the map.
        path = tail.rstrip("`").lstrip(".").replace("[...]", "")
        message = head
    if not isinstance(exc, msgspec.ValidationError):
        return invalid_request(f"Request body is not valid JSON: {message}", code="invalid_json")
    # The path's steps are struct fields and list indices (the only places msgspec
    # descends into here), so splitting on dots is exact; an unknown name is one step
    # whatever it holds.
    steps = path.split(".") if path else []
    unknown = _UNKNOWN_FIELD.fullmatch(message)
    if unknown is not None:
        steps.append(unknown["name"])
    if refused and (found := _refused_field(steps, refused)) is not None:
        field, rule = found
        return invalid_request(
            f"Unsupported parameter: `{field}` is defined by {rule.defined_by} but not "
            f"implemented by this server; it accepts only {rule.accepts}.",
            param=field,
            code="unsupported_parameter",
        )
    param = ".".join(steps) or None
    if unknown is not None:
        return invalid_request(
            f"Unknown parameter: `{param}` is neither an OpenAI parameter of this endpoint "
            "nor an extension of this server.",
            param=param,
            code="unknown_parameter",
        )
    where = f" (at `{param}`)" if param else ""
    return invalid_request(f"Invalid request body: {message}{where}", param=param)


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<name>.*)`")
_INDEX = re.compile(r"(\[\d+\])+$")


def _refused_field(steps: list[str], refused: Mapping[str, Refused]) -> tuple[str, Refused] | None:
    """The refused field at or above `steps`, with its path as sent (indices of the
    messages it lies in kept, its own value's dropped)."""
    names = [_INDEX.sub("", step) for step in steps]
    for key, rule in refused.items():
        depth = key.count(".") + 1
        if names[:depth] == key.split("."):
            return ".".join([*steps[: depth - 1], names[depth - 1]]), rule
    return None


# --- litestar exception handlers ----------------------------------------------------

_STATUS_TYPES = {
    HTTP_401_UNAUTHORIZED: INVALID_REQUEST,
    HTTP_404_NOT_FOUND: INVALID_REQUEST,
    HTTP_413_REQUEST_ENTITY_TOO_LARGE: INVALID_REQUEST,
    HTTP_429_TOO_MANY_REQUESTS: "rate_limit_error",
    HTTP_503_SERVICE_UNAVAILABLE: "service_unavailable_error",
}


def handle_api_error(_request: Request[Any, Any, Any], exc: ApiError) -> Response[bytes]:
    """`ApiError` raised by a handler or a guard."""
    return exc.to_response()


def make_http_exception_handler(
    max_body_bytes: int,
) -> Callable[[Request[Any, Any, Any], HTTPException], Response[bytes]]:
    """Translate litestar's own HTTP exceptions (404 route, 405, 413...) to OpenAI bodies."""

    def handle(_request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
        status = exc.status_code
        message = exc.detail
        code: str | None = None
        if status == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
            message = f"Request body exceeds the limit of {max_body_bytes} bytes."
            code = "request_too_large"
        elif status == HTTP_404_NOT_FOUND:
            code = "not_found"
        if status >= HTTP_500_INTERNAL_SERVER_ERROR:
            kind = "server_error"
        else:
            kind = _STATUS_TYPES.get(status, INVALID_REQUEST)
        headers = dict(exc.headers or {})
        return ApiError(status, message, type=kind, code=code, headers=headers).to_response()

    return handle


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """500 for anything nobody anticipated, logged with the request id and traceback."""
    request_id = getattr(request.state, "request_id", None)
    log.error(
        "unhandled_exception",
        request_id=request_id,
        path=request.url.path,
        error=repr(exc),
        exc_info=exc,
    )
    suffix = f" (request id {request_id})" if request_id else ""
    return ApiError(
        HTTP_500_INTERNAL_SERVER_ERROR,
        f"Internal server error{suffix}.",
        type="server_error",
        code="internal_error",
    ).to_response()
