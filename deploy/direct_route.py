"""The routing decision as it travels on the direct path: from the ingress request
router, through HAProxy, to the engine replica that serves the request.

HAProxy copies the router's ``request_headers`` onto the forwarded request after
dropping any client-sent header under Serve's router prefix (``x-serve-router-``), so
the decision arrives as one header. Its value is URL-safe base64 of a small JSON object
(HAProxy's Lua reads header values up to the first double quote, so no raw JSON). The
replica trusts it only as far as it must: a header that does not decode is no
decision, as for a request that reached the replica's port without HAProxy; a decision
only feeds the load report's ticket and the decision-quality counters, never what the
request computes.

``RouteHeader`` is the ASGI wrapper that reads the header into a context variable for
the request's task, where the replica's backend finds it (the fan-out's tasks inherit
the context).
"""

from __future__ import annotations

import base64
import contextvars
import dataclasses
import json
from typing import Any, Callable, Optional

from kvroute.router.types import RouteDecision

ROUTE_HEADER = "x-serve-router-kvroute-route"
_HEADER_KEY = ROUTE_HEADER.encode()
_FIELDS = {f.name: f for f in dataclasses.fields(RouteDecision) if f.name != "fallbacks"}
_MAX_HEADER_BYTES = 4096

current_route: contextvars.ContextVar[Optional[RouteDecision]] = contextvars.ContextVar("kvroute_route", default=None)


def encode_route(decision: RouteDecision) -> str:
    """The header value of ``decision`` (its fallbacks left out: only the router uses them)."""
    data = {name: getattr(decision, name) for name in _FIELDS}
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_route(value: str) -> Optional[RouteDecision]:
    """The decision a header value carries, or None when it is not one."""
    if not value or len(value) > _MAX_HEADER_BYTES:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict) or set(data) - set(_FIELDS):
        return None
    for name, value in data.items():
        if not _fits(_FIELDS[name], value):
            return None
    try:
        return RouteDecision(**data)
    except TypeError:  # a required field missing
        return None


_KINDS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "ReplicaId": (str,)}


def _fits(field: dataclasses.Field, value: Any) -> bool:
    """Whether the JSON ``value`` has a type ``field``'s annotation names."""
    parts = [part.strip() for part in str(field.type).split("|")]
    if value is None:
        return "None" in parts
    if isinstance(value, bool):
        return "bool" in parts
    return any(isinstance(value, _KINDS.get(part, ())) for part in parts)


class RouteHeader:
    """ASGI wrapper: the request's route header, decoded, in ``current_route``."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = None
        for key, value in scope.get("headers", ()):
            if key == _HEADER_KEY:
                decision = decode_route(value.decode("latin-1"))
                break
        token = current_route.set(decision)
        try:
            await self.app(scope, receive, send)
        finally:
            current_route.reset(token)
