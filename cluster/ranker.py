"""The kvroute request router's logic, without Ray or Serve: what the Serve
``KVRouteRequestRouter`` (``request_router.py``) runs for each request it routes.

For a ``GenerateRequest`` the ``Ranker`` asks for a ``Ranking`` (``ask``: in a cluster,
the router actor's ``rank``), writes the router's decision on the request once
(``request.route``), and returns the candidates best first. A request that Serve routes
again (every ranked replica was full) reuses its ranking instead of asking, and being
counted, again. When ``ask`` fails (the router actor is not started yet, restarting,
dead, or too slow) it reports the error to ``on_fallback``, marks the request
``fallback`` and returns None: the caller then routes by power of two choices, so a
request never fails because of the router. ``routed`` records the replica Serve sent
the request to and forgets its ranking.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Awaitable, Callable, Sequence

from kvroute.cluster.messages import GenerateRequest, Ranking, RouteTrace

Ask = Callable[[GenerateRequest, list[str]], Awaitable[Ranking]]


class Ranker:
    def __init__(
        self, ask: Ask, on_fallback: Callable[[BaseException], None] = lambda exc: None, max_remembered: int = 10_000
    ) -> None:
        self._ask = ask
        self._on_fallback = on_fallback
        self._max_remembered = max_remembered
        self._rankings: OrderedDict[str, Ranking] = OrderedDict()  # routing key -> ranking
        self.stats = {"ranked": 0, "fallbacks": 0, "reused_rankings": 0}

    async def order(self, key: str, request: GenerateRequest, candidates: Sequence[str]) -> list[str] | None:
        """``candidates`` best first for the request Serve knows as ``key``, or None to
        fall back (no ranking, or none of its replicas is still a candidate)."""
        ranking = self._rankings.get(key)
        if ranking is not None:
            self.stats["reused_rankings"] += 1
        else:
            try:
                ranking = await self._ask(request, list(candidates))
            except Exception as exc:
                self.stats["fallbacks"] += 1
                self._on_fallback(exc)
                request.route = RouteTrace(reason="fallback")
                return None
            self.stats["ranked"] += 1
            self._rankings[key] = ranking
            if len(self._rankings) > self._max_remembered:
                self._rankings.popitem(last=False)
            request.route = ranking.trace()
        present = set(candidates)
        return [rid for rid in ranking.replica_ids if rid in present] or None

    def routed(self, key: str, request: GenerateRequest | None, replica_id: str) -> None:
        """Serve sent the request to ``replica_id``."""
        self._rankings.pop(key, None)
        if request is not None:
            request.served_by = replica_id
