"""Ray Serve request router that asks one of the application's router actors for a
routing decision.

Runs inside every process that holds a handle to the replica deployment (the HTTP
ingress, a benchmark job, a test driver). A thin Serve shell around ``Ranker``
(``ranker.py``): for a ``GenerateRequest`` the ranker asks a router actor with the
block hashes the caller computed, adds the ``RouteDecision`` to the call (the replica's
``route`` argument) and returns the replicas best first; Serve probes them in that
order, so a replica at ``max_ongoing_requests`` is skipped for the next one.
Every process asks the routers in the application's order (``router_choice.py``): the
first while it keeps up, the next when it has too many of this process's calls
unanswered (a spill) or could not answer in time (not started yet, restarting, dead: a
failover, and it is skipped for ``DOWN_S``). Only when no router answers does this fall
back to power of two choices and log it; requests never fail because of the routers.
Nothing is counted here for the process: each decision says whether it was a fallback
and which routers it went past, and the caller counts what its requests' decisions say
(``KVRouteClient.stats``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, List, Optional, Sequence

import ray
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvroute.cluster.messages import ROUTER_NAMESPACE, GenerateRequest, ReplicaCall, ReplicaUnavailableError, RouteSlot
from kvroute.cluster.ranker import ROUTE_ARG, Ranker
from kvroute.cluster.router_choice import RouterChoice
from kvroute.router.types import RouteDecision

log = logging.getLogger(__name__)

_FALLBACK_LOG_EVERY_S = 10.0


def _arg_of(pending: Optional[PendingRequest], kind: type) -> Any:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, kind):
            return arg
    return None


class KVRouteRequestRouter(RequestRouter):
    """No FIFOMixin on purpose: with it Serve hands the replica chosen for one request
    to the oldest pending one, which would undo every per-request (prefix) decision."""

    def initialize_state(self, router_actor_names: Sequence[str] = (), timeout_s: float = 1.0, **_: Any) -> None:
        self._names = list(router_actor_names)
        choice = RouterChoice(len(self._names)) if self._names else None
        self._timeout_s = timeout_s
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self._ranker = Ranker(choice, lambda i, request, candidates: self._ask(self._names[i], request, candidates),
                              self._note_fallback)  # fmt: skip
        self.stats = self._ranker.stats
        self._last_fallback_log = float("-inf")
        self._fallback_counter = None
        try:
            from ray.util.metrics import Counter

            self._fallback_counter = Counter(
                "kvroute_router_fallbacks", description="Routing decisions made without the router actor"
            )
        except Exception:  # metrics are best effort (no metrics agent in some processes)
            pass

    # ------------------------------------------------------------------ routing
    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Without this Serve retries an unanswered round at once, without awaiting
            # anything: an empty answer would spin the router's event loop.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        call = _arg_of(pending_request, ReplicaCall)
        if call is not None:  # addressed to one replica
            target = [r for r in candidate_replicas if r.replica_id.unique_id == call.replica_id]
            if not target:
                # Fail the call now and end its routing task: an empty rank would keep
                # the task retrying forever, holding a slot the requests behind it need.
                if not pending_request.future.done():
                    pending_request.future.set_exception(
                        ReplicaUnavailableError(f"replica {call.replica_id} is not a running replica of this deployment")
                    )
                # (Serve will not cancel the task it is running in; it ends at its next await.)
                task = asyncio.current_task()
                if task is not None:
                    task.cancel()
                return []
            return [target]
        request = _arg_of(pending_request, GenerateRequest)
        if request is None:
            return self._power_of_two(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        slot = _arg_of(pending_request, RouteSlot)
        local = None if slot is None or slot.follower is None else slot.follower.rank
        order = await self._ranker.order(pending_request.kwargs, request, list(by_id), local)
        if slot is not None:
            slot.decision = pending_request.kwargs.get(ROUTE_ARG)
        if order is None:
            return self._power_of_two(candidate_replicas)
        return [[by_id[rid]] for rid in order]

    async def _ask(self, name: str, request: GenerateRequest, candidates: list[str]) -> RouteDecision:
        try:
            return await self._ask_once(name, request, candidates)
        except Exception:
            self._actors.pop(name, None)  # looked up again next time
            raise

    async def _ask_once(self, name: str, request: GenerateRequest, candidates: list[str]) -> RouteDecision:
        actor = self._actors.get(name)
        if actor is None:
            actor = self._actors[name] = await asyncio.wait_for(
                asyncio.to_thread(ray.get_actor, name, namespace=ROUTER_NAMESPACE), self._timeout_s
            )
        ref = actor.rank.remote(request.block_hashes, request.num_tokens, candidates, request.lora_name)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise

    def _power_of_two(self, candidates: List[RunningReplica]) -> List[List[RunningReplica]]:
        # Serve probes both and takes the shorter queue.
        return [random.sample(candidates, min(2, len(candidates)))]

    def _note_fallback(self, exc: BaseException) -> None:
        if self._fallback_counter is not None:
            try:
                self._fallback_counter.inc()
            except Exception:
                pass
        now = time.monotonic()
        if now - self._last_fallback_log >= _FALLBACK_LOG_EVERY_S:
            self._last_fallback_log = now
            log.warning(
                "kvroute router actors %r unavailable (%r): routing by power of two choices "
                "(%d fallbacks so far)",
                self._names,
                exc,
                self.stats["fallbacks"],
            )

    # ------------------------------------------------------------------ lifecycle hooks
    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = {rid.unique_id for rid in self._replica_id_set} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for uid in gone:
            self._forget(uid)

    def _forget(self, replica_unique_id: str) -> None:
        """Drop a dead or removed replica from every router's directory at once (fire and
        forget: this hook is synchronous; routers also expire silent replicas)."""
        for actor in list(self._actors.values()):
            try:
                actor.remove_replica.remote(replica_unique_id)
            except Exception:
                pass
