"""The kvroute request router's logic, without Ray or Serve: what the Serve
``KVRouteRequestRouter`` (``request_router.py``) runs for each request it routes.

For a ``GenerateRequest`` the ``Ranker`` asks the routers in ``RouterChoice``'s order
(``ask(i, request, candidates)``: in a cluster, router actor ``i``'s ``rank``) for a
``RouteDecision``, completes it with the routers this call went past (its failovers
and spill), and puts it in the call's keyword arguments (``ROUTE_ARG``): the replica
receives it as the ``route`` argument of ``generate``. Serve routes a call again when
every ranked replica was full; the call still holds its decision, so it is reused
instead of asked, and counted, again. When no router answers (not started yet,
restarting, dead, or too slow) the error goes to ``on_fallback``, the call holds a
fallback decision (reason "fallback", no replica), and ``order`` returns None: the
caller then routes by power of two choices, so a request never fails because of the
routers. A call that holds a fallback asks again when Serve routes it again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, MutableMapping, Sequence

from kvroute.cluster.messages import ROUTE_ARG, GenerateRequest
from kvroute.cluster.router_choice import RouterChoice
from kvroute.router.types import RouteDecision

Ask = Callable[[int, GenerateRequest, list[str]], Awaitable[RouteDecision]]
Local = Callable[[Sequence[Any], int, list[str], "str | None"], "RouteDecision | None"]


class Ranker:
    def __init__(self, choice: RouterChoice | None, ask: Ask,
                 on_fallback: Callable[[BaseException], None] = lambda exc: None) -> None:  # fmt: skip
        self._choice = choice
        self._ask = ask
        self._on_fallback = on_fallback
        self.stats = {"ranked": 0, "fallbacks": 0, "reused_rankings": 0, "decided_here": 0}

    async def order(
        self, call: MutableMapping[str, Any], request: GenerateRequest, candidates: Sequence[str],
        local: Local | None = None,
    ) -> list[str] | None:
        """``candidates`` best first for the call whose keyword arguments are ``call``
        (its decision made now, or the one it holds), or None to fall back (no router
        answered, or none of the ranked replicas is still a candidate). ``local``: a
        router in this process (``router_follow.RouterFollower.rank``), asked first."""
        decision = call.get(ROUTE_ARG)
        if decision is not None and decision.replica_id is not None:
            self.stats["reused_rankings"] += 1
        else:
            here = None if local is None else local(request.block_hashes, request.num_tokens, list(candidates), request.lora_name)
            if here is not None:
                self.stats["decided_here"] += 1
            decision = call[ROUTE_ARG] = here or await self.decide(request, list(candidates))
        present = set(candidates)
        return [rid for rid in decision.order if rid in present] or None

    async def decide(self, request: GenerateRequest, candidates: list[str]) -> RouteDecision:
        """The first answering router's decision for ``request``, or a fallback one, with
        the routers this call went past."""
        counts = {"spills": 0, "failovers": 0}
        try:
            if self._choice is None:
                raise RuntimeError("no router actor configured")
            decision = await self._choice.first_answer(lambda i: self._ask(i, request, candidates), counts)
        except Exception as exc:
            self.stats["fallbacks"] += 1
            self._on_fallback(exc)
            decision = RouteDecision(None, 0, "fallback")
        else:
            self.stats["ranked"] += 1
        return dataclasses.replace(decision, failovers=counts["failovers"], spills=counts["spills"])
