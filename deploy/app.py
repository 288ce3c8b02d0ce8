"""The Ray Serve application: one OpenAI ingress deployment (FastAPI) in front of the
engine replicas and the router actors, or, with ``AppArgs.workers``, in front of
external OpenAI-compatible workers.

``build_app(args)`` is an application builder: ``serve run deploy/serve.yaml`` and
``serve deploy`` call it with the YAML's ``args`` (``deploy/app_config.py``). Both modes
run the same ingress class, ``OpenAIIngress``: the HTTP layer (``deploy/openai/api.py``,
``deploy/openai/serving.py``) validates and tokenizes every request once and hands it to the
mode's backend, ``ClusterBackend`` (each choice through ``KVRouteClient`` to a replica)
or ``WorkersBackend`` (the request whole to a worker, ``deploy/backends/workers.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from fastapi import FastAPI
from ray import serve

from kvroute.cluster.client import KVRouteClient
from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.lora import FleetAdapters, get_or_create_lora_registry
from kvroute.cluster.replica_deployment import build_engine_deployment
from kvroute.cluster.response_store_actor import RemoteResponseStore, get_or_create_response_store
from kvroute.cluster.router_actor import get_or_create_router_actors
from kvroute.cluster.worker_pool import get_or_create_worker_pool
from kvroute.cluster.worker_probe import check_specs, cluster_nodes
from kvroute.deploy.app_config import AppArgs, ingress_limits, parse_args
from kvroute.deploy.app_metrics import IngressReporter, router_metrics
from kvroute.deploy.ingress_model import load_model_info, serve_http_host
from kvroute.deploy.ingress_placement import ingress_options
from kvroute.deploy.backends.cluster import ClusterBackend
from kvroute.deploy.backends.workers import WorkerAdapters, WorkersBackend, admin_routes, pool_metrics
from kvroute.deploy.metrics import DecisionQuality
from kvroute.deploy.openai.api import build_api, warn_if_open
from kvroute.deploy.openai.serving import AdapterHost, Backend, OpenAIServing, ServerLimits

log = logging.getLogger(__name__)


@dataclass
class IngressParts:
    """What one mode adds to the ingress: its backend, its adapter host, its routing
    counters (``/metrics``), and for the workers mode the pool's ``/metrics`` text, the
    admin routes and the pool's keep-alive on Serve's health check."""

    backend: Backend
    adapters: Optional[AdapterHost]
    routing_stats: dict[str, int]
    extra_metrics: Optional[Callable[[], Awaitable[bytes]]] = None
    routes: Optional[Callable[[FastAPI], None]] = None
    keepalive: Optional[Callable[[], Any]] = None


@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress of both modes: the OpenAI API over the mode's backend (an engine
    deployment's handle, or the external workers' pool), ``/metrics`` of the whole
    application (the router actors hold every ingress's counters). ``engine_handle``:
    the engine deployment, or the name of the application that runs it (an extra
    ingress, ``compose_ingress_app``); None in front of workers."""

    async def __init__(self, args: dict[str, Any], config: ClusterConfig, engine_handle: Any = None) -> None:
        parsed = parse_args(args)
        tokenizer, max_model_len, vocab_size, defaults = await load_model_info(config)
        self.router_actors = get_or_create_router_actors(config)
        for actor in self.router_actors:  # a redeploy that changed only the policy: the kept routers adopt it
            actor.adopt.remote(config.router_policy, config.router_policy_kwargs)
        self.accuracy = DecisionQuality()
        limits = ingress_limits(parsed)
        warn_if_open(limits.api_key, serve_http_host())
        if parsed.workers is None:
            self.parts = _cluster_parts(parsed, config, engine_handle, self.router_actors, self.accuracy, tokenizer, limits)
        else:
            self.parts = await _workers_parts(parsed, config, self.router_actors, self.accuracy, limits)
        name = parsed.llm_configs[0].model_loading_config.model_id
        aliases = () if config.engine.model == name else (config.engine.model,)
        self.serving = OpenAIServing(name, tokenizer, max_model_len, vocab_size, self.parts.backend, limits, aliases,
                                     self.parts.adapters, parsed.ingress.tool_config(), defaults)  # fmt: skip
        self.reporter = IngressReporter(self.router_actors, self.accuracy, self.parts.routing_stats)
        # /v1/responses' stored responses: one store per application, so any ingress continues any response
        store = get_or_create_response_store(config.app_name, limits.response_store_bounds())
        self.response_store = RemoteResponseStore(store)

    async def check_health(self) -> None:
        """Serve's periodic health check; in front of workers it tells the pool an
        ingress still uses it (an unused one ends itself)."""
        if self.parts.keepalive is not None:
            self.parts.keepalive()

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.serving, self._metrics, self.parts.routes, self.response_store)

    async def _metrics(self) -> tuple[bytes, str]:
        body, content_type = await router_metrics(self.router_actors, self.serving.model_name, self.reporter)
        if self.parts.extra_metrics is not None:
            body += await self.parts.extra_metrics()
        return body, content_type


