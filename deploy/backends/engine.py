"""The single-engine server's backend: one in-process ``AsyncEngine``, each choice of a
prepared request one of its requests (no routing: every choice's outcome is this
engine)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from kvroute.deploy.backends.choices import ChoiceBackend
from kvroute.deploy.openai.fanout import EngineRequest
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.outputs import TokenDelta
from kvroute.router.types import RouteOutcome


class EngineBackend(ChoiceBackend):
    """The backend of one in-process ``AsyncEngine``: each choice is one of its requests."""

    def __init__(self, engine: AsyncEngine, timeout_s: Optional[float]) -> None:
        super().__init__(engine.engine.tokenizer, timeout_s)
        self.engine = engine

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        request.on_route(RouteOutcome(self.engine.replica_id))
        gen = self.engine.generate(request.token_ids, request.params, request_id=request.request_id,
                                   cache_salt=request.cache_salt, lora_name=request.lora_name)  # fmt: skip
        try:
            async for delta in gen:
                yield delta
        finally:
            await gen.aclose()

    async def health(self) -> dict[str, Any]:
        return {"ready": self.engine.failure is None}
