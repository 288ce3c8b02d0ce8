"""Round robin: the classic stateless baseline.

Rules: keep one counter; each request goes to ``candidates[counter % len(candidates)]``
and the counter advances by one. No cache or load awareness at all. This is the
``round_robin`` policy every peer router ships (SGLang router ``--policy round_robin``,
https://docs.sglang.ai/router/router.html ; Ray Serve's custom router guide
uses it as the simplest example). ``expected_cached_tokens`` is what the router's
directory says the chosen replica holds.
"""

from __future__ import annotations

from typing import ClassVar

from kvroute.router.policies.common import directory_cached_tokens
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import RouteDecision, RouteRequest


class RoundRobinPolicy(Policy):
    name: ClassVar[str] = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        # ``seed`` is accepted for a uniform constructor; round robin is not random.
        self._next = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        cands = request.candidates
        replica = cands[self._next % len(cands)]
        self._next += 1
        return RouteDecision(
            replica,
            directory_cached_tokens(replica, request.block_hashes, request.num_tokens, view),
            "round_robin",
        )
