"""The Ray Serve application: OpenAI ingress (FastAPI) + engine replicas + router actor.

``build_app(args)`` is an application builder: ``serve run deploy/serve.yaml`` and
``serve deploy`` call it with the YAML's ``args``, shaped like Ray Serve LLM's
(``llm_configs`` with ``model_loading_config``, ``engine_kwargs`` and
``deployment_config``, which carries ``autoscaling_config`` and
``request_router_config``), plus an ``ingress`` section for the HTTP limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, AsyncIterator, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray import serve

from kvroute.cluster.client import KVRouteClient
from kvroute.cluster.config import REQUEST_ROUTERS, ROUTER_CHOICES, ClusterConfig
from kvroute.cluster.messages import OverloadedError, ReplicaUnavailableError
from kvroute.cluster.replica_deployment import build_engine_deployment
from kvroute.deploy.errors import APIError
from kvroute.deploy.serving import ServerLimits
from kvroute.deploy.worker_pool import WorkerSpec
from kvroute.replica.config import EngineConfig
from kvroute.replica.outputs import TokenDelta
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome

log = logging.getLogger(__name__)

# request_router_class values: our short names (REQUEST_ROUTERS), or the classes' import paths.
_REQUEST_ROUTERS = {
    **{name: name for name in REQUEST_ROUTERS},
    "kvroute.cluster.request_router.KVRouteRequestRouter": "kvroute",
    "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter": "power_of_two",
    "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter": "power_of_two",
    "ray.serve.llm.request_router.PrefixCacheAffinityRouter": "prefix_affinity_ray",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoadingConfig(_Strict):
    model_id: str = Field(min_length=1, description="the name clients send as `model`")
    model_source: Optional[str] = Field(default=None, description="embedded model name or checkpoint folder (default: model_id)")


class RequestRouterSpec(_Strict):
    request_router_class: str = "kvroute"
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("request_router_class")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in _REQUEST_ROUTERS:
            raise ValueError(f"unknown request_router_class {v!r}; one of {sorted(_REQUEST_ROUTERS)}")
        return v


class DeploymentSpec(_Strict):
    num_replicas: Optional[int] = Field(default=None, ge=1)
    autoscaling_config: Optional[dict[str, Any]] = None
    max_ongoing_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=256, ge=-1)
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    request_router_config: RequestRouterSpec = Field(default_factory=RequestRouterSpec)
    graceful_shutdown_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("ray_actor_options")
    @classmethod
    def _actor_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = set(v) - {"num_cpus", "num_gpus"}
        if unknown:
            raise ValueError(f"ray_actor_options supports num_cpus and num_gpus, got {sorted(unknown)}")
        return v


class LoRAConfigSpec(_Strict):
    """Ray Serve LLM's ``lora_config``: LoRA adapters on every replica (``enable_lora``).
    ``dynamic_lora_loading_path``: a folder present on every node, or an ``s3://`` URI;
    a request naming an adapter X not loaded yet has a replica load ``<path>/X``, resolved
    on the replica's node (``cluster/lora.py``).
    ``max_num_adapters_per_replica``: adapters resident at once (``max_loras``)."""

    dynamic_lora_loading_path: Optional[str] = Field(default=None, min_length=1)
    max_num_adapters_per_replica: int = Field(default=16, ge=1)


class LLMConfig(_Strict):
    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    lora_config: Optional[LoRAConfigSpec] = None
    deployment_config: DeploymentSpec = Field(default_factory=DeploymentSpec)
    router_policy: str = "kvroute"
    router_policy_kwargs: dict[str, Any] = Field(default_factory=dict)
    num_routers: int = Field(default=1, ge=1)
    router_num_cpus: float = Field(default=0.5, ge=0, description="CPU each router actor reserves")
    torch_threads: Optional[int] = Field(default=None, ge=1)

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "replica_id"}
        unknown = set(v) - fields
        if unknown:
            raise ValueError(f"unknown engine_kwargs {sorted(unknown)}; EngineConfig takes {sorted(fields)}")
        return v

    def engine_config(self) -> EngineConfig:
        """The engine every replica runs: ``engine_kwargs``, with ``lora_config`` turning
        adapters on (ValueError where the two disagree)."""
        kwargs = dict(self.engine_kwargs)
        if self.lora_config is not None:
            lora = {"enable_lora": True, "max_loras": self.lora_config.max_num_adapters_per_replica}
            clash = [k for k, v in lora.items() if k in kwargs and kwargs[k] != v]
            if clash:
                raise ValueError(f"engine_kwargs {clash} disagree with lora_config (enable_lora is implied and "
                                 "max_loras is max_num_adapters_per_replica)")  # fmt: skip
            kwargs.update(lora)
        return EngineConfig(model=self.model_loading_config.model_source or self.model_loading_config.model_id, **kwargs)


class IngressSpec(ServerLimits):
    """The HTTP ingress deployment: its request limits (``ServerLimits``' fields) and
    its own replicas."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=0.5, gt=0)
    max_ongoing_requests: int = Field(default=1024, ge=1)
    require_api_key: bool = Field(default=False, description="refuse to start without an API key (never open by mistake)")
    max_replicas_per_node: Optional[int] = Field(
        default=None, ge=1, description="1: at most one ingress per node, so each node's proxy has its own and a "
        "node's loss cuts only the streams that entered there")  # fmt: skip


def ingress_limits(parsed: "AppArgs") -> ServerLimits:
    """The limits an ingress replica enforces, resolved in its own process: the API key
    is ``ingress.api_key``, else ``KVROUTE_API_KEY`` in this process's environment (the
    application's ``runtime_env.env_vars``, or the node's, e.g. a Kubernetes secret).
    ValueError where ``require_api_key`` is set and neither gives one: the deploy fails
    instead of serving an open API."""
    limits = parsed.limits()
    key = limits.api_key or os.environ.get("KVROUTE_API_KEY") or None
    if key is None and parsed.ingress.require_api_key:
        import socket

        raise ValueError(f"ingress.require_api_key is set, but no API key reached the ingress on {socket.gethostname()}: "
                         "set ingress.api_key, or KVROUTE_API_KEY in the application's runtime_env.env_vars or in "
                         "the environment of every node")  # fmt: skip
    return limits.model_copy(update={"api_key": key})


class AppArgs(_Strict):
    """The ``args`` of ``deploy/serve.yaml`` (one model per application). With
    ``workers`` (even empty: they can be added at run time) the application routes to
    those external OpenAI-compatible servers (``deploy/workers.py``) and runs no engine
    replicas; the model folder then gives the workers' tokenizer, ``engine_kwargs``'
    ``block_size`` their block size, and ``router_policy`` routes them (no Serve request
    router is involved)."""

    app_name: str = "kvroute"
    llm_configs: list[LLMConfig] = Field(min_length=1, max_length=1)
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    workers: Optional[list[WorkerSpec]] = None
    worker_poll_interval_s: float = Field(default=1.0, gt=0, description="how often each worker's /metrics is read")

    def cluster_config(self) -> ClusterConfig:
        """The cluster config these args give (``hash_seed`` 0 unless pinned: the
        application's own seed is resolved where it is built, ``compose_app``)."""
        llm = self.llm_configs[0]
        dep = llm.deployment_config
        engine = llm.engine_config()
        if dep.num_replicas is None and dep.autoscaling_config is None:
            num_replicas: Optional[int] = 1
        else:
            num_replicas = dep.num_replicas
        config = ClusterConfig(
            engine=engine,
            app_name=self.app_name,
            num_replicas=num_replicas,
            autoscaling_config=dep.autoscaling_config,
            num_cpus_per_replica=float(dep.ray_actor_options.get("num_cpus", 1.0)),
            num_gpus_per_replica=float(dep.ray_actor_options.get("num_gpus", 0.0)),
            torch_threads=llm.torch_threads,
            max_ongoing_requests=dep.max_ongoing_requests,
            max_queued_requests=dep.max_queued_requests,
            request_router=_REQUEST_ROUTERS[dep.request_router_config.request_router_class],
            router_policy=llm.router_policy,
            router_policy_kwargs=llm.router_policy_kwargs,
            num_routers=llm.num_routers,
            router_num_cpus=llm.router_num_cpus,
            graceful_shutdown_timeout_s=dep.graceful_shutdown_timeout_s,
        )
        return config

    def limits(self) -> ServerLimits:
        return ServerLimits(**self.ingress.model_dump(include=set(ServerLimits.model_fields)))


def parse_args(args: Union[dict[str, Any], AppArgs]) -> AppArgs:
    """Validate a serve config's ``args``; a ValueError names every bad field."""
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'args'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid kvroute application args: {problems}") from None


def router_choice(name: str) -> dict[str, Any]:
    """The ``deployment_config`` / policy fields for a ``--router`` name of the CLI."""
    if name not in ROUTER_CHOICES:
        raise ValueError(f"router must be one of {ROUTER_CHOICES}, got {name!r}")
    if name == "round_robin":  # our router actor running the round-robin baseline
        return {"request_router_class": "kvroute", "router_policy": "round_robin"}
    return {"request_router_class": name, "router_policy": "kvroute"}


# ---------------------------------------------------------------------- backend
class ClusterBackend:
    """The ``Backend`` of the Serve ingress: the failover client over the replicas."""

    def __init__(self, client: KVRouteClient, router_actors: list[Any], generation: str = "") -> None:
        self.client = client
        self.router_actors = router_actors
        self.generation = generation  # the config generation this ingress was built with (ARCHITECTURE.md §5.1)

    async def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        cache_salt: Optional[str],
        on_route: Callable[[RouteOutcome], None],
        lora_name: Optional[str] = None,
    ) -> AsyncIterator[TokenDelta]:
        gen = self.client.generate(token_ids, params, cache_salt, request_id=request_id, on_route=on_route,
                                   lora_name=lora_name)  # fmt: skip
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


