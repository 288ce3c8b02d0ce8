"""Where the Responses API keeps stored responses: the interface the HTTP layer uses,
and the in-process implementation the single-engine server runs.

A store maps a response id to its record as JSON text (the response object and the
conversation it continues, ``deploy/openai/responses/api.py``). Both implementations are
bounded the same way (``StoreBounds``: entry count, total bytes, time to live; least
recently used evicted first): ``MemoryResponseStore`` here, in the serving process, and
in the Ray Serve application one named actor per application that every ingress finds
(``cluster/response_store_actor.py``, reached through its ``RemoteResponseStore``).
"""

from __future__ import annotations

from typing import Optional, Protocol

from kvroute.cluster.response_store_actor import BoundedStore, StoreBounds

__all__ = ["MemoryResponseStore", "ResponseStore", "StoreBounds"]


class ResponseStore(Protocol):
    """Stored responses by id. A record may vanish at any time (evicted, expired, the
    store restarted); callers treat a missing record as never stored."""

    async def put(self, key: str, value: str) -> bool:
        """Store ``value`` (JSON text) under ``key``; False when it cannot be kept (larger
        than the store's byte bound)."""

    async def get(self, key: str) -> Optional[str]:
        """The record stored under ``key``, or None."""

    async def delete(self, key: str) -> bool:
        """Forget ``key``; whether a record was there."""


class MemoryResponseStore:
    """A ``ResponseStore`` in this process (one event loop, so no lock): the
    single-engine server's, which has no other ingress to share with."""

    def __init__(self, bounds: StoreBounds = StoreBounds()) -> None:
        self.store = BoundedStore(bounds)

    async def put(self, key: str, value: str) -> bool:
        return self.store.put(key, value)

    async def get(self, key: str) -> Optional[str]:
        return self.store.get(key)

    async def delete(self, key: str) -> bool:
        return self.store.delete(key)
