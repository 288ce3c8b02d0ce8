"""A replica's part in the fleet's changes: a replica that joins pulls the fleet's hottest
prefixes before it serves, and one that leaves on a scale-down hands its own hottest
prefixes to the survivors. The router actor plans both (``router/hot_prefixes.py``:
which prefixes, by block hashes, and which replica holds or takes each); the KV moves as
a routed pull does (``kv_pull.py``), so no wrong or partial KV can land and no block
leaks on either side.

Warm-up (``warm_up``, from ``EngineReplica.__init__`` once it is registered, before
Serve counts it as running and sends it requests): the pulls of the plan run together,
each bounded by what is left of ``WARMUP_S`` (× an emulated engine's ``time_scale``),
at most half of the replica's KV blocks in all. A pull that falls back (its source died,
timed out, the import refused it) is skipped; a router that does not answer means no
warm-up. The replica starts either way.

Hand-off (``hand_off``, from the replica's graceful shutdown, after Serve drained it
and before it leaves the directories; not when the whole application is being deleted,
``app_serving``): a leaving replica is no longer a Serve target,
so nobody can pull from it; it pushes instead. For each planned prefix it exports the
run and has the chosen survivor import it (``EngineReplica.import_kv``), all bounded by
``HANDOFF_S`` (× ``time_scale``, within the shutdown's own budget).

Counted in the engine's transfer metrics (``kv_transfer_metrics.py``): warm-up
prefixes, blocks, tokens, skipped pulls and seconds; prefixes and blocks handed off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from kvroute.cluster.kv_pull import PullResult, pull_prefix, wall_scale
from kvroute.cluster.messages import ReplicaCall

if TYPE_CHECKING:
    from kvroute.replica.async_engine import AsyncEngine

log = logging.getLogger(__name__)

WARMUP_S = 10.0  # a joining replica's warm-up, all pulls together (unscaled seconds)
HANDOFF_S = 5.0  # a leaving replica's hand-off, all prefixes together (unscaled seconds)


class FleetMoves:
    """One replica's warm-up and hand-off. ``handle()`` gives the application's handle
    to the replica deployment; ``prefixes``: how many hot prefixes each moves (0: none)."""

    def __init__(self, replica_id: str, engine: AsyncEngine, handle: Callable[[], Any], prefixes: int,
                 call_timeout_s: float) -> None:  # fmt: skip
        self.replica_id, self.engine, self._handle = replica_id, engine, handle
        self.prefixes, self.call_timeout_s = prefixes, call_timeout_s
        self.scale = wall_scale(engine)
        self.metrics = engine.engine.kv_transfer.metrics

    async def warm_up(self, router: Any) -> list[PullResult]:
        """Pull the hot prefixes ``router`` names (module docstring); never raises."""
        if self.prefixes <= 0:
            return []
        start = time.perf_counter()
        budget = max(1, self.engine.engine.kv.pool.num_free_blocks // 2)
        try:
            plan = await asyncio.wait_for(router.warmup_plan.remote(self.replica_id, self.prefixes, budget),
                                          self.call_timeout_s)  # fmt: skip
        except Exception as exc:  # no router: start cold
            log.info("replica %s: no warm-up plan (%r)", self.replica_id, exc)
            return []
        if not plan:
            return []
        deadline = start + WARMUP_S * self.scale
        results = await asyncio.gather(*(self._pull(hashes, holder, deadline) for hashes, holder in plan))
        done = [r for r in results if r.ok]
        seconds = time.perf_counter() - start
        self.metrics.on_warmup(len(done), sum(r.blocks for r in done), sum(r.tokens for r in done),
                               len(results) - len(done), seconds)  # fmt: skip
        log.info("replica %s warmed up with %d of %d hot prefixes (%d tokens) in %.2f s", self.replica_id,
                 len(done), len(results), sum(r.tokens for r in done), seconds)  # fmt: skip
        return list(results)

    async def _pull(self, hashes: list[int], holder: str, deadline: float) -> PullResult:
        source = ReplicaCall(holder)
        try:
            handle = self._handle()
            return await pull_prefix(self.engine, lambda: handle.export_kv.remote(source, None, block_hashes=hashes),
                                     max(0.0, deadline - time.perf_counter()))  # fmt: skip
        except Exception as exc:  # never the start's failure: skipped
            self.metrics.on_fallback("error")
            return PullResult(0, 0, 0, 0.0, "error", repr(exc))

    async def hand_off(self, router: Any, app_name: str, budget_s: float) -> int:
        """Send this replica's hot prefixes to the survivors ``router`` names, within
        ``HANDOFF_S`` × time_scale and ``budget_s``, unless application ``app_name`` is
        being deleted; returns the blocks they took. Never raises."""
        if self.prefixes <= 0:
            return 0
        deadline = time.perf_counter() + min(HANDOFF_S * self.scale, budget_s)
        try:
            if not await asyncio.wait_for(asyncio.to_thread(app_serving, app_name), self.call_timeout_s):
                return 0
            plan = await asyncio.wait_for(router.handoff_plan.remote(self.replica_id, self.prefixes),
                                          self.call_timeout_s)  # fmt: skip
        except Exception as exc:
            log.info("replica %s: no hand-off plan (%r)", self.replica_id, exc)
            return 0
        taken = await asyncio.gather(*(self._push(hashes, target, deadline) for hashes, target in plan))
        if plan:
            log.info("replica %s handed %d of %d hot prefixes (%d blocks) to survivors", self.replica_id,
                     sum(1 for b in taken if b), len(plan), sum(taken))  # fmt: skip
        return sum(taken)

    async def _push(self, hashes: list[int], target: str, deadline: float) -> int:
        blocks = 0
        try:
            payload = await self.engine.export_blocks(block_hashes=hashes)
            if payload.num_blocks:
                call = self._handle().import_kv.remote(ReplicaCall(target), payload, max(0.0, deadline - time.perf_counter()))
                result = await asyncio.wait_for(call, max(0.0, deadline - time.perf_counter()) + 1.0)
                blocks = result.blocks
        except Exception as exc:  # the survivor recomputes it when asked
            log.info("replica %s: hand-off to %s failed (%r)", self.replica_id, target, exc)
        self.metrics.on_handoff(blocks)
        return blocks


def app_serving(app_name: str) -> bool:
    """Whether application ``app_name`` goes on serving (not being deleted): a replica
    that leaves a deleted application has no survivor to hand anything to. Blocking."""
    try:
        from ray import serve

        app = serve.status().applications.get(app_name)
    except Exception:  # the controller is gone too
        return False
    return app is not None and app.status != "DELETING"


async def imported(engine: AsyncEngine, payload: Any, timeout_s: float) -> PullResult:
    """A survivor's side of a hand-off: import ``payload`` as a pull whose fetch is done."""

    async def given() -> Any:
        return payload

    return await pull_prefix(engine, given, timeout_s)