# ---------------------------------------------------------------------- ingress
@serve.ingress()
class OpenAIIngress:
    """HTTP ingress: tokenizes once, hashes, routes through the engine deployment's
    handle and shapes OpenAI responses; ``/metrics`` reads the router actor."""

    async def __init__(self, args: dict[str, Any], config: ClusterConfig, engine_handle: Any) -> None:
        from kvroute.cluster.router_actor import get_or_create_router_actors
        from kvroute.deploy.app_metrics import IngressReporter
        from kvroute.deploy.metrics import DecisionQuality
        from kvroute.deploy.serving import OpenAIServing

        parsed = parse_args(args)
        llm = parsed.llm_configs[0]
        if isinstance(engine_handle, str):  # an extra ingress application (compose_ingress_app)
            engine_handle = serve.get_deployment_handle(config.deployment_name, app_name=engine_handle)
        tokenizer, max_model_len, vocab_size = await load_model_info(config)
        self.config = config
        self.router_actors = get_or_create_router_actors(config)
        for actor in self.router_actors:  # a redeploy that changed only the policy: the kept routers adopt it
            actor.adopt.remote(config.router_policy, config.router_policy_kwargs)
        client = KVRouteClient(engine_handle, config.hash_spec, max_resume_attempts=config.max_resume_attempts)
        name = llm.model_loading_config.model_id
        aliases = () if config.engine.model == name else (config.engine.model,)
        adapters = None
        if config.engine.enable_lora:
            from kvroute.cluster.lora import FleetAdapters, get_or_create_lora_registry

            dynamic = llm.lora_config.dynamic_lora_loading_path if llm.lora_config is not None else None
            adapters = FleetAdapters(get_or_create_lora_registry(config), client, dynamic)
        self.serving = OpenAIServing(name, tokenizer, max_model_len, vocab_size, ClusterBackend(client, self.router_actors, config.generation),
                                     ingress_limits(parsed), aliases, adapters)  # fmt: skip
        self.accuracy = DecisionQuality()
        self.serving.on_finished.append(self.accuracy.on_finished)
        self.reporter = IngressReporter(self.router_actors, self.accuracy, client.stats)  # /metrics of the whole application

    def __serve_build_asgi_app__(self) -> Any:
        from kvroute.deploy.api import build_api

        return build_api(self.serving, self._metrics)

    async def _metrics(self) -> tuple[bytes, str]:
        from kvroute.deploy.app_metrics import router_metrics

        return await router_metrics(self.router_actors, self.serving.model_name, self.reporter)


