"""The arguments of the Serve application (``deploy/serve.yaml``'s ``args``), shaped like
Ray Serve LLM's: ``llm_configs`` with ``model_loading_config``, ``engine_kwargs``,
``lora_config`` and ``deployment_config`` (which carries ``autoscaling_config`` and
``request_router_config``), plus an ``ingress`` section for the HTTP limits and, for an
application in front of external workers, ``workers``. Every field is checked here, so
a bad config fails where it is deployed, naming the field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvroute.cluster.config import REQUEST_ROUTERS, ROUTER_CHOICES, ClusterConfig
from kvroute.cluster.worker_state import WorkerSpec
from kvroute.deploy.openai.serving import ServerLimits
from kvroute.deploy.openai.tools.serving import ToolServingConfig
from kvroute.replica.config import EngineConfig

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
    fleet_prefixes: int = Field(default=8, ge=0, description="hot prefixes a joining replica pulls before it "
                                "serves, and a leaving one hands to survivors (0: off)")  # fmt: skip
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
    """The HTTP ingress deployment: its request limits (``ServerLimits``' fields), its
    own replicas, and the chat template and tool-call settings vLLM takes as
    ``--chat-template`` (the template's text, a file on the ingress's node, or a shipped
    template's name), ``--tool-call-parser``, ``--enable-auto-tool-choice`` and
    ``--reasoning-parser``."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    num_replicas: Union[Annotated[int, Field(ge=1)], Literal["per_node"]] = Field(
        default="per_node", description="per_node: one on every node that can host one (its num_cpus), at most "
        "one per node, counted when the application is built; or a count")  # fmt: skip
    num_cpus: float = Field(default=0.5, gt=0)
    max_ongoing_requests: int = Field(default=1024, ge=1)
    require_api_key: bool = Field(default=False, description="refuse to start without an API key (never open by mistake)")
    max_replicas_per_node: Optional[int] = Field(
        default=None, ge=1, description="1 (the default under per_node): at most one ingress per node, so each "
        "node's proxy has its own and a node's loss cuts only the streams that entered there")  # fmt: skip
    chat_template: Optional[str] = Field(default=None, min_length=1)
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: Optional[str] = None
    data_path: Literal["composed", "direct"] = Field(
        default="composed", description="composed: this ingress deployment in front of the engine replicas (any "
        "proxy; resumes a stream whose replica dies); direct: the engine replicas serve the API themselves behind "
        "HAProxy, an ingress request router of num_replicas x num_cpus choosing for each request "
        "(deploy/direct_app.py)")  # fmt: skip

    @model_validator(mode="after")
    def _tool_flags(self) -> "IngressSpec":
        """The parser and auto choice agree (the template is read where the ingress runs)."""
        ToolServingConfig(None, self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)
        return self

    def tool_config(self) -> ToolServingConfig:
        """The ingress's tool settings (ValueError naming the bad one)."""
        return ToolServingConfig.from_flags(self.chat_template, self.tool_call_parser, self.enable_auto_tool_choice,
                                            self.reasoning_parser)  # fmt: skip


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
    those external OpenAI-compatible servers (``deploy/backends/workers.py``) and runs no engine
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
            fleet_prefixes=llm.fleet_prefixes,
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
