"""The direct path: each engine replica serves the OpenAI API itself, behind HAProxy.

On the composed path a request crosses two Python processes before it reaches an
engine (the ingress replica, then a Serve handle call to the engine replica) and every
streamed delta crosses back. Here HAProxy forwards the HTTP request straight to the
engine replica's own HTTP port (Ray Serve's direct ingress), after asking the ingress
request router (``deploy/direct_router.py``) which replica; the replica validates,
templates and tokenizes the request with the same serving code as every host, runs it on
its engine and streams the answer back over the same connection. One HTTP hop, one
decision (one ``rank`` call to a router actor), no Ray object per token.

What it gives up: a stream whose replica dies ends with it (its ingress is gone too),
where the composed ingress resumes it on another replica; HAProxy must be on (Serve's
``RAY_SERVE_ENABLE_HA_PROXY``, which ``kvroute serve`` sets). GET routes (models,
health, metrics, stored responses) go to any replica: HAProxy asks the router about
POSTs only, and everything those routes read is the application's (the router actors'
directory and counters, the response store actor, the adapter registry).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from ray import serve

from kvroute.cluster.client import KVRouteClient
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.lora import FleetAdapters, get_or_create_lora_registry
from kvroute.cluster.messages import FirstDelta, GenerateRequest
from kvroute.cluster.replica_deployment import EngineFactory, EngineReplica, build_engine_deployment
from kvroute.cluster.response_store_actor import RemoteResponseStore, get_or_create_response_store
from kvroute.deploy.app_config import AppArgs, ingress_limits, parse_args
from kvroute.deploy.app_metrics import IngressReporter, router_metrics
from kvroute.deploy.backends.choices import ChoiceBackend
from kvroute.deploy.ingress_placement import ingress_options
from kvroute.deploy.direct_route import RouteHeader, current_route
from kvroute.deploy.direct_router import IngressRouter
from kvroute.deploy.metrics import DecisionQuality
from kvroute.deploy.openai.api import build_api, warn_if_open
from kvroute.deploy.openai.fanout import Choice, EngineRequest
from kvroute.deploy.openai.serving import OpenAIServing
from kvroute.replica.block_hash import hash_blocks
from kvroute.replica.outputs import TokenDelta


class DirectBackend(ChoiceBackend):
    """Each choice on this replica's own engine, through ``EngineReplica.generate`` (an
    adapter loaded on first use, a pull the decision priced made first), with the
    decision the router sent in the request's header."""

    def __init__(self, replica: "DirectEngineReplica", tokenizer: Any, timeout_s: Optional[float],
                 accuracy: DecisionQuality) -> None:  # fmt: skip
        super().__init__(tokenizer, timeout_s)
        self.replica = replica
        self.accuracy = accuracy
        self.stats = {"requests": 0, "routed": 0, "fallbacks": 0, "failovers": 0, "spills": 0}

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        decision = current_route.get()
        self._count(decision)
        ids, salt, lora = list(request.token_ids), request.cache_salt, request.lora_name
        call = GenerateRequest(request_id=request.request_id, token_ids=ids, params=request.params, cache_salt=salt,
                               block_hashes=hash_blocks(self.replica.config.hash_spec, ids, salt, lora_name=lora),
                               lora_name=lora)  # fmt: skip
        gen = self.replica.generate(call, decision)
        try:
            async for item in gen:
                if isinstance(item, FirstDelta):
                    request.on_route(item.outcome)
                    item = item.delta
                yield item
        finally:
            await gen.aclose()

    def _count(self, decision: Any) -> None:
        self.stats["requests"] += 1
        if decision is not None:
            self.stats["routed"] += 1
            self.stats["fallbacks"] += decision.reason == "fallback"
            self.stats["failovers"] += decision.failovers
            self.stats["spills"] += decision.spills

    def finished(self, choice: Choice) -> None:
        self.accuracy.on_finished(choice)

    async def health(self) -> dict[str, Any]:
        replica = self.replica
        return {"ready": replica.engine.failure is None and replica.first_router() is not None,
                "replica": replica.replica_id, "generation": replica.config.generation,
                "routers": f"{sum(link.registered for link in replica.links)}/{len(replica.links)}"}  # fmt: skip