async def load_model_info(config: ClusterConfig) -> tuple[Any, int, int]:
    """The ingress' view of the model: its tokenizer, context length and vocabulary size."""
    from kvroute.replica.checkpoint import load_hf_config, load_tokenizer, resolve_model
    from kvroute.replica.models.arch import ModelArch

    path = await asyncio.to_thread(resolve_model, config.engine.model, False)  # config and tokenizer: no weights here
    light = config.engine.emulate is not None
    tokenizer = await asyncio.to_thread(load_tokenizer, path, light)
    arch = ModelArch.from_hf_config(load_hf_config(path, light))
    return tokenizer, config.engine.context_length(arch.max_position_embeddings), arch.vocab_size


def build_app(args: Union[dict[str, Any], AppArgs]) -> serve.Application:
    """Serve application builder (``import_path: kvroute.deploy.app:build_app``).

    Ray Serve calls a builder with exactly one argument (it checks the signature),
    so the options for programs live on :func:`compose_app`."""
    return compose_app(args)


def compose_app(
    args: Union[dict[str, Any], AppArgs], *, engine_version: Optional[str] = None, ingress_version: Optional[str] = None,
    **ingress_options: Any,
) -> serve.Application:
    """The application :func:`build_app` builds, with options for programs that
    redeploy one application: ``engine_version`` pins the engine deployment's Serve
    version (``replica_version``: a router swap or a new replica count then keeps the
    replicas), ``ingress_version`` the ingress's (a redeploy with the same one keeps the
    ingress and the requests in flight through it), and ``ingress_options`` go to the
    ingress deployment's ``.options``."""
    parsed = _with_api_key(args)
    config = parsed.cluster_config()
    if "hash_seed" not in parsed.llm_configs[0].engine_kwargs:
        from kvroute.cluster.app_state import with_app_hash_seed

        config = with_app_hash_seed(config)
    if parsed.workers is not None:
        from kvroute.deploy.workers import WorkersIngress

        ingress_class, bound = WorkersIngress, ()
    else:
        ingress_class, bound = OpenAIIngress, (build_engine_deployment(config, version=engine_version),)
    ingress = _ingress_deployment(ingress_class, parsed, ingress_version, ingress_options)
    return ingress.bind(parsed.model_dump(), config, *bound)


