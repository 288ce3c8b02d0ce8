"""The names a server answers to: the model, its aliases and the LoRA adapters of an
``AdapterHost``. ``ServedModels`` is what ``/v1/models``, ``/v1/models/{id}`` and vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` answer, and it resolves a
request's ``model`` to the adapter that serves it (None: the base model), so every
route of ``OpenAIServing`` names models the same way.

Plain Python, no FastAPI or Ray: errors are ``APIError`` (404 for a name nobody serves,
400 for a folder or adapter the host refuses).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol, Sequence

from kvroute.deploy.openai.errors import APIError, bad_request
from kvroute.deploy.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

__all__ = ["AdapterHost", "ServedModels"]


class AdapterHost(Protocol):
    """Where LoRA adapters live (``AsyncEngine``; in the Serve application
    ``cluster/lora.py``'s ``FleetAdapters``, in front of external workers
    ``deploy/backends/workers.py``'s ``WorkerAdapters``): ValueError for a bad folder, a taken
    name, an unknown adapter or one in use."""

    async def list_loras(self) -> dict[str, str]:
        """The loaded adapters' folders by name."""

    async def find_lora(self, name: str) -> bool:
        """Whether ``name`` is loaded (a host may load it now, e.g. from a dynamic path);
        ValueError when it exists but cannot be loaded."""

    async def load_lora(self, name: str, path: str) -> None: ...

    async def unload_lora(self, name: str) -> None: ...


class ServedModels:
    """``model_name`` and its ``aliases`` name the base model; with ``adapters``, a
    request may name an adapter, and the model list shows them (``parent``: the base
    model). ``max_model_len`` is shown on every card."""

    def __init__(self, model_name: str, max_model_len: int, aliases: Sequence[str] = (),
                 adapters: Optional[AdapterHost] = None) -> None:  # fmt: skip
        self.model_name = model_name
        self.names = (model_name, *aliases)
        self.max_model_len = max_model_len
        self.adapters = adapters
        self.created = int(time.time())

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the base model under each of its names, then the adapters."""
        adapters = await self._loaded()
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "kvroute", "root": self.model_name,
                 "max_model_len": self.max_model_len}  # fmt: skip
                for name in self.names
            ]
            + [
                {"id": name, "object": "model", "created": self.created, "owned_by": "kvroute", "root": path,
                 "parent": self.model_name, "max_model_len": self.max_model_len}  # fmt: skip
                for name, path in adapters.items()
            ],
        }

    async def model_card(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}`` (Ray Serve LLM's route): the card, or a 404 naming it."""
        for card in (await self.models())["data"]:
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")

    async def resolve(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name that is
        neither the model, an alias, nor an adapter the host has or can load (400 for
        one it cannot load). Ray Serve LLM's ``"<base model>:<adapter>"`` names the
        adapter: with an unknown adapter the 404 names it; with another base, the model."""
        if model is None or model in self.names:
            return None
        base, colon, adapter = model.partition(":")
        if not (colon and adapter and base in self.names):
            adapter = model
        if self.adapters is not None:
            try:
                if await self.adapters.find_lora(adapter):
                    return adapter
            except ValueError as exc:
                raise bad_request(str(exc), param="model") from None
        serves = [*self.names, *await self._loaded()]
        what = f"The LoRA adapter {adapter!r} of {base!r}" if adapter != model else f"The model {model!r}"
        raise APIError(404, f"{what} does not exist; this server serves {serves}", param="model", code="model_not_found")

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        """vLLM's load route: the success line it answers, or a 400 naming the field."""
        host = self._host()
        if req.lora_name in self.names:
            raise bad_request(f"{req.lora_name!r} is the base model's name", param="lora_name")
        try:
            await host.load_lora(req.lora_name, req.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_name" if "already loaded" in str(exc) else "lora_path") from None
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        """vLLM's unload route: 404 for an adapter not loaded, 400 for one in use."""
        host = self._host()
        if req.lora_name not in await host.list_loras():
            raise APIError(404, f"The LoRA adapter {req.lora_name!r} cannot be found", param="lora_name",
                           code="model_not_found")  # fmt: skip
        try:
            await host.unload_lora(req.lora_name)
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_name") from None
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    async def _loaded(self) -> dict[str, str]:
        return {} if self.adapters is None else await self.adapters.list_loras()

    def _host(self) -> AdapterHost:
        if self.adapters is None:
            raise bad_request("this server runs without LoRA adapters (start it with --enable-lora)")
        return self.adapters
