"""Decision quality: how much prefix reuse requests were offered and where it went.

Per routed request: ``available`` (the longest prefix any candidate held at decision
time, ``RouteDecision.available_tokens``), ``captured`` (what the router expected the
chosen replica to hold) and ``delivered`` (the replica's cached tokens). What the prompt
did not get from cache splits into ``cold`` (prompt - available: held nowhere),
``routing`` (available - captured: held elsewhere, by the decision's reason) and
``stale`` (captured - delivered, when the replica held less than expected). A prefix
pulled from another replica before the request ran (``RouteDecision.pull_from``) is
reuse delivered: it is in the replica's cached tokens, and ``pulled`` counts it apart
(a pull that fell back shows as ``stale``). The ingress
(``deploy/metrics.py``) and the simulator keep one ``ReuseAccount`` each.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class ReuseAccount:
    def __init__(self) -> None:
        self.requests = 0
        self.offered = 0
        self.available = 0
        self.captured = 0
        self.delivered = 0
        self.pulled = 0
        self.abs_error = 0
        self.cold = 0
        self.stale = 0
        self.routing: Counter[str] = Counter()

    def add(self, prompt: int, available: int, captured: int, delivered: int, reason: str, pulled: int = 0) -> None:
        available = max(available, captured)  # a policy may know more than the directory
        self.requests += 1
        self.offered += prompt
        self.available += available
        self.captured += captured
        self.delivered += delivered
        self.pulled += min(pulled, delivered)
        self.abs_error += abs(captured - delivered)
        self.cold += max(prompt - available, 0)
        if available > captured:
            self.routing[reason] += available - captured
        self.stale += max(captured - delivered, 0)

    def as_dict(self) -> dict[str, Any]:
        """The figures, and each as a fraction of the offered tokens."""
        figures = {k: getattr(self, k) for k in ("requests", "offered", "available", "captured", "delivered",
                                                  "pulled", "cold", "stale")}  # fmt: skip
        figures["routing"] = dict(self.routing)
        share = max(self.offered, 1)
        for k in ("available", "captured", "delivered", "pulled", "cold", "stale"):
            figures[f"{k}_share"] = getattr(self, k) / share
        figures["routing_share"] = sum(self.routing.values()) / share
        return figures
