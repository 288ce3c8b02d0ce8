"""The Serve application's LoRA adapters as the OpenAI layer sees them (``OpenAIServing``'s
adapter host in the ingress; ARCHITECTURE.md §2).

The list is the application's ``LoRARegistry`` (``cluster/lora_registry.py``), shared by
every ingress and replica. Loading a folder (``POST /v1/load_lora_adapter``) first has
one replica load it, which validates it (a bad folder is a ValueError naming the file and
field, and nothing is registered); then the registry lists it and every other replica
loads it at its next sync or on its first request for it. Unloading takes it off the
registry at once (no new request may name it); each replica drops it at its next sync,
once its requests on it have finished.

``dynamic_lora_loading_path`` (serve.yaml's ``lora_config``, as in Ray Serve LLM): a
request naming an adapter ``X`` the registry does not list loads it from ``<path>/X``
the same way. The path is a folder every replica's node has, or an object-store URI
(``s3://bucket/loras``: ``X`` is then the objects under ``s3://bucket/loras/X``, which
each replica fetches into its node's cache). It is looked at only where it is used, by
the replica that loads the adapter, never on the ingress' node (which may lack it); no
``X`` there is a 404 naming the adapter (the ingress logs the path and the replica's
node), a bad one a 400 naming the file and field.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from kvroute.cluster.client import KVRouteClient
from kvroute.replica.model_store import NOT_FOUND, is_uri

log = logging.getLogger(__name__)

LORA_FRESH_S = 1.0  # how long an ingress trusts its copy of the registry for a name it holds


class FleetAdapters:
    def __init__(self, registry: Any, client: KVRouteClient, dynamic_path: Optional[str] = None) -> None:
        self.registry, self.client = registry, client
        self.dynamic_path = dynamic_path
        self._modules: dict[str, str] = {}
        self._read_at = float("-inf")

    async def list_loras(self) -> dict[str, str]:
        _, self._modules = await self.registry.snapshot.remote()
        self._read_at = time.monotonic()
        return dict(self._modules)

    async def find_lora(self, name: str) -> bool:
        if name in self._modules and time.monotonic() - self._read_at < LORA_FRESH_S:
            return True
        if name in await self.list_loras():
            return True
        source = self._dynamic_source(name)
        if source is None:
            return False
        try:
            await self._load(name, source)
        except ValueError as exc:  # (Ray carries the replica's error as text: its message tells which)
            if NOT_FOUND in str(exc):  # not on the loading replica's node: a 404 (the node is in the log)
                log.warning("LoRA adapter %r: %s", name, exc)
                return False
            if "already loaded" in str(exc):  # that replica still holds an adapter of this name the
                return False  # registry dropped (unloaded; its next sync drops it): not served now
            raise  # there but bad: a 400 naming the file and field
        return True

    async def load_lora(self, name: str, path: str) -> None:
        known = await self.registry.path.remote(name)
        if known is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {known}); unload it first")
        await self._load(name, path)

    async def unload_lora(self, name: str) -> None:
        if not await self.registry.remove.remote(name):
            raise ValueError(f"unknown LoRA adapter {name!r}")
        self._modules.pop(name, None)

    async def _load(self, name: str, path: str) -> None:
        await self.client.load_lora(name, path)  # one replica reads and checks the folder
        await self.registry.add.remote(name, path)
        self._modules[name] = path

    def _dynamic_source(self, name: str) -> Optional[str]:
        """``<dynamic_lora_loading_path>/<name>``, not checked here (the loading replica
        does); None for a name that is not one plain path component (it never leaves
        the path)."""
        if self.dynamic_path is None or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
            return None
        if is_uri(self.dynamic_path):
            return f"{self.dynamic_path.rstrip('/')}/{name}"
        return str(Path(self.dynamic_path).expanduser() / name)
