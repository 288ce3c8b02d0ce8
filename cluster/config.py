"""Cluster configuration: the engine every replica runs, how many replicas, the limits
that turn overload into a clear error, and which router decides. One frozen dataclass,
validated on construction, shipped to every replica and to the router actor."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvroute.replica.block_hash import HashSpec
from kvroute.replica.config import EngineConfig

# Which Serve request router the deployment's handles use.
#   kvroute            ours: asks the router actor (policy ``router_policy``)
#   power_of_two       Ray Serve's default PowerOfTwoChoicesRequestRouter
#   prefix_affinity_ray Ray Serve LLM's PrefixCacheAffinityRouter (needs ``prompt``)
REQUEST_ROUTERS = ("kvroute", "power_of_two", "prefix_affinity_ray")
# What a user picks with ``kvroute serve --router`` (and the serving benchmarks): the
# request routers, plus ``round_robin``, our router actor running the round-robin policy.
ROUTER_CHOICES = ("kvroute", "round_robin", "power_of_two", "prefix_affinity_ray")


@dataclass(frozen=True)
class ClusterConfig:
    """``engine.replica_id`` is ignored (each replica takes its Serve replica id);
    ``engine.hash_seed`` is the cluster-wide block-hash seed: ``with_random_hash_seed``
    draws one once, where the application is built, never inside a replica."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    app_name: str = "kvroute"
    deployment_name: str = "EngineReplica"
    num_replicas: int | None = 2  # None with autoscaling_config
    autoscaling_config: dict[str, Any] | None = None
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    torch_threads: int | None = None  # None: one per CPU of the replica (at least 1)
    max_ongoing_requests: int = 64
    max_queued_requests: int = 256
    request_router: str = "kvroute"
    router_policy: str = "kvroute"
    router_policy_kwargs: dict[str, Any] = field(default_factory=dict)
    router_timeout_s: float = 1.0  # a routing call slower than this goes to the next router, then power of two
    num_routers: int = 1  # active router actors, each with the whole directory (ARCHITECTURE.md §3.3)
    heartbeat_s: float = 0.5  # a replica reports at least this often, even when idle
    # A replica folds the KV events and load of this long into one push to each router,
    # so the routers' intake grows with time, not with requests (a router's own decisions
    # are in its view at once: it inserts the runs it routes itself).
    push_interval_s: float = 0.025
    replica_timeout_s: float = 10.0  # the router forgets a replica silent this long
    graceful_shutdown_timeout_s: float = 30.0
    max_resume_attempts: int = 3  # per request, after a replica dies mid-stream
    # Each router actor reserves this much CPU (a router under full load uses up to ~0.8
    # of a core: the ingresses pass it over from there), and the routers are spread over
    # the nodes, so one node's loss leaves the others' routers with the whole directory.
    router_num_cpus: float = 0.5
    # An application actor (router, worker pool) that no replica, worker or ingress of its
    # generation has called for this long ends itself: what a redeploy with a changed
    # config or a ``serve delete`` leaves behind goes away without an operator.
    idle_exit_s: float = 30.0
    call_timeout_s: float = 5.0  # every call between the application's actors (register, push, reports)
    # Hot prefixes a replica that joins pulls before it serves, and one that leaves on a
    # scale-down hands to the survivors (cluster/fleet_moves.py); 0: neither.
    fleet_prefixes: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.num_replicas is None and self.autoscaling_config is None:
            raise ValueError("set num_replicas or autoscaling_config")
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas and autoscaling_config are exclusive: autoscaling picks the count")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_cpus_per_replica <= 0 or self.num_gpus_per_replica < 0:
            raise ValueError("num_cpus_per_replica must be > 0 and num_gpus_per_replica >= 0")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.max_queued_requests < -1 or self.max_queued_requests == 0:
            raise ValueError(f"max_queued_requests must be >= 1 or -1 (unbounded), got {self.max_queued_requests}")
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {REQUEST_ROUTERS}, got {self.request_router!r}")
        from kvroute.router.policies import policy_names

        if self.router_policy not in policy_names():
            raise ValueError(f"router_policy must be one of {policy_names()}, got {self.router_policy!r}")
        if self.router_num_cpus < 0:
            raise ValueError(f"router_num_cpus must be >= 0, got {self.router_num_cpus}")
        if self.idle_exit_s <= self.replica_timeout_s:
            raise ValueError(f"idle_exit_s={self.idle_exit_s} must exceed replica_timeout_s={self.replica_timeout_s}")
        for name in ("router_timeout_s", "heartbeat_s", "replica_timeout_s", "graceful_shutdown_timeout_s",
                     "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.replica_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"replica_timeout_s={self.replica_timeout_s} must exceed two heartbeats (heartbeat_s={self.heartbeat_s})"
            )
        if not 0 <= self.push_interval_s < self.heartbeat_s:
            raise ValueError(f"push_interval_s must be >= 0 and below heartbeat_s={self.heartbeat_s}, "
                             f"got {self.push_interval_s}")
        if not isinstance(self.num_routers, int) or self.num_routers < 1:
            raise ValueError(f"num_routers must be an integer >= 1, got {self.num_routers!r}")
        if self.fleet_prefixes < 0:
            raise ValueError(f"fleet_prefixes must be >= 0, got {self.fleet_prefixes}")
        if self.max_resume_attempts < 0:
            raise ValueError(f"max_resume_attempts must be >= 0, got {self.max_resume_attempts}")

    def with_random_hash_seed(self) -> "ClusterConfig":
        """A copy whose engines share a freshly drawn block-hash seed (one per cluster)."""
        engine = dataclasses.replace(self.engine, hash_seed=secrets.randbits(63))
        return dataclasses.replace(self, engine=engine)

    @property
    def hash_spec(self) -> HashSpec:
        """The spec callers hash prompts with; equal to every replica engine's own."""
        return HashSpec(self.engine.block_size, self.engine.hash_seed, self.engine.model)

    @property
    def generation(self) -> str:
        """A digest of every field the replicas and the router actors are built with,
        leaving out those a running fleet adopts in place: the replica count and
        autoscaling (Serve rescales), the Serve request router, and the router policy
        (each new ingress hands its policy to the routers). Two builds of one config
        have one generation, so a redeploy keeps the routers, the replicas and their
        caches; any other change starts a new generation of both, side by side with the
        old one until the old one drains."""
        import hashlib

        neutral = dataclasses.replace(
            self, num_replicas=1, autoscaling_config=None, request_router="kvroute", router_policy="kvroute",
            router_policy_kwargs={},
        )
        return hashlib.sha256(repr(neutral).encode()).hexdigest()[:16]

    def actor_name(self, role: str) -> str:
        """The name of one of the application's detached actors (``router``,
        ``workers``): keyed by the application and its generation, so a changed config
        never reuses an actor built for the old one."""
        return f"kvroute-{role}:{self.app_name}@{self.generation[:10]}"

    @property
    def router_actor_name(self) -> str:
        """The first router actor's name (the only one when ``num_routers`` is 1)."""
        return self.actor_name("router")

    @property
    def router_actor_names(self) -> list[str]:
        return [self.router_actor_name] + [f"{self.router_actor_name}:{i}" for i in range(1, self.num_routers)]

    @property
    def torch_threads_per_replica(self) -> int:
        return self.torch_threads or max(1, int(self.num_cpus_per_replica))
