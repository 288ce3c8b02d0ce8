"""The router actors: ``ClusterConfig.num_routers`` named Ray actors per application,
each around a plain ``Router`` with the whole directory.

``RouterService`` holds the state and is what tests build without Ray; ``RouterActor``
is it as a Ray actor (``max_restarts=-1``: a killed router comes back empty and is
refilled by the replicas' snapshots, since every replica reports at least once per
heartbeat and re-registers when the router does not know it).

Replicas ``register`` (with their HashSpec: a mismatch is refused) and then ``push``
coalesced KV events to every router; a Serve request router calls ``rank`` on one
router per request. Each router hands its decisions to the others (``share``: batched,
with its next call at least ``PEER_FLUSH_S`` after the last batch, and otherwise by a
flusher thread ``PEER_FLUSH_S`` after a decision was queued), which apply them
as their own (``note_peer_decisions``: pending blocks and load increments under the
decision's ticket), so N routers place like one; ``stats()["peer_staleness_ms"]`` is
how old a peer's decision was when it arrived.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import ray

from kvroute.replica.block_hash import BlockHash, HashSpec
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.replica.request_metrics import process_figures
from kvroute.router.router import Router
from kvroute.router.types import RouteDecision

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import ROUTER_NAMESPACE
from kvroute.cluster.router_follow import ChangeLog, PeerDecision, Reply, peer_decision
from kvroute.cluster.router_choice import LOAD_SAMPLE_S

log = logging.getLogger(__name__)

ACTIVE_S = 5.0  # a router that ranked within this long is deciding; else it stands by
PEER_FLUSH_S = 0.002  # a router sends its peers its decisions at least this often while it decides


class RouterService:
    def __init__(
        self,
        hash_spec: HashSpec,
        policy: str = "kvroute",
        policy_kwargs: dict[str, Any] | None = None,
        replica_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        share: Callable[[list[PeerDecision]], None] | None = None,
        standby_push_s: float = 0.0,
    ) -> None:
        self.hash_spec = hash_spec
        self.policy, self.policy_kwargs = policy, dict(policy_kwargs or {})
        self.router = Router(policy, hash_spec.block_size, clock=clock, **self.policy_kwargs)
        self.replica_timeout_s = replica_timeout_s
        self.clock = clock
        self._last_seen: dict[str, float] = {}
        self._next_expiry_check = 0.0
        self.started_at = clock()
        self.standby_push_s = standby_push_s
        self._last_rank = float("-inf")
        self.counters = {"registrations": 0, "expired_replicas": 0, "removed_replicas": 0, "unregistered_routes": 0,
                         "pushes": 0, "warmup_plans": 0, "warmup_moves": 0, "handoff_plans": 0, "handoff_moves": 0}  # fmt: skip
        self._metrics: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (when, its latest report)
        self._ingresses: dict[str, tuple[float, dict[str, Any]]] = {}  # ingress id -> (when, its latest report)
        self._share = share
        self._share_lock = threading.Lock()
        self._outbox: list[PeerDecision] = []
        self._queued = threading.Event()  # set when a decision waits in the outbox (wakes the flusher)
        self._last_share = 0.0
        self._staleness_s: deque[float] = deque(maxlen=2048)  # age of the peers' decisions on arrival
        self._load, self._load_at, self._load_cpu = 0.0, time.monotonic(), time.process_time()
        self.last_call = time.monotonic()  # the last call of a replica, worker pool or ingress
        self.refused: dict[str, str] = {}  # replica id -> why its registration was refused
        self.changes = ChangeLog(clock)  # what followers replay (``router_follow.py``)

    def reset(self, policy: str | None = None, policy_kwargs: dict[str, Any] | None = None) -> None:
        """Start over with an empty directory (and optionally another policy): every
        replica's next push is refused, so it registers again with a fresh snapshot, and
        the ingresses' counters are forgotten (a live ingress sends its totals again within
        a second; one of a replaced application never does, so its counts cannot drop out
        of the sums in the middle of the next run). Benchmarks call this between runs so
        that each router starts cold."""
        if policy is not None:
            self.policy, self.policy_kwargs = policy, dict(policy_kwargs or {})
        self.router = Router(self.policy, self.hash_spec.block_size, clock=self.clock, **self.policy_kwargs)
        self._last_seen.clear()
        self._metrics.clear()
        self._staleness_s.clear()
        self._ingresses.clear()
        self.changes.restart()

    # ------------------------------------------------------------------ replicas
    def register(
        self,
        replica_id: str,
        hash_spec: HashSpec,
        capacity_blocks: int,
        block_hashes: Sequence[BlockHash],
        seq: int,
        load: LoadFigures | None = None,
        host_capacity_blocks: int = 0,
        host_hashes: Sequence[BlockHash] = (),
    ) -> None:
        """Add (or refresh) a replica with a snapshot of its cache (both tiers) as of
        event ``seq``. ValueError (and the replica listed in ``health()``) when it hashes
        blocks otherwise than this router."""
        self.last_call = time.monotonic()
        if hash_spec != self.hash_spec:
            self.refused[replica_id] = (
                f"replica {replica_id} hashes blocks with {hash_spec}, but this router expects "
                f"{self.hash_spec}: every replica of an application must use the same model, "
                "block_size and hash_seed"
            )
            log.warning("%s", self.refused[replica_id])
            raise ValueError(self.refused[replica_id])
        self.refused.pop(replica_id, None)
        reg = (replica_id, capacity_blocks, host_capacity_blocks, list(block_hashes), list(host_hashes), seq, load)
        self.router.register_snapshot(*reg)
        self.changes.record("reg", *reg)
        self._last_seen[replica_id] = self.clock()
        self.counters["registrations"] += 1

    def push(self, batch: KVEvents) -> bool | float:
        """Apply one coalesced batch. False: the router does not know this replica or
        saw a gap in its ``seq``; the replica must ``register`` again with a snapshot.
        Else True, or, from a router standing by (it has not ranked for ``ACTIVE_S``),
        ``standby_push_s``: the replica may hold its next changes that long."""
        self._flush_peers(force=True)
        self.counters["pushes"] += 1
        self.last_call = time.monotonic()
        rid = batch.replica_id
        if rid not in self.router.directory:
            return False
        self._last_seen[rid] = self.clock()
        self.changes.record("push", batch)
        if not self.router.apply(batch):
            return False
        if self.standby_push_s > 0 and self.clock() - self._last_rank >= ACTIVE_S:
            return self.standby_push_s
        return True

    def report_load(self, replica_id: str, load: LoadFigures) -> bool:
        """An external worker's load figures (``cluster/worker_pool.py`` polls its
        ``/metrics``); it counts as a sign of life. False: unknown here, register it."""
        self.last_call = time.monotonic()
        if not self.router.report_load(replica_id, load):
            return False
        self.changes.record("load", replica_id, load)
        self._last_seen[replica_id] = self.clock()
        return True

    def remove_replica(self, replica_id: str) -> bool:
        self._last_seen.pop(replica_id, None)
        self._metrics.pop(replica_id, None)
        if replica_id not in self.router.directory:
            return False
        self.router.remove_replica(replica_id)
        self.changes.record("remove", replica_id)
        self.counters["removed_replicas"] += 1
        return True

    def warmup_plan(self, replica_id: str, k: int = 8, max_blocks: int = 1024) -> list[tuple[list[BlockHash], str]]:
        """The hottest prefixes a joining replica should pull before it serves, each with
        the replica to pull it from (``router/hot_prefixes.py``)."""
        self.last_call = time.monotonic()
        plan = self.router.warmup_plan(replica_id, k, max_blocks)
        self.counters["warmup_plans"] += 1
        self.counters["warmup_moves"] += len(plan)
        return plan

    def handoff_plan(self, replica_id: str, k: int = 8) -> list[tuple[list[BlockHash], str]]:
        """The hottest prefixes a leaving replica holds deeper than every survivor, each
        with the survivor to hand it to (``router/hot_prefixes.py``)."""
        self.last_call = time.monotonic()
        plan = self.router.handoff_plan(replica_id, k) if replica_id in self.router.directory else []
        self.counters["handoff_plans"] += 1
        self.counters["handoff_moves"] += len(plan)
        return plan

    def _expire_silent(self) -> None:
        now = self.clock()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + min(1.0, self.replica_timeout_s / 4)
        for rid, seen in list(self._last_seen.items()):
            if now - seen > self.replica_timeout_s:
                log.warning("replica %s silent for %.1f s: dropped from the directory", rid, now - seen)
                self.remove_replica(rid)
                self.counters["expired_replicas"] += 1

    # ------------------------------------------------------------------ routing
    def load(self) -> float:
        """The router process's CPU use, in cores, over the last interval of at least
        ``LOAD_SAMPLE_S`` (every thread of it: the calls Ray runs, their (de)serializing,
        the peer flusher). A Python router saturates near one core, so the ingresses pass
        it over from ``router_choice.BUSY_LOAD``."""
        now = time.monotonic()
        if now - self._load_at >= LOAD_SAMPLE_S:
            cpu = time.process_time()
            self._load = (cpu - self._load_cpu) / (now - self._load_at)
            self._load_at, self._load_cpu = now, cpu
        return self._load

    def rank(
        self, block_hashes: Sequence[BlockHash], num_tokens: int, candidates: Sequence[str], lora_name: str | None = None
    ) -> RouteDecision:
        """Decide for one request (of LoRA adapter ``lora_name``): the choice, then the
        other ``candidates`` to try, by load (``fallbacks``); unknown candidates (not
        registered yet, e.g. a replica that just started) go last, in random order."""
        self._last_rank = self.clock()
        self.last_call = time.monotonic()
        self._expire_silent()
        known, unknown = self.router.directory.known(candidates)
        random.shuffle(unknown)
        if not known:
            self.counters["unregistered_routes"] += 1
            return RouteDecision(unknown[0], 0, "unregistered", fallbacks=unknown[1:], router_load=self.load())
        decision = self.router.route(block_hashes, num_tokens, known, lora_name=lora_name)
        taken = [peer_decision(decision, block_hashes, num_tokens, lora_name)]
        self.changes.record("peer", None, taken)  # followers see it as a peer's
        self._share_out(taken)
        # the Router's fresh decision, completed with what the caller tries next
        return dataclasses.replace(decision, fallbacks=[*self.router.fallbacks(known, decision.replica_id), *unknown],
                                   router_load=self.load())  # fmt: skip

    # ------------------------------------------------------------------ peers
    def _share_out(self, batch: list[PeerDecision]) -> None:
        """Queue decisions taken in this router's name for the other router actors."""
        if self._share is None:
            return
        self._outbox.extend(batch)
        self._flush_peers()
        if self._outbox:
            self._queued.set()

    def _flush_peers(self, force: bool = False) -> None:
        if not self._outbox:
            return
        with self._share_lock:  # the flusher thread and the actor's calls
            now = self.clock()
            if self._outbox and (force or now - self._last_share >= PEER_FLUSH_S or len(self._outbox) >= 64):
                batch, self._outbox, self._last_share = self._outbox, [], now
                self._share(batch)  # type: ignore[misc]

    def start_flusher(self, period_s: float = PEER_FLUSH_S) -> None:
        """Send buffered decisions ``period_s`` after they were queued from a daemon
        thread too, so the last ones before a lull do not wait for this router's next
        call. The thread sleeps while the outbox is empty (no wake-ups when idle)."""

        def loop() -> None:
            while True:
                self._queued.wait()
                time.sleep(period_s)
                self._queued.clear()
                self._flush_peers(force=True)

        threading.Thread(target=loop, name="kvroute-peer-flush", daemon=True).start()

    def note_peer_decisions(self, batch: list[PeerDecision], source: str | None = None) -> int:
        """Apply another router's (or follower ``source``'s) decisions; returns how many
        named a known replica."""
        self._flush_peers()
        self.changes.record("peer", source, batch)
        now = time.time()
        self._staleness_s.extend(max(now - d[4], 0.0) for d in batch)
        return self.router.note_peer_batch(batch)

    def follow(self, follower_id: str, epoch: str | None, seq: int, decisions: list[PeerDecision],
               counts: tuple[dict[str, int], dict[str, int]]) -> Reply:  # fmt: skip
        """A follower's call (``router_follow.py``): apply and share the decisions it took
        since its last call (counted as this router's), then answer the changes after its
        cursor, or the registrations to start over from."""
        self.last_call = time.monotonic()
        self._last_rank = self.clock()  # its followers decide for it: not standing by
        self._expire_silent()
        if decisions:
            self.note_peer_decisions(decisions, follower_id)
            self.router.count_decisions(*counts)
            self._share_out(decisions)
        ops = self.changes.since(epoch, seq)
        if ops is not None:
            return self.changes.epoch, self.changes.seq, ops, None
        start = (self.policy, self.policy_kwargs, self.hash_spec.block_size, self.router.registrations())
        return self.changes.epoch, self.changes.seq, [], start

    def _staleness(self) -> dict[str, float]:
        ages = sorted(self._staleness_s)
        if not ages:
            return {}
        return {"p50": 1e3 * statistics.median(ages), "p99": 1e3 * ages[min(len(ages) - 1, int(0.99 * len(ages)))]}

    # ------------------------------------------------------------------ lifecycle
    def adopt(self, policy: str, policy_kwargs: dict[str, Any] | None = None) -> bool:
        """Route with ``policy`` from now on, keeping the directory and the load view (a
        redeploy that changes only the policy keeps every replica and its cache). A
        change of the Router's own settings (``pending_ttl_s``) starts it over like
        ``reset``. True when something changed."""
        kwargs = dict(policy_kwargs or {})
        if (policy, kwargs) == (self.policy, self.policy_kwargs):
            return False
        if kwargs.get("pending_ttl_s") != self.policy_kwargs.get("pending_ttl_s"):
            self.reset(policy, kwargs)
        else:
            self.router.set_policy(policy, kwargs)
            self.policy, self.policy_kwargs = policy, kwargs
            self.changes.restart()  # followers start over with the new policy
        log.warning("router now routes with policy %s %s", policy, kwargs)
        return True

    def health(self) -> dict[str, Any]:
        """What ``/health`` shows of this router: its replicas, and those it refused."""
        self.last_call = time.monotonic()
        self._expire_silent()
        return {"replicas": len(self.router.replicas()), "refused": dict(self.refused), "policy": self.policy}

    # ------------------------------------------------------------------ introspection
    def replicas(self) -> list[str]:
        return list(self.router.replicas())

    def directory(self, replica_id: str) -> list[BlockHash]:
        """The hashes the directory holds for ``replica_id`` as confirmed by its events."""
        return [BlockHash(h) for h in self.router.directory.confirmed(replica_id)]

    def stats(self) -> dict[str, Any]:
        return {
            **self.router.stats(),
            **self.counters,
            "peer_staleness_ms": self._staleness(),
            "followed_changes": self.changes.seq,
            "cpu_load": round(self.load(), 4),
            "uptime_s": self.clock() - self.started_at,
            "process": process_figures(),
        }

    # ------------------------------------------------------------------ metrics
    def report_metrics(self, replica_id: str, report: dict[str, Any]) -> bool:
        """Keep a registered replica's latest metrics report (``AsyncEngine.metrics_report``)."""
        if replica_id not in self.router.directory:
            return False
        self._metrics[replica_id] = (time.monotonic(), report)
        return True

    def report_ingress(self, ingress_id: str, report: dict[str, Any]) -> None:
        """An ingress's own counters (``deploy/metrics.py``'s ``ingress_report``), about
        once a second; also its sign of life."""
        self.last_call = time.monotonic()
        self._ingresses[ingress_id] = (self.last_call, report)

    def metrics(self) -> dict[str, Any]:
        """Every registered replica's latest metrics report (with its age here,
        ``age_s``: an ingress that asks several routers keeps the freshest), every live
        ingress's counters and the router's stats: what an HTTP ingress renders at
        ``/metrics``. An ingress silent for ``replica_timeout_s`` is dropped (its counts
        with it)."""
        self._expire_silent()
        now = time.monotonic()
        for iid, (when, _) in list(self._ingresses.items()):
            if now - when > self.replica_timeout_s:
                del self._ingresses[iid]
        replicas = {rid: {**rep, "age_s": now - when} for rid, (when, rep) in self._metrics.items()}
        return {"replicas": replicas, "router": self.stats(),
                "ingresses": {iid: rep for iid, (_, rep) in self._ingresses.items()}}  # fmt: skip


