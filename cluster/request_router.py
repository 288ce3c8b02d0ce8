"""Ray Serve request router that asks the application's router actor for a ranking.

Runs inside every process that holds a handle to the replica deployment (the HTTP
ingress, a benchmark job, a test driver). A thin Serve shell around ``Ranker``
(``ranker.py``): for a ``GenerateRequest`` the ranker asks the router actor with the
block hashes the caller computed and returns the replicas best first; Serve probes them
in that order, so a replica at ``max_ongoing_requests`` is skipped for the next one.
When the router actor cannot answer in time (not started yet, restarting, dead) this
falls back to power of two choices, counts it, and logs it; requests never fail
because of the router.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, List, Optional

import ray
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from kvroute.cluster.messages import ROUTER_NAMESPACE, GenerateRequest, Ranking, ReplicaCall, ReplicaUnavailableError
from kvroute.cluster.ranker import Ranker

log = logging.getLogger(__name__)

_FALLBACK_LOG_EVERY_S = 10.0
_MAX_REMEMBERED_RANKINGS = 10_000

# Process-wide counts over every KVRouteRequestRouter in this process (Serve builds one
# per handle): what the HTTP ingress exports as kvroute:router_fallbacks.
PROCESS_STATS = {"ranked": 0, "fallbacks": 0}


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

    def initialize_state(self, router_actor_name: str = "", timeout_s: float = 1.0, **_: Any) -> None:
        self._actor_name = router_actor_name
        self._timeout_s = timeout_s
        self._actor: Optional[ray.actor.ActorHandle] = None
        self._ranker = Ranker(self._rank, self._note_fallback, _MAX_REMEMBERED_RANKINGS)
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
        order = await self._ranker.order(pending_request.metadata.internal_request_id, request, list(by_id))
        if order is None:
            return self._power_of_two(candidate_replicas)
        return [[by_id[rid]] for rid in order]

    async def _rank(self, request: GenerateRequest, candidates: list[str]) -> Ranking:
        if self._actor is None:
            self._actor = await asyncio.wait_for(
                asyncio.to_thread(ray.get_actor, self._actor_name, namespace=ROUTER_NAMESPACE), self._timeout_s
            )
        ref = self._actor.rank.remote(request.block_hashes, request.num_tokens, candidates)
        try:
            ranking = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise
        PROCESS_STATS["ranked"] += 1
        return ranking

    def _power_of_two(self, candidates: List[RunningReplica]) -> List[List[RunningReplica]]:
        # Serve probes both and takes the shorter queue.
        return [random.sample(candidates, min(2, len(candidates)))]

    def _note_fallback(self, exc: BaseException) -> None:
        PROCESS_STATS["fallbacks"] += 1
        if isinstance(exc, ValueError):  # ray.get_actor: no such actor (yet)
            self._actor = None
        if self._fallback_counter is not None:
            try:
                self._fallback_counter.inc()
            except Exception:
                pass
        now = time.monotonic()
        if now - self._last_fallback_log >= _FALLBACK_LOG_EVERY_S:
            self._last_fallback_log = now
            log.warning(
                "kvroute router actor %r unavailable (%r): routing by power of two choices "
                "(%d fallbacks so far)",
                self._actor_name,
                exc,
                self.stats["fallbacks"],
            )

    # ------------------------------------------------------------------ lifecycle hooks
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        request = _arg_of(pending_request, GenerateRequest)
        self._ranker.routed(pending_request.metadata.internal_request_id, request, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = {rid.unique_id for rid in self._replica_id_set} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for uid in gone:
            self._forget(uid)

    def _forget(self, replica_unique_id: str) -> None:
        """Drop a dead or removed replica from the directory at once (fire and forget:
        this hook is synchronous; the router also expires silent replicas itself)."""
        if self._actor is not None:
            try:
                self._actor.remove_replica.remote(replica_unique_id)
            except Exception:
                pass
