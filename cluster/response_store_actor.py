"""Stored Responses-API responses (``POST /v1/responses`` with ``store``): a bounded
map from response id to its JSON record, and the Ray Serve application's copy of it, a
named detached actor that every ingress of the application finds by name.

``BoundedStore`` is plain Python (no Ray; the single-engine server keeps one in its own
process, ``deploy/openai/responses/store.py``). It holds each record as JSON text and bounds the
whole by entry count and total bytes, evicting the least recently used first, and drops
a record ``ttl_s`` after it was stored. Reason: a record holds the whole conversation so
far (a continuation is one lookup, whatever its length), so an unbounded store would
grow with every turn of every client.

The actor (``get_or_create_response_store``) wraps one ``BoundedStore`` per
application, so a response stored through one ingress is read, continued or deleted
through any other, on any node. It lives in memory only: a restarted actor (Ray
restarts it, e.g. after its node is lost) starts empty, and a continuation of a response
it held then gets a 400 (not found), as an evicted one does. Ray is imported lazily, so
importing this module costs a process that only serves one engine nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvroute.cluster.messages import ROUTER_NAMESPACE

STORE_CALL_TIMEOUT_S = 5.0  # an actor on a node that vanished stalls a request no longer than this


@dataclass(frozen=True)
class StoreBounds:
    """How much a response store keeps: at most ``max_entries`` records and
    ``max_bytes`` of JSON text in all (least recently used evicted first), each for at
    most ``ttl_s`` seconds after it was stored."""

    max_entries: int = 10_000
    max_bytes: int = 256 * 2**20
    ttl_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1 or not self.ttl_s > 0:
            raise ValueError(f"response store bounds must be positive, got {self}")


class BoundedStore:
    """Records by id, as JSON text, within ``bounds`` (see ``StoreBounds``). A record
    larger than ``max_bytes`` on its own is not kept (``put`` returns False). One caller
    at a time (an actor's calls run one by one; the in-process store runs on one event
    loop). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, bounds: StoreBounds = StoreBounds(), clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.clock = clock
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (stored at, JSON), LRU first
        self._bytes = 0
        self.evicted = 0
        self.expired = 0

    def put(self, key: str, value: str) -> bool:
        """Store ``value`` under ``key`` (replacing what was there); False when it alone
        exceeds the byte bound."""
        self._drop(key)
        size = len(value.encode())
        if size > self.bounds.max_bytes:
            return False
        self._items[key] = (self.clock(), value)
        self._bytes += size
        while len(self._items) > self.bounds.max_entries or self._bytes > self.bounds.max_bytes:
            oldest = next(iter(self._items))
            self._drop(oldest)
            self.evicted += 1
        return True

    def get(self, key: str) -> Optional[str]:
        """The record stored under ``key`` (now the most recently used), or None when
        there is none, or it expired."""
        item = self._items.get(key)
        if item is None:
            return None
        if self.clock() - item[0] > self.bounds.ttl_s:
            self._drop(key)
            self.expired += 1
            return None
        self._items.move_to_end(key)
        return item[1]

    def delete(self, key: str) -> bool:
        """Forget ``key``; whether a live record was there."""
        return self.get(key) is not None and self._drop(key)

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._items), "bytes": self._bytes, "evicted": self.evicted, "expired": self.expired,
                "max_entries": self.bounds.max_entries, "max_bytes": self.bounds.max_bytes}  # fmt: skip

    def _drop(self, key: str) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self._bytes -= len(item[1].encode())
        return True


def response_store_name(app_name: str) -> str:
    """The actor's name: one store per application, whatever its generation (a
    redeploy keeps the responses stored before it)."""
    return f"kvroute-responses:{app_name}"


def get_or_create_response_store(app_name: str, bounds: StoreBounds = StoreBounds()) -> Any:
    """The application's store actor, created on first use (detached, like the
    routers; the first creator's bounds hold)."""
    import ray

    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(BoundedStore)
    return actor_class.options(name=response_store_name(app_name), namespace=ROUTER_NAMESPACE, lifetime="detached",
                               get_if_exists=True).remote(bounds)  # fmt: skip


def kill_response_store(app_name: str) -> bool:
    """End the application's store (the application is going away); whether one ran."""
    import ray

    try:
        actor = ray.get_actor(response_store_name(app_name), namespace=ROUTER_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


class RemoteResponseStore:
    """The ingress's view of the store actor, with the async interface of
    ``deploy/openai/responses/store.py``'s ``ResponseStore``. Every call is bounded by
    ``timeout_s``; a store that does not answer raises ``TimeoutError``, a dead one
    Ray's error."""

    def __init__(self, actor: Any, timeout_s: float = STORE_CALL_TIMEOUT_S) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    async def put(self, key: str, value: str) -> bool:
        return await asyncio.wait_for(self.actor.put.remote(key, value), self.timeout_s)

    async def get(self, key: str) -> Optional[str]:
        return await asyncio.wait_for(self.actor.get.remote(key), self.timeout_s)

    async def delete(self, key: str) -> bool:
        return await asyncio.wait_for(self.actor.delete.remote(key), self.timeout_s)
