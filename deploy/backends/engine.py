"""The single-engine server's backend: one in-process ``AsyncEngine``, each choice of a
prepared request one of its requests (no routing: every choice's outcome is this
engine)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional

from kvroute.deploy.backends.choices import ChoiceBackend
from kvroute.replica.async_engine import AsyncEngine
from kvroute.replica.outputs import TokenDelta
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome


class EngineBackend(ChoiceBackend):
    """The backend of one in-process ``AsyncEngine``: each choice is one of its requests."""

    def __init__(self, engine: AsyncEngine, timeout_s: Optional[float]) -> None:
        super().__init__(engine.engine.tokenizer, timeout_s)
        self.engine = engine

    async def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        cache_salt: Optional[str],
        lora_name: Optional[str],
        on_route: Callable[[RouteOutcome], None],
    ) -> AsyncIterator[TokenDelta]:
        on_route(RouteOutcome(self.engine.replica_id))
        gen = self.engine.generate(token_ids, params, request_id=request_id, cache_salt=cache_salt, lora_name=lora_name)
        try:
            async for delta in gen:
                yield delta
        finally:
            await gen.aclose()

    async def health(self) -> dict[str, Any]:
        return {"ready": self.engine.failure is None}
