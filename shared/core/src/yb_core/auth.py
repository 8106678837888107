"""Bearer tokens on HTTP: parsing the header and checking it in constant time.

Shared by the gateway (API keys, the metrics token) and every service's metrics
listener, so all of them accept the same spellings and compare the same way.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value ('' if none).

    The scheme is case-insensitive (RFC 7235); anything but Bearer yields ''.
    """
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return ""
    return token.strip()


def matches_any(presented: str, accepted: Iterable[bytes]) -> bool:
    """Whether `presented` equals one of `accepted`, in constant time.

    Every accepted secret is compared (no early exit), so the time taken tells
    nothing about which key came close; an empty token never matches.
    """
    if not presented:
        return False
    candidate = presented.encode()
    found = False
    for key in accepted:
        found |= hmac.compare_digest(candidate, key)
    return found
