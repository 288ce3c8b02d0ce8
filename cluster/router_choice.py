"""Which of the application's router actors a process asks, in what order (no Ray here:
``ranker.py``, for the Serve request router, and ``deploy/backends/workers.py`` drive it). The
spills and failovers of a call are counted where its caller says: the request router
counts each call's into its decision (``RouteDecision.spills`` / ``.failovers``), the
workers ingress into its own counts.

Every process orders the routers the same way, the application's order. While the
first router keeps up, every decision of every ingress is made by that one router,
which has seen every decision before it: N routers place exactly like one, and the
others stand by hot (they hear every replica's events and every decision, so any of
them can take over at once). Routers that each took the decisions of their own
ingresses (by pid, as first built) placed worse: each missed the others' last decisions
for the time they took to arrive (the peer lag), and lagging routers send the same
requests to the same idle replica (ARCHITECTURE.md §3.3; figures:
benchmarks/RESULTS.md).

The routers share the work when one cannot keep up. A router is passed over for the
next one while it is busy:
- it has ``spill_at`` of this process's calls unanswered (by Little's law the calls in
  flight are the rate times the answer time, so they grow as it falls behind); or
- its last answer, less than ``load_ttl_s`` old, said its process used ``busy_load``
  cores or more (``RouterService.load``). A Python router saturates near one core,
  and one process' own calls in flight cannot see a queue that many ingresses fill
  together (at I ingresses the first router would queue I × ``spill_at`` calls
  before anyone passed it over); the router's own CPU can. The figure expires, so a
  router passed over is asked again and reports afresh.
The next router decides with the view its peers' decisions give it. A router that
failed to answer is skipped for ``down_s`` (a failover); when every router is down or
busy, they are asked in order all the same.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

SPILL_AT = 4  # a router with this many of the process's calls unanswered is passed over
BUSY_LOAD = 0.8  # ... or one whose process reported this many cores of CPU use
LOAD_TTL_S = 0.25  # ... that recently
DOWN_S = 5.0  # a router that did not answer is skipped this long
LOAD_SAMPLE_S = 0.1  # a router measures its CPU use over intervals at least this long


class RouterChoice:
    def __init__(self, num_routers: int, stats: dict[str, int] | None = None, spill_at: int = SPILL_AT,
                 busy_load: float = BUSY_LOAD, load_ttl_s: float = LOAD_TTL_S, down_s: float = DOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if num_routers < 1 or spill_at < 1:
            raise ValueError(f"need num_routers >= 1 and spill_at >= 1, got {num_routers!r}, {spill_at!r}")
        self.spill_at, self.busy_load, self.load_ttl_s = spill_at, busy_load, load_ttl_s
        self.down_s, self.clock = down_s, clock
        self.in_flight = [0] * num_routers
        self._down_until = [float("-inf")] * num_routers
        self._busy_until = [float("-inf")] * num_routers  # a busy load report holds until then
        # counts "spills" (calls that went past a busy router) and "failovers" (calls
        # that went on to another router after one failed), where a call names no counts
        # of its own: the caller owns them (its process's, or one decision's)
        self.stats = stats if stats is not None else {}
        for key in ("spills", "failovers"):
            self.stats.setdefault(key, 0)

    def order(self, counts: dict[str, int] | None = None) -> list[int]:
        """Router indices to ask, in order: the routers up and not busy first (a spill
        counted in ``counts``, default ``stats``)."""
        now = self.clock()
        n = len(self.in_flight)
        up = [i for i in range(n) if self._down_until[i] <= now] or list(range(n))
        free = [i for i in up if self.in_flight[i] < self.spill_at and self._busy_until[i] <= now]
        if free and free[0] != up[0]:
            (self.stats if counts is None else counts)["spills"] += 1
        return free + [i for i in up if i not in free]

    def asking(self, i: int) -> None:
        self.in_flight[i] += 1

    def answered(self, i: int, ok: bool, last: bool = True, load: float = 0.0,
                 counts: dict[str, int] | None = None) -> None:  # fmt: skip
        """Router ``i`` answered a call (``ok``, its process at ``load`` cores), or failed
        or timed out: it is skipped for ``down_s``, and unless it was the ``last`` of the
        order the call fails over (counted in ``counts``, default ``stats``)."""
        self.in_flight[i] -= 1
        if ok:
            self._down_until[i] = float("-inf")
            self._busy_until[i] = self.clock() + self.load_ttl_s if load >= self.busy_load else float("-inf")
            return
        self._down_until[i] = self.clock() + self.down_s
        if not last:
            (self.stats if counts is None else counts)["failovers"] += 1

    async def first_answer(self, call: Callable[[int], Awaitable[T]], counts: dict[str, int] | None = None) -> T:
        """``await call(i)`` on the routers in ``order()`` until one answers (its
        ``router_load``, when it has one, noted); the last router's error when none does.
        The call's spill and failovers are counted in ``counts`` (default ``stats``)."""
        order = self.order(counts)
        for k, i in enumerate(order):
            self.asking(i)
            try:
                answer = await call(i)
            except Exception:
                self.answered(i, False, last=k + 1 == len(order), counts=counts)
                if k + 1 == len(order):
                    raise
                continue
            self.answered(i, True, load=getattr(answer, "router_load", 0.0))
            return answer
        raise AssertionError("unreachable: the order is never empty")