class _PeeredRouterService(RouterService):
    """A RouterService whose decisions go to the application's other router actors."""

    def __init__(self, config: ClusterConfig, name: str) -> None:
        peers = [n for n in config.router_actor_names if n != name]
        # a standby hears each replica four times per replica_timeout_s (a sign of life)
        super().__init__(config.hash_spec, config.router_policy, config.router_policy_kwargs, config.replica_timeout_s,
                         share=self._send if peers else None, standby_push_s=config.replica_timeout_s / 4 if peers else 0.0)  # fmt: skip
        self._peer_names = peers
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        if peers:
            self.start_flusher()
        self._node = ray.util.get_node_ip_address()
        self._watch_idle(name, config.idle_exit_s)

    def _watch_idle(self, name: str, idle_exit_s: float) -> None:
        """End this actor (no restart) once nothing has called it for ``idle_exit_s``:
        every replica heartbeats, a worker pool reports each poll and each ingress sends
        its counters every second, so only a generation nobody uses any more goes quiet."""

        def loop() -> None:
            while True:
                time.sleep(min(5.0, idle_exit_s / 4))
                idle = time.monotonic() - self.last_call
                if idle > idle_exit_s:
                    log.warning("router %s unused for %.0f s (its application was removed or redeployed): exiting", name, idle)
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return

        threading.Thread(target=loop, name="kvroute-idle-exit", daemon=True).start()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "node": self._node}

    def _send(self, batch: list[PeerDecision]) -> None:
        for name in self._peer_names:
            try:
                handle = self._handles.get(name) or ray.get_actor(name, namespace=ROUTER_NAMESPACE)
                self._handles[name] = handle
                handle.note_peer_decisions.remote(batch)  # fire and forget
            except Exception:  # a peer not started yet: it will learn from the replicas' reports
                self._handles.pop(name, None)


