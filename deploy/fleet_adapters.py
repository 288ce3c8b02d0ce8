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
request naming an adapter ``X`` the registry does not list loads it from
``<path>/X`` (a local folder every replica sees) the same way; no such folder is a 404.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from kvroute.cluster.client import KVRouteClient

LORA_FRESH_S = 1.0  # how long an ingress trusts its copy of the registry for a name it holds


class FleetAdapters:
    def __init__(self, registry: Any, client: KVRouteClient, dynamic_path: Optional[str] = None) -> None:
        self.registry, self.client = registry, client
        self.dynamic_path = None if dynamic_path is None else Path(dynamic_path).expanduser()
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
        folder = self._dynamic_folder(name)
        if folder is None:
            return False
        await self._load(name, str(folder))
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

    def _dynamic_folder(self, name: str) -> Optional[Path]:
        """``<dynamic_lora_loading_path>/<name>`` when that folder exists; a name that is
        not one plain path component never leaves the folder."""
        if self.dynamic_path is None or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
            return None
        folder = self.dynamic_path / name
        return folder if folder.is_dir() else None