class DirectEngineReplica(EngineReplica):
    """An engine replica that is also its application's HTTP ingress. ``args``: the
    application's ``AppArgs`` (as a dict), whose ``ingress`` section sets the API's
    limits, key, tools and reasoning parser."""

    async def __init__(self, config: ClusterConfig, engine_factory: EngineFactory | None = None,
                       args: dict[str, Any] | None = None) -> None:  # fmt: skip
        from kvroute.deploy.ingress_model import load_model_info, serve_http_host

        await super().__init__(config, engine_factory)
        parsed = parse_args(args or {})
        tokenizer, max_model_len, vocab_size, defaults = await load_model_info(config)
        limits = ingress_limits(parsed)
        warn_if_open(limits.api_key, serve_http_host())
        self.accuracy = DecisionQuality()
        backend = DirectBackend(self, tokenizer, limits.request_timeout_s, self.accuracy)
        adapters = None
        if config.engine.enable_lora:  # a new folder is checked by loading it on one replica (any)
            lora = parsed.llm_configs[0].lora_config
            dynamic = lora.dynamic_lora_loading_path if lora is not None else None
            adapters = FleetAdapters(get_or_create_lora_registry(config), KVRouteClient.for_app(config), dynamic)
        name = parsed.llm_configs[0].model_loading_config.model_id
        aliases = () if config.engine.model == name else (config.engine.model,)
        self.serving = OpenAIServing(name, tokenizer, max_model_len, vocab_size, backend, limits, aliases, adapters,
                                     parsed.ingress.tool_config(), defaults)  # fmt: skip
        self.router_actors = [link.actor for link in self.links]
        self.reporter = IngressReporter(self.router_actors, self.accuracy, backend.stats)
        store = get_or_create_response_store(config.app_name, limits.response_store_bounds())
        self.response_store = RemoteResponseStore(store)

    def __serve_build_asgi_app__(self) -> Any:
        return RouteHeader(build_api(self.serving, self._metrics, None, self.response_store))

    async def _metrics(self) -> tuple[bytes, str]:
        return await router_metrics(self.router_actors, self.serving.model_name, self.reporter)


def compose_direct_app(parsed: AppArgs, config: ClusterConfig, engine_version: Optional[str] = None) -> serve.Application:
    """The direct path's application: the engine deployment as the ingress, the
    ``IngressRouter`` as its ingress request router (one per ingress replica count,
    ``ingress.num_replicas``, of ``ingress.num_cpus`` each)."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY, RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY

    if parsed.workers is not None:
        raise ValueError("ingress.data_path 'direct' serves engine replicas; external workers need 'composed'")
    if not (RAY_SERVE_ENABLE_HA_PROXY and RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY):
        raise ValueError("ingress.data_path 'direct' needs Ray Serve's HAProxy: set RAY_SERVE_ENABLE_HA_PROXY=1, "
                         "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 and RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 where "
                         "Ray starts (kvroute serve does), or use data_path 'composed'")  # fmt: skip
    engine = build_engine_deployment(config, version=engine_version, replica_class=serve.ingress()(DirectEngineReplica),
                                     extra_args=(parsed.model_dump(),))  # fmt: skip
    spec = parsed.ingress
    placement = ingress_options(spec.num_replicas, spec.num_cpus, spec.max_replicas_per_node)
    router = serve.deployment(IngressRouter).options(
        name="IngressRouter",
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.ingress.num_cpus},
        **placement,
    )
    return engine._with_ingress_request_router(router.bind(parsed.model_dump(), config, engine))
