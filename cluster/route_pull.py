"""A routed request's pull: before a replica runs a request whose decision names a pull
source (``RouteDecision.pull_from``, priced by the router's policy:
``router/policies/kv_pull_pricing.py``), it pulls the request's prefix from that replica
(``kv_pull.pull_prefix``: the source's ``export_kv`` through the application's handle,
addressed to it by the kvroute request router, then the import), then queues the
request, which hits the prefix instead of recomputing it.

Any failure is a fallback, never an error of the request: the request runs anyway and
recomputes what the pull did not bring. ``pull_prefix`` already guarantees no wrong or
partial KV (a refused payload is never written, an import cut short is released
unregistered) and no leaked blocks on either side; anything else that goes wrong here
is counted as ``error``. A request the decision placed elsewhere (Serve passed it on to
the next ranked replica), a resumed one, and a pull of nothing are skipped. The pull is
bounded by ``PULL_TIMEOUT_S`` (× an emulated engine's ``time_scale``, which stretches its
steps and its transfers alike): past it, recomputing is cheaper than waiting.

A request that arrives while a pull of its prefix is in flight here waits for that pull
before it queues (``before_generate``): the router counts the pulling replica as holding
the prefix from its decision on (a pending run), so the requests that follow a pull go
there, and queued at once they would each recompute what the pull is bringing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from kvroute.cluster.kv_pull import PULL_TIMEOUT_S, PullResult, pull_prefix, wall_scale
from kvroute.cluster.messages import GenerateRequest, ReplicaCall
from kvroute.router.types import RouteDecision

if TYPE_CHECKING:
    from kvroute.replica.async_engine import AsyncEngine

log = logging.getLogger(__name__)


class RoutePuller:
    """One replica's side of routed pulls: ``engine`` imports, ``handle()`` gives the
    application's handle to the replica deployment (looked up once, on first use)."""

    def __init__(self, replica_id: str, engine: AsyncEngine, handle: Any, timeout_s: float = PULL_TIMEOUT_S) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self._handle_factory = handle
        self._handle: Any = None
        self.timeout_s = timeout_s * wall_scale(engine)
        self._inflight: list[tuple[list[int], asyncio.Future]] = []  # pulls running here: (tokens, done)
        engine.report_pulls()  # routers may now ask this replica to pull

    async def before_generate(self, request: GenerateRequest, route: RouteDecision | None) -> int:
        """What a replica does before queueing ``request``: the pull ``route`` asks for,
        or else a wait for a pull of its prefix already in flight here. Returns the
        prompt tokens this request's own pull brought (0: none, or it fell back)."""
        if self.wanted(request, route):
            return (await self.pull(request, route)).tokens  # type: ignore[arg-type]
        ids = request.token_ids
        waits = [done for tokens, done in self._inflight if len(tokens) <= len(ids) and ids[: len(tokens)] == tokens]
        if waits and not request.resume_output:
            await asyncio.wait(waits, timeout=self.timeout_s)
        return 0

    def wanted(self, request: GenerateRequest, route: RouteDecision | None) -> bool:
        """Whether ``route`` asks this replica to pull ``request``'s prefix first."""
        return (route is not None and route.pull_from is not None and route.pull_tokens > 0
                and route.replica_id == self.replica_id and route.pull_from != self.replica_id
                and not request.resume_output)  # fmt: skip

    async def pull(self, request: GenerateRequest, route: RouteDecision) -> PullResult:
        """Pull the first ``route.pull_tokens`` tokens' blocks of ``request`` from
        ``route.pull_from``; a ``PullResult`` whose fallback says why it brought nothing."""
        source = ReplicaCall(str(route.pull_from))
        tokens = list(request.token_ids[: route.pull_tokens])
        salt, lora = request.cache_salt, request.lora_name
        entry = (tokens, asyncio.get_running_loop().create_future())
        self._inflight.append(entry)
        try:
            if self._handle is None:
                self._handle = self._handle_factory()
            handle = self._handle
            return await pull_prefix(self.engine, lambda: handle.export_kv.remote(source, tokens, salt, lora),
                                     self.timeout_s)  # fmt: skip
        except Exception as exc:  # never the request's failure: it recomputes
            self.engine.engine.kv_transfer.metrics.on_fallback("error")
            log.warning("replica %s: pull from %s failed (%r); recomputing", self.replica_id, route.pull_from, exc)
            return PullResult(0, 0, 0, 0.0, "error", repr(exc))
        finally:
            self._inflight.remove(entry)
            entry[1].set_result(None)
