"""The Serve application's backend over its engine replicas: each choice of a prepared
request goes through ``KVRouteClient`` (routing, failover) to one replica, the client's
errors mapped to the HTTP layer's (overload 429 with ``Retry-After``, no replica 503,
the engine's ValueError 400); ``/health`` asks the router actors.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from kvroute.cluster.client import KVRouteClient
from kvroute.cluster.messages import OverloadedError, ReplicaUnavailableError
from kvroute.deploy.backends.choices import ChoiceBackend
from kvroute.deploy.metrics import DecisionQuality
from kvroute.deploy.openai.errors import APIError
from kvroute.deploy.openai.fanout import Choice, EngineRequest
from kvroute.replica.outputs import TokenDelta


class ClusterBackend(ChoiceBackend):
    """The backend of the engine replicas: each choice through the failover client;
    ``accuracy`` (``/metrics``' decision quality) counts each finished choice."""

    def __init__(self, client: KVRouteClient, router_actors: list[Any], tokenizer: Any, timeout_s: Optional[float],
                 generation: str = "", accuracy: Optional[DecisionQuality] = None) -> None:  # fmt: skip
        super().__init__(tokenizer, timeout_s)
        self.client = client
        self.router_actors = router_actors
        self.generation = generation  # the config generation this ingress was built with (ARCHITECTURE.md §5.1)
        self.accuracy = accuracy

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        gen = self.client.generate(request.token_ids, request.params, request.cache_salt, request_id=request.request_id,
                                   on_route=request.on_route, lora_name=request.lora_name)  # fmt: skip
        try:
            async for delta in gen:
                yield delta
        except OverloadedError as exc:
            raise APIError(429, f"the service is overloaded: {exc}", code="overloaded", retry_after_s=exc.retry_after_s) from None
        except ReplicaUnavailableError as exc:
            raise APIError(503, f"no replica could serve the request: {exc}", code="unavailable", retry_after_s=1.0) from None
        except ValueError as exc:  # raised by the replica's engine; Ray wraps it
            cause = getattr(exc, "cause", None)
            raise ValueError(str(cause) if isinstance(cause, ValueError) else str(exc)) from None
        finally:
            await gen.aclose()

    def finished(self, choice: Choice) -> None:
        if self.accuracy is not None:
            self.accuracy.on_finished(choice)

    async def health(self) -> dict[str, Any]:
        """Ready once a router (any: each has the whole directory) knows a replica; with
        the replicas a router refused (they serve, but routing cannot see their caches)."""
        answers = await asyncio.gather(*(asyncio.wait_for(a.health.remote(), 2.0) for a in self.router_actors),
                                       return_exceptions=True)  # fmt: skip
        healthy = [a for a in answers if isinstance(a, dict)]
        refused = {rid: why for a in healthy for rid, why in a["refused"].items()}
        replicas = max((a["replicas"] for a in healthy), default=0)
        policies = sorted({a["policy"] for a in healthy})
        return {"ready": replicas > 0, "replicas": replicas, "routers": f"{len(healthy)}/{len(answers)}",
                "generation": self.generation, "policy": ",".join(policies),
                **({"refused_replicas": refused} if refused else {})}