RouterActor = ray.remote(num_cpus=0, max_restarts=-1)(RouterService)  # a lone router (benchmarks)
PeeredRouterActor = ray.remote(max_restarts=-1)(_PeeredRouterService)


def get_or_create_router_actors(config: ClusterConfig) -> list[ray.actor.ActorHandle]:
    """The router actors of ``config``'s generation, created on first use: detached
    (their life is the application's, not the caller's; they end themselves once unused,
    ``kill_router_actors`` ends them at once), each reserving ``router_num_cpus``, router
    ``i`` preferring the ``i``-th node with CPUs (soft: Ray places it elsewhere when that
    node is full or gone, and a router restarted after its node's loss goes to a live
    one). Ray's SPREAD strategy alone is best effort: seen putting both of two routers
    on one node, whose loss then took the whole directory."""
    nodes = _router_nodes() if len(config.router_actor_names) > 1 else []
    return [
        PeeredRouterActor.options(name=name, namespace=ROUTER_NAMESPACE, lifetime="detached", get_if_exists=True,
                                  num_cpus=config.router_num_cpus, scheduling_strategy=_prefer(nodes, i))
        .remote(config, name)
        for i, name in enumerate(config.router_actor_names)
    ]


def _router_nodes() -> list[str]:
    """The alive nodes that offer CPUs (not a head started with none), in a fixed order."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)


def _prefer(nodes: list[str], i: int) -> Any:
    if not nodes:
        return "SPREAD"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=True)


def get_or_create_router_actor(config: ClusterConfig) -> ray.actor.ActorHandle:
    """The application's first router actor (creating all of them)."""
    return get_or_create_router_actors(config)[0]