def _cluster_parts(parsed: AppArgs, config: ClusterConfig, engine_handle: Any, routers: list[Any],
                   accuracy: DecisionQuality, tokenizer: Any, limits: ServerLimits) -> IngressParts:  # fmt: skip
    """The engine replicas' backend (and the fleet's LoRA adapters, when enabled)."""
    if isinstance(engine_handle, str):  # an extra ingress application (compose_ingress_app)
        engine_handle = serve.get_deployment_handle(config.deployment_name, app_name=engine_handle)
    client = KVRouteClient(engine_handle, config.hash_spec, max_resume_attempts=config.max_resume_attempts)
    backend = ClusterBackend(client, routers, tokenizer, limits.request_timeout_s, config.generation, accuracy)
    adapters = None
    if config.engine.enable_lora:
        lora = parsed.llm_configs[0].lora_config
        dynamic = lora.dynamic_lora_loading_path if lora is not None else None
        adapters = FleetAdapters(get_or_create_lora_registry(config), client, dynamic)
    return IngressParts(backend, adapters, client.stats)


async def _workers_parts(parsed: AppArgs, config: ClusterConfig, routers: list[Any], accuracy: DecisionQuality,
                         limits: ServerLimits) -> IngressParts:  # fmt: skip
    """The external workers' backend over the application's pool (created on first use)."""
    name, source = parsed.llm_configs[0].model_loading_config.model_id, config.engine.model
    names = {name, source, os.path.basename(source.rstrip("/"))}
    specs = parsed.workers or []
    check_specs(specs, cluster_nodes())  # a clear error here, not the pool actor's
    pool = get_or_create_worker_pool(config, [w.model_dump() for w in specs], sorted(names), parsed.worker_poll_interval_s)
    await pool.up_workers.remote()  # starts its poll loop (after a restart too: every call does)
    backend = WorkersBackend(pool, routers, config.hash_spec, limits.request_timeout_s, accuracy)
    return IngressParts(backend, WorkerAdapters(backend), backend.stats, extra_metrics=lambda: pool_metrics(pool, name),
                        routes=admin_routes(pool), keepalive=pool.touch.remote)  # fmt: skip


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
    if parsed.ingress.data_path == "direct":  # the engine replicas are the ingress (deploy/direct_app.py)
        from kvroute.deploy.direct_app import compose_direct_app

        return compose_direct_app(parsed, config, engine_version)
    bound = () if parsed.workers is not None else (build_engine_deployment(config, version=engine_version),)
    ingress = _ingress_deployment(parsed, ingress_version, ingress_options)
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
    ingress = _ingress_deployment(parsed, ingress_version, ingress_options)
    return ingress.bind(parsed.model_dump(), parsed.cluster_config(), engine_app)


def _with_api_key(args: Union[dict[str, Any], AppArgs]) -> AppArgs:
    parsed = parse_args(args).model_copy(deep=True)
    if parsed.ingress.api_key is None and os.environ.get("KVROUTE_API_KEY"):
        parsed.ingress.api_key = os.environ["KVROUTE_API_KEY"]  # resolved here, where the operator runs
    return parsed


def _ingress_deployment(parsed: AppArgs, version: Optional[str], options: dict[str, Any]) -> Any:
    spec = parsed.ingress
    placement = ingress_options(spec.num_replicas, spec.num_cpus, spec.max_replicas_per_node)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.ingress.num_cpus},
        **placement,
        **options,
    )
    if version is not None:  # (Ray 2.60: version is an internal option, see build_engine_deployment)
        ingress = ingress.options(_internal=True, version=version)
    return ingress
