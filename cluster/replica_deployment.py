"""The engine replica as a Ray Serve deployment: one ``AsyncEngine`` per replica actor.

Tokens stream back through Serve's streaming responses (``generate`` is an async
generator; callers use ``handle.options(stream=True)``). A caller that goes away cancels
the generator, which aborts the request and frees its blocks. Alongside, one publisher
task per router actor reports KV events + load to it: at most one message in flight,
every step finished meanwhile folded into the next, a heartbeat when idle, and a fresh
registration with a snapshot of the cache whenever that router does not know this
replica (first start, router restart) or saw a gap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.fleet_moves import FleetMoves, imported
from kvroute.cluster.kv_pull import PULL_TIMEOUT_S, PullResult, export_payload, pull_prefix
from kvroute.cluster.lora import ReplicaAdapters, get_or_create_lora_registry
from kvroute.cluster.messages import FirstDelta, GenerateRequest, ReplicaCall
from kvroute.cluster.publisher import EventPublisher
from kvroute.cluster.route_pull import RoutePuller
from kvroute.cluster.router_actor import get_or_create_router_actors
from kvroute.replica.config import EngineConfig
from kvroute.replica.kv_events import KVEvents
from kvroute.replica.outputs import TokenDelta
from kvroute.router.types import RouteDecision, RouteOutcome

if TYPE_CHECKING:  # torch stays out of the processes that only hold a handle (the ingress)
    from kvroute.replica.async_engine import AsyncEngine
    from kvroute.replica.kv_payload import KVPayload

log = logging.getLogger(__name__)


LORA_SYNC_S = 1.0  # how often a replica matches its adapters to the application's registry
EngineFactory = Callable[[EngineConfig], Awaitable["AsyncEngine"]]


async def model_engine(config: EngineConfig, torch_threads: int | None = None) -> "AsyncEngine":
    """The default engine of a replica: the model of ``config`` on this process's device
    (loaded in a thread, so the actor's event loop keeps answering Serve), or its
    emulation (``config.emulate``: no torch in the replica)."""
    from kvroute.replica.async_engine import AsyncEngine
    from kvroute.replica.console_log import log_info_to_stderr
    from kvroute.replica.engine import Engine

    log_info_to_stderr()  # the engine's start-up line (its KV cache size) in the replica's log
    if torch_threads is not None and config.emulate is None:
        import torch

        torch.set_num_threads(torch_threads)
    return AsyncEngine(await asyncio.to_thread(Engine, config))


class _RouterLink:
    """What one replica sends one router actor: its own ``EventPublisher`` (so each
    router numbers this replica's batches on its own, and a router that restarts gets a
    snapshot while the others go on), at most one message in flight, a heartbeat when
    idle, and a fresh registration whenever that router does not know the replica or
    saw a gap. A router standing by (one that has not ranked lately: the ingresses ask
    the first router while it keeps up) answers a push with how long it can wait
    (``standby_push_s``); unless it is this replica's first router that answers, the
    link then holds its changes that long, folding them into one push: feeding every
    router every change costs replicas and routers CPU for views nobody reads.
    """

    def __init__(self, replica: "EngineReplica", actor: Any) -> None:
        self.replica, self.actor = replica, actor
        self.publisher = EventPublisher(replica.replica_id)
        self.changed = asyncio.Event()
        self.registered = False
        self.refused: str | None = None  # why the router refused this replica (logged once)

    def add(self, events: KVEvents) -> None:
        self.publisher.add(events)
        if self.publisher.has_changes:
            self.changed.set()

    async def register(self) -> None:
        r, e = self.replica, self.replica.engine
        hashes, host_hashes, load, seq = await e.cache_snapshot(self.publisher.snapshot_seq)
        call = self.actor.register.remote(r.replica_id, e.hash_spec, e.num_kv_blocks, hashes, seq, load,
                                          e.num_host_kv_blocks, host_hashes)  # fmt: skip
        try:
            await asyncio.wait_for(call, r.config.call_timeout_s)
        except ValueError as exc:  # refused (Ray wraps the router's ValueError): say so, once
            reason = str(getattr(exc, "cause", None) or exc)
            if reason != self.refused:
                log.warning("replica %s: a router refused its registration: %s", r.replica_id, reason)
            self.refused = reason
            raise
        self.refused = None
        self.registered = True
        r.counters["registrations"] += 1

    async def publish_loop(self) -> None:
        r = self.replica
        while not r.closing:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=r.config.heartbeat_s)
            except asyncio.TimeoutError:
                pass  # heartbeat: the router learns this replica is alive
            self.changed.clear()
            if r.closing:
                return
            try:
                if not self.registered:
                    await self.register()
                    continue
                ok = await asyncio.wait_for(self.actor.push.remote(self.publisher.take()), r.config.call_timeout_s)
                r.counters["pushes"] += 1
                if not ok:  # unknown to the router (it restarted) or a gap: resend everything
                    self.registered = False
                    self.changed.set()
                    continue
                if ok is not True and r.first_router() is not self:  # a standby: fold changes meanwhile
                    await asyncio.sleep(float(ok))
                elif r.config.push_interval_s:  # fold what comes meanwhile into the next push
                    await asyncio.sleep(r.config.push_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # router down, restarting or refusing: register again later
                self.registered = False
                r.counters["push_failures"] += 1
                if self.refused is None:
                    log.info("replica %s: router unreachable (%r); retrying", r.replica_id, exc)
                await asyncio.sleep(r.config.heartbeat_s if self.refused is not None else min(r.config.heartbeat_s, 0.2))


class EngineReplica:
    """One Serve replica around one ``AsyncEngine``. ``engine_factory(engine_config)``
    builds the engine (default: ``model_engine``); tests and other engines pass their own."""

    async def __init__(self, config: ClusterConfig, engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        engine_config = dataclasses.replace(config.engine, replica_id=self.replica_id,
                                            max_requests=config.max_ongoing_requests)  # fmt: skip
        if engine_factory is None:
            self.engine = await model_engine(engine_config, config.torch_threads_per_replica)
        else:
            self.engine = await engine_factory(engine_config)
        if self.engine.hash_spec != config.hash_spec:
            raise ValueError(f"engine hash spec {self.engine.hash_spec} differs from the cluster's {config.hash_spec}")
        handle = lambda: serve.get_deployment_handle(config.deployment_name, config.app_name)  # noqa: E731
        self.puller = RoutePuller(self.replica_id, self.engine, handle)
        self.fleet = FleetMoves(self.replica_id, self.engine, handle, config.fleet_prefixes, config.call_timeout_s)
        self.closing = False
        self.counters = {"pushes": 0, "registrations": 0, "push_failures": 0}
        self.links = [_RouterLink(self, actor) for actor in get_or_create_router_actors(config)]
        self.engine.add_event_listener(self._on_events)
        self.adapters: ReplicaAdapters | None = None
        if config.engine.enable_lora:  # the application's adapters, before any request comes
            self.adapters = ReplicaAdapters(self.engine, get_or_create_lora_registry(config), config.engine.max_cpu_loras)
            await self.adapters.sync()
        # traffic routed by the directory can come at once: every router knows this replica
        await asyncio.gather(*(asyncio.wait_for(link.register(), 2 * config.call_timeout_s) for link in self.links),
                             return_exceptions=True)  # fmt: skip
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(link.publish_loop()) for link in self.links]
        self._tasks.append(loop.create_task(self._metrics_loop()))
        if self.adapters is not None:
            self._tasks.append(loop.create_task(self._lora_loop()))
        await self.fleet.warm_up(self.links[0].actor)  # the fleet's hottest prefixes, before any request

    def first_router(self) -> _RouterLink | None:
        """The link to the first router this replica is registered with: the one the
        ingresses ask first, fed every change even while it stands by."""
        return next((link for link in self.links if link.registered), None)

    # ------------------------------------------------------------------ serving
    async def generate(
        self, request: GenerateRequest, route: RouteDecision | None = None
    ) -> AsyncIterator[FirstDelta | TokenDelta]:
        """Stream ``request``'s deltas, the first as a ``FirstDelta`` that says where it
        ran. ``route``: the router's decision, added to the call by the caller's kvroute
        request router (None under Serve's own routers); its ticket goes to the engine,
        whose load reports name the highest ticket they count. A decision naming a
        ``pull_from`` has this replica pull the prefix from there first, and a request
        whose prefix a pull here is bringing waits for it (``route_pull.py``; on any
        failure the request recomputes it)."""
        if request.lora_name is not None and self.adapters is not None:
            await self.adapters.ensure(request.lora_name)  # loaded on first use here
        pulled = await self.puller.before_generate(request, route)
        outcome: RouteOutcome | None = RouteOutcome(self.replica_id, route, pulled_tokens=pulled)
        async for delta in self.engine.generate(
            request.token_ids,
            request.params,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            resume_output=request.resume_output,
            route_ticket=0 if route is None else route.ticket,
            lora_name=request.lora_name,
        ):
            if outcome is None:
                yield delta
            else:
                yield FirstDelta(outcome, delta)
                outcome = None

    async def debug_state(self, call: ReplicaCall) -> dict[str, Any]:
        """This replica's exact cache and block state (for tests and operators)."""
        assert call.replica_id == self.replica_id, f"{call} reached {self.replica_id}"
        state = await self.engine.debug_state()
        return {"replica_id": self.replica_id, **state, "publisher_seq": self.links[0].publisher.seq,
                "loras": list(await self.engine.list_loras()), **self.counters,
                "kv_transfer": self.engine.engine.kv_transfer.metrics.report()}  # fmt: skip

    async def load_lora(self, name: str, path: str) -> None:
        """Load an adapter here (the ingress has one replica check a new folder before the
        registry lists it; ValueError naming the file and field when it is bad)."""
        if self.adapters is None:
            raise ValueError("this application runs without LoRA adapters (set enable_lora or lora_config)")
        await self.adapters.load_lora(name, path)

    async def reset_prefix_cache(self, call: ReplicaCall) -> dict[str, Any]:
        """Forget every cached block (between benchmark runs, so each starts cold); only
        possible while no request holds a block. The routers learn it from the next
        snapshot or from the ``cleared`` flag of the next event batch."""
        assert call.replica_id == self.replica_id, f"{call} reached {self.replica_id}"
        return {"replica_id": self.replica_id, "reset": await self.engine.reset_prefix_cache()}

    async def export_kv(
        self, call: ReplicaCall, token_ids: list[int] | None, cache_salt: str | None = None,
        lora_name: str | None = None, max_blocks: int | None = None, block_hashes: list[int] | None = None,
    ) -> "KVPayload":
        """The KV of the longest run of ``token_ids``'s full blocks this replica caches (or
        of the chain ``block_hashes``, a hot prefix's name in the router's plans), as one
        payload (``cluster/kv_pull.py``; its ``nbytes`` is what crosses the object store)."""
        assert call.replica_id == self.replica_id, f"{call} reached {self.replica_id}"
        return await export_payload(self.engine, token_ids, cache_salt, lora_name, max_blocks, block_hashes)

    async def import_kv(self, call: ReplicaCall, payload: "KVPayload", timeout_s: float = PULL_TIMEOUT_S) -> PullResult:
        """Cache a payload another replica sends (a leaving replica's hand-off:
        ``fleet_moves.py``), checked and bounded as a pull's import."""
        assert call.replica_id == self.replica_id, f"{call} reached {self.replica_id}"
        return await imported(self.engine, payload, timeout_s)

    async def pull_kv(
        self, call: ReplicaCall, source_replica_id: str, token_ids: list[int], cache_salt: str | None = None,
        lora_name: str | None = None, timeout_s: float = PULL_TIMEOUT_S,
    ) -> PullResult:
        """Pull the prefix ``token_ids`` from replica ``source_replica_id`` (its
        ``export_kv``, addressed through this application's handle) into this replica's
        cache within ``timeout_s``; a ``PullResult`` with a fallback when the caller must
        recompute (nothing imported then)."""
        assert call.replica_id == self.replica_id, f"{call} reached {self.replica_id}"
        if lora_name is not None and self.adapters is not None:
            await self.adapters.ensure(lora_name)  # its KV is refused where the adapter is not loaded
        handle = serve.get_deployment_handle(self.config.deployment_name, self.config.app_name)
        source = ReplicaCall(source_replica_id)
        return await pull_prefix(self.engine, lambda: handle.export_kv.remote(source, token_ids, cache_salt, lora_name),
                                 timeout_s)  # fmt: skip

    async def check_health(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"engine step loop died: {self.engine.failure!r}")

    async def __del__(self) -> None:
        """Graceful shutdown (Serve calls this after draining): hand the hottest prefixes
        held here to survivors (``fleet_moves.py``), then leave the directories."""
        self.closing = True
        await self.fleet.hand_off(self.links[0].actor, self.config.app_name, self.config.graceful_shutdown_timeout_s / 2)
        for link in self.links:
            link.changed.set()
        calls = [asyncio.wait_for(link.actor.remove_replica.remote(self.replica_id), timeout=2.0) for link in self.links]
        for exc in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(exc, BaseException):  # a router may be gone too; it expires silent replicas
                log.warning("replica %s could not unregister from a router: %r", self.replica_id, exc)

    # ------------------------------------------------------------------ events
    def _on_events(self, events: KVEvents) -> None:
        for link in self.links:
            link.add(events)

    async def _lora_loop(self) -> None:
        assert self.adapters is not None
        while not self.closing:
            await asyncio.sleep(LORA_SYNC_S)
            try:
                await self.adapters.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # registry restarting: the next round retries
                log.debug("replica %s: LoRA sync failed (%r)", self.replica_id, exc)

    async def _metrics_loop(self) -> None:
        """Send this replica's metrics report (engine figures + latency histograms) to
        every router actor about once a second, where the HTTP ingresses read them."""
        period = max(1.0, self.config.heartbeat_s)
        while not self.closing:
            await asyncio.sleep(period)
            try:
                report = {**await self.engine.metrics_report(), "node": self.node}
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("replica %s: metrics report failed (%r)", self.replica_id, exc)
                continue
            # to every router at once: one that is slow or restarting must not hold back the others' view
            await asyncio.gather(*(self._send_metrics(link, report) for link in self.links))

    async def _send_metrics(self, link: _RouterLink, report: dict) -> None:
        try:
            await asyncio.wait_for(link.actor.report_metrics.remote(self.replica_id, report), self.config.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # router restarting: the next round retries
            log.debug("replica %s: metrics report failed (%r)", self.replica_id, exc)


def request_router_config(config: ClusterConfig) -> RequestRouterConfig:
    if config.request_router == "kvroute":
        from kvroute.cluster.request_router import KVRouteRequestRouter

        return RequestRouterConfig(
            request_router_class=KVRouteRequestRouter,
            request_router_kwargs={
                "router_actor_names": config.router_actor_names,
                "timeout_s": config.router_timeout_s,
            },
        )
    if config.request_router == "prefix_affinity_ray":
        # The implementation module of Ray's public ray.serve.llm.request_router alias:
        # importing the alias requires vLLM or SGLang, the router itself needs neither.
        return RequestRouterConfig(
            request_router_class="ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
        )
    return RequestRouterConfig()  # Serve's default: power of two choices


def replica_version(config: ClusterConfig) -> str:
    """A Serve deployment ``version`` for ``config``: its generation, which ignores the
    scaling and router fields, so redeploying with only those changed (another
    ``request_router_config`` or ``router_policy``) keeps the running replicas and their
    caches (Serve only reconfigures them), while any engine change gives new replicas."""
    return config.generation


def build_engine_deployment(
    config: ClusterConfig, version: str | None = None, engine_factory: EngineFactory | None = None,
    replica_class: type = EngineReplica, extra_args: tuple = (),
) -> serve.Application:
    """The replica deployment bound to ``config`` (run it with ``serve.run``).

    ``version`` (e.g. :func:`replica_version`) pins Serve's code version: without it
    every ``serve.run`` replaces every replica, since ``serve.run`` draws a random
    version for a deployment that has none. With it, Serve compares only the version
    and the deployment options: the init args (``config``) of running replicas are
    kept as they were, which is why the version must cover every field they use.
    ``replica_class``: ``EngineReplica`` or a subclass (the direct path's, which also
    serves HTTP), given ``extra_args`` after the config and factory."""
    options: dict[str, Any] = {
        "name": config.deployment_name,
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "ray_actor_options": {"num_cpus": config.num_cpus_per_replica, "num_gpus": config.num_gpus_per_replica},
        "request_router_config": request_router_config(config),
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config
    else:
        options["num_replicas"] = config.num_replicas
    # Replicas get the config with the scaling fields neutral: a change of replica count
    # must not look like new code to Serve (which would replace every replica).
    replica_config = dataclasses.replace(config, num_replicas=1, autoscaling_config=None)
    deployment = serve.deployment(replica_class).options(**options)
    if version is not None:
        # Ray 2.60 took `version` out of the public options; Serve itself still sets it
        # this way (a second call, so the user-configured option names stay as above).
        deployment = deployment.options(_internal=True, version=version)
    return deployment.bind(replica_config, engine_factory, *extra_args)
