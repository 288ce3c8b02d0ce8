"""The fleets a router comparison runs on, each behind one router at a time, from cold
caches (``benchmarks/compare_routers.py`` explains how one Serve fleet serves every Serve
router): ``ServeFleet`` (kvroute's Serve application, its router swapped between runs)
and ``ExternalFleet`` (``kvroute serve-replica`` processes behind SGLang's or vLLM's
router). Both can lose replicas mid-run (``kill_replicas``) and start with fewer replicas
that grow to ``--replicas`` mid-run (``--add-replicas``, ``add_replicas``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from kvroute.cluster.config import ROUTER_CHOICES

SERVE_ROUTERS = ROUTER_CHOICES
# kvroute with a single router actor however many ingresses (``kvroute`` runs one per ingress)
ONE_ROUTER = "kvroute_1router"
# External routers: module run with ``python -m`` (each is an sglang-router-style CLI:
# --host/--port/--policy/--worker-urls), started with --policy cache_aware.
EXTERNAL_ROUTERS = {"sglang_router": "sglang_router.launch_router", "vllm_router": "vllm_router.launch_router"}
_CLI = "import sys; from kvroute.deploy.cli import main; sys.exit(main(sys.argv[1:]))"


def external_available(name: str) -> bool:
    import importlib.util

    return name in EXTERNAL_ROUTERS and importlib.util.find_spec(name) is not None

from kvroute.benchmarks.fleet_probes import (
    SERVED_NAME,
    ingress_requests,
    peer_staleness_ms,
    router_counters,
    wait_counters,
    wait_until,
    warm_up,
)


@dataclass(frozen=True)
class FleetConfig:
    """The engine replicas every router of a comparison runs on, and the Ray cluster and
    Serve application that hold them. ``add_replicas``: every run starts with
    ``replicas - add_replicas``, the rest join mid-run; ``ingresses``: I ingresses,
    the clients spread evenly over them; ``num_routers``: kvroute's router actors
    (default: one per ingress)."""

    model: str = "smollm2-135m-instruct"
    replicas: int = 2
    num_cpus_per_replica: float = 1.0
    torch_threads: int = 1
    max_ongoing_requests: int = 64
    add_replicas: int = 0
    ingresses: int = 1
    num_routers: Optional[int] = None
    app_name: str = "kvroute-bench"
    deployment_name: str = "EngineReplica"
    http_port: int = 8000
    address: Optional[str] = None
    policy_kwargs: dict[str, Any] = field(default_factory=dict)  # the kvroute policy's options



def fleet_from_args(args: Any, **fields: Any) -> FleetConfig:
    """A ``FleetConfig`` from the ``options.add_fleet`` group's values in ``args``, and ``fields``."""
    names = ("replicas", "num_cpus_per_replica", "app_name", "http_port", "address", "policy_kwargs")
    shared = {k: getattr(args, k) for k in names}
    return FleetConfig(**{**shared, **fields})