def compose_ingress_app(
    args: Union[dict[str, Any], AppArgs], engine_app: str, *, ingress_version: Optional[str] = None, **ingress_options: Any
) -> serve.Application:
    """An application that is only an ``OpenAIIngress``, in front of the engine
    deployment and router actors of the running application ``engine_app`` (built from
    the same ``args``, hash seed included): one more HTTP entry point (route prefix) to
    the same fleet, with its own ingress process, handle and request router. The
    multi-ingress benchmark serves I of them so that each client is pinned to one
    ingress, which Serve's proxy cannot do among one deployment's replicas (ARCHITECTURE.md §7)."""
    parsed = _with_api_key(args)
    if parsed.workers is not None:
        raise ValueError("compose_ingress_app fronts an engine deployment; an external-workers app has none")
    if "hash_seed" not in parsed.llm_configs[0].engine_kwargs:
        raise ValueError("compose_ingress_app needs engine_kwargs.hash_seed: the engine application's own seed")
    ingress = _ingress_deployment(OpenAIIngress, parsed, ingress_version, ingress_options)
    return ingress.bind(parsed.model_dump(), parsed.cluster_config(), engine_app)


def _with_api_key(args: Union[dict[str, Any], AppArgs]) -> AppArgs:
    parsed = parse_args(args).model_copy(deep=True)
    if parsed.ingress.api_key is None and os.environ.get("KVROUTE_API_KEY"):
        parsed.ingress.api_key = os.environ["KVROUTE_API_KEY"]  # resolved here, where the operator runs
    return parsed


def _ingress_deployment(cls: type, parsed: AppArgs, version: Optional[str], options: dict[str, Any]) -> Any:
    placement = {"max_replicas_per_node": parsed.ingress.max_replicas_per_node} if parsed.ingress.max_replicas_per_node else {}
    ingress = serve.deployment(cls).options(
        name="OpenAIIngress",
        num_replicas=parsed.ingress.num_replicas,
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.ingress.num_cpus},
        **placement,
        **options,
    )
    if version is not None:  # (Ray 2.60: version is an internal option, see build_engine_deployment)
        ingress = ingress.options(_internal=True, version=version)
    return ingress