class Fleet(Protocol):
    """Engine replicas behind one router at a time."""

    kind: str

    def start(self, router: str) -> dict[str, Any]:
        """Serve ``router`` with every cache cold; the run's metadata, with ``base_url``."""

    def counters(self) -> Optional[dict[str, dict[str, float]]]:
        """Per replica, cumulative requests and prompt/cached/output tokens (None: not
        available), so a run's difference shows how the router spread the load."""

    def router_counters(self) -> Optional[dict[str, float]]:
        """kvroute's own cumulative routing counters (decisions by reason, fallbacks,
        predicted and actual cached tokens; None: not available)."""

    def kill_replicas(self, n: int) -> list[str]:
        """SIGKILL-like death of ``n`` replicas mid-run; each comes back empty (Serve
        replaces it; an external fleet restarts the process on the same port)."""

    def add_replicas(self, n: int) -> list[str]:
        """``n`` new empty replicas join the running fleet (scale-out); their ids."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------- Serve fleet
class ServeFleet:
    """One kvroute Serve application whose router is swapped between runs while the
    engine replicas stay up. With ``--ingresses I`` it serves I ingresses: the
    application's own and I - 1 ingress-only applications in front of its engine
    deployment and router actors (``deploy.app.compose_ingress_app``), each at its own
    route prefix, so a client is pinned to one (ARCHITECTURE.md §7); kvroute then runs
    ``--num-routers`` router actors (default I; ``kvroute_1router``: one)."""

    kind = "serve"

    def __init__(self, fleet: FleetConfig, engine_kwargs: dict[str, Any]) -> None:
        self.fleet = fleet
        self.engine_kwargs = engine_kwargs
        self.app_name = fleet.app_name
        self.ingresses = fleet.ingresses
        self.base_urls = [f"http://127.0.0.1:{fleet.http_port}/{self.ingress_app(i)}" for i in range(self.ingresses)]
        self.base_url = self.base_urls[0]
        self.replica_ids: list[str] = []
        self._killed: set[str] = set()  # replicas killed during the run: they report no more counters
        self._control = None  # handle whose request router is kvroute's (addressed calls)
        self._changed = False  # replicas were replaced or added since the last start
        self._starts = 0
        self.initial = fleet.replicas - fleet.add_replicas  # the fleet's size when a run starts
        self.size = self.initial

    @property
    def has_control(self) -> bool:
        """Whether the control handle (built under kvroute's request router) is up."""
        return self._control is not None

    def reuse(self, fleet: FleetConfig) -> None:
        """Run the next comparison on this deployed fleet with ``fleet``'s
        ``add_replicas`` (the rest of ``fleet`` must be this one's)."""
        if dataclasses.replace(fleet, add_replicas=0) != dataclasses.replace(self.fleet, add_replicas=0):
            raise ValueError(f"another fleet: {fleet} is not {self.fleet}")
        initial = fleet.replicas - fleet.add_replicas
        self.fleet, self._changed = fleet, self._changed or initial != self.initial
        self.initial = self.size = initial

    def ingress_app(self, i: int) -> str:
        """The application (and route prefix) of ingress ``i``; 0 is the engines' own."""
        return self.app_name if i == 0 else f"{self.app_name}-ingress{i}"

    def app_args(self, router: str) -> Any:
        from kvroute.deploy.app_config import parse_args, router_choice

        route = router_choice("kvroute" if router == ONE_ROUTER else router)
        num_routers = 1 if router == ONE_ROUTER else self.fleet.num_routers or self.ingresses
        return parse_args({
            "app_name": self.app_name,
            "llm_configs": [{
                "model_loading_config": {"model_id": SERVED_NAME, "model_source": self.fleet.model},
                "engine_kwargs": self.engine_kwargs,
                "deployment_config": {
                    "num_replicas": self.size,
                    "ray_actor_options": {"num_cpus": self.fleet.num_cpus_per_replica},
                    "request_router_config": {"request_router_class": route["request_router_class"]},
                    "max_ongoing_requests": self.fleet.max_ongoing_requests,
                },
                "router_policy": route["router_policy"],
                "router_policy_kwargs": self.fleet.policy_kwargs if route["router_policy"] == "kvroute" else {},
                "num_routers": num_routers,
                "torch_threads": self.fleet.torch_threads,
            }],
            "ingress": {"num_cpus": 0.1},
        })

    def build(self, router: str) -> Any:
        """``deploy.app.compose_app`` with the engine deployment's version pinned, so a
        router swap or a new size only reconfigures the replicas, and the ingress's
        version pinned per start, so a scale-out mid-run keeps the ingress (and the
        requests in flight through it)."""
        from kvroute.cluster.replica_deployment import replica_version
        from kvroute.deploy.app import compose_app

        parsed = self.app_args(router)
        config = parsed.cluster_config()  # hash_seed is set: the same config build_app makes
        # between runs the old ingress is idle: no need to wait out Serve's drain loop
        app = compose_app(parsed, engine_version=replica_version(config), **self._ingress_options(router))
        return app, config

    def _ingress_options(self, router: str) -> dict[str, Any]:
        return {"ingress_version": f"{router}-{self._starts}", "graceful_shutdown_wait_loop_s": 0.2,
                "graceful_shutdown_timeout_s": 5.0}  # fmt: skip

    def deploy(self, router: str) -> None:
        from ray import serve

        from kvroute.deploy.app import compose_ingress_app

        app, config = self.build(router)
        if self._control is not None and config.num_routers != self.config.num_routers:
            # another router count is another engine version (the replicas publish to every
            # router) and other router actors: a clean start
            self._control, self._changed = None, True
        self.config = config
        if self._control is None:
            # a run that was stopped leaves its app and detached actors behind (a router
            # actor with another hash seed would refuse these replicas): start clean
            self.close()
        if router == "prefix_affinity_ray":  # Ray's router keeps its tree in a detached actor
            self._kill_prefix_tree_actor()
        serve.run(app, name=self.app_name, route_prefix=f"/{self.app_name}")
        for i in range(1, self.ingresses):
            extra = compose_ingress_app(self.app_args(router), self.app_name, **self._ingress_options(router))
            serve.run(extra, name=self.ingress_app(i), route_prefix=f"/{self.ingress_app(i)}")
        if self._control is None:
            self._control = serve.get_deployment_handle(self.config.deployment_name, app_name=self.app_name)

    def router_actors(self) -> list[Any]:
        import ray

        from kvroute.cluster.messages import ROUTER_NAMESPACE

        return [ray.get_actor(name, namespace=ROUTER_NAMESPACE) for name in self.config.router_actor_names]

    def router_actor(self) -> Any:
        import ray

        from kvroute.cluster.messages import ROUTER_NAMESPACE

        return ray.get_actor(self.config.router_actor_name, namespace=ROUTER_NAMESPACE)

    def registered(self) -> list[str]:
        import ray

        return sorted(ray.get(self.router_actor().replicas.remote()))

    def wait_registered(self, n: int, timeout_s: float = 120.0) -> list[str]:
        """The router's replicas once there are exactly ``n`` (a scale-down first has to
        retire the extra ones)."""

        def probe() -> Optional[list[str]]:
            ids = self.registered()
            return ids if len(ids) == n else None

        return wait_until(probe, timeout_s, f"the router did not come to {n} registered replicas", 0.2)

    def start(self, router: str) -> dict[str, Any]:
        """Deploy ``router`` and make every replica and router state cold."""
        import ray

        from kvroute.cluster.messages import ReplicaCall
        from kvroute.deploy.app_config import router_choice

        t0 = time.perf_counter()
        self._starts += 1
        self.size, self._killed = self.initial, set()
        self.deploy(router)
        t_deploy = time.perf_counter() - t0
        ids = self.wait_registered(self.size)
        if not self.replica_ids or self._changed:
            self.replica_ids, self._changed = ids, False
        elif ids != self.replica_ids:
            raise RuntimeError(f"the replicas changed across a router swap: {self.replica_ids} -> {ids}")

        async def reset_all() -> list[dict[str, Any]]:
            out = []
            for rid in self.replica_ids:
                for attempt in range(50):  # a replica still finishing or being reconfigured
                    try:
                        r = await asyncio.wait_for(self._control.reset_prefix_cache.remote(ReplicaCall(rid)), 30)
                    except Exception:
                        if attempt == 49:
                            raise
                        await asyncio.sleep(0.2)
                        continue
                    if r["reset"]:
                        out.append(r)
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"replica {rid} kept blocks in use: cannot reset its prefix cache")
            return out

        resets = asyncio.run(reset_all())
        assert sorted(r["replica_id"] for r in resets) == self.replica_ids, resets
        policy = router_choice("kvroute" if router == ONE_ROUTER else router)["router_policy"]
        kwargs = self.fleet.policy_kwargs if policy == "kvroute" else {}  # (as deployed: a reset keeps them)
        ray.get([actor.reset.remote(policy, kwargs) for actor in self.router_actors()])
        after = self.wait_registered(self.size)
        assert after == self.replica_ids, (after, self.replica_ids)
        for rid in self.replica_ids:  # the directory starts empty
            assert ray.get(self.router_actor().directory.remote(rid)) == [], rid
        t_reset = time.perf_counter() - t0 - t_deploy
        self._router = router
        for url in self.base_urls:  # as many warm-up requests in all as with one ingress
            warm_up(url, -(-self.size // self.ingresses))
        time.sleep(1.5)  # the warm-up reaches the replicas' metrics reports before the run's baseline
        return {"fleet": self.kind, "base_url": self.base_url, "base_urls": list(self.base_urls),
                "replica_ids": list(self.replica_ids), "num_routers": self.config.num_routers,
                "prepare_s": time.perf_counter() - t0, "deploy_s": t_deploy, "reset_s": t_reset}  # fmt: skip

    def counters(self) -> dict[str, dict[str, float]]:
        """Once every replica still alive has reported (a killed one never will again)."""
        return wait_counters(self.base_url, [rid for rid in self.replica_ids if rid not in self._killed])

    def router_counters(self) -> dict[str, float]:
        """The application's counters (any ingress's ``/metrics`` sums every ingress),
        and ``ingress<i>:routed_requests``: the requests the ingress behind
        ``base_urls[i]`` (application ``<app>`` or ``<app>-ingress<i>``) finished."""
        out = router_counters(self.base_url)
        per_app = ingress_requests(self.base_url)
        for i, url in enumerate(self.base_urls):
            app = url.rstrip("/").rsplit("/", 1)[-1]
            out[f"ingress{i}:routed_requests"] = per_app.get(app, 0.0)
        return out

    def peer_staleness_ms(self) -> dict[str, float]:
        """The routers' peer staleness now (``kvroute:router_peer_staleness_seconds``:
        the age of the other routers' decisions on arrival, over each router's latest
        2,048): the worst router's p50 and p99 in ms; empty with one router."""
        return peer_staleness_ms(self.base_urls[0])

    def kill_router(self) -> str:
        """SIGKILL-like death of the busiest router actor (most decisions so far), not
        restarted: the ingresses that asked it fail over to the others. Its name."""
        import ray

        decided = [sum(s["decisions_by_reason"].values()) for s in ray.get([a.stats.remote() for a in self.router_actors()])]
        name = self.config.router_actor_names[decided.index(max(decided))]
        from kvroute.cluster.router_lookup import kill_router_actor

        kill_router_actor(name)
        self._control, self._changed = None, True  # the next run starts clean, every router anew
        return name

    def kill_replicas(self, n: int) -> list[str]:
        import ray

        victims = self.replica_ids[:n]
        for uid in victims:
            name = f"SERVE_REPLICA::{self.app_name}#{self.config.deployment_name}#{uid}"
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        self._changed = True
        self._killed.update(victims)
        return victims

    def add_replicas(self, n: int) -> list[str]:
        """Redeploy the running app with ``n`` more engine replicas: both versions are
        the same, so Serve only starts the new replicas."""
        from ray import serve

        old = set(self.replica_ids)
        self.size += n
        app, _ = self.build(self._router)
        serve.run(app, name=self.app_name, route_prefix=f"/{self.app_name}")
        ids = self.wait_registered(self.size)
        self.replica_ids, self._changed = ids, True
        return [rid for rid in ids if rid not in old]

    def _kill_prefix_tree_actor(self) -> None:
        import ray

        namespace = f"serve::{self.app_name}::{self.fleet.deployment_name}"
        try:
            ray.kill(ray.get_actor("LlmPrefixTreeActor", namespace=namespace), no_restart=True)
        except ValueError:
            pass

    def close(self) -> None:
        from ray import serve

        from kvroute.cluster.router_lookup import kill_router_actors

        try:
            running = serve.status().applications
            for app in [self.ingress_app(i) for i in range(1, self.ingresses)] + [self.app_name]:
                if app in running:  # the extra ingresses first: they hold handles to the engines
                    serve.delete(app)
        finally:
            kill_router_actors(self.app_name)
            self._kill_prefix_tree_actor()
