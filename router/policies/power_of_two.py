"""Power of two choices: Ray Serve's default request router.

Rules (Ray Serve ``PowerOfTwoChoicesRequestRouter``, the default router of Ray Serve and
Ray Serve LLM, https://docs.ray.io/en/latest/serve/llm/architecture/routing-policies.html
and https://docs.anyscale.com/llm/serving/request-routing): pick two distinct candidates
uniformly at random and send the request to the one with fewer pending requests. Here a
replica's pending requests are ``ReplicaLoad.queue_len`` (waiting + running + routed
since the last report). A tie goes to the first of the two samples. With one candidate
that candidate is chosen. Randomness comes from ``random.Random(seed)`` so a run is
reproducible. ``expected_cached_tokens`` is what the router's directory says the chosen
replica holds. A LoRA request samples among the replicas with its adapter loaded (else
those with the fewest), as Ray Serve does for a multiplexed model id
(``common.multiplex_candidates``).
"""

from __future__ import annotations

import random
from typing import ClassVar, Sequence

from kvroute.router.policies.common import directory_cached_tokens, multiplex_candidates
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest


def power_of_two_pick(candidates: Sequence[ReplicaId], view: ClusterView, rng: random.Random) -> ReplicaId:
    """Sample two distinct candidates; return the one with the shorter queue (first on a tie)."""
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(list(candidates), 2)
    return b if view.load(b).queue_len < view.load(a).queue_len else a


class PowerOfTwoPolicy(Policy):
    name: ClassVar[str] = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        replica = power_of_two_pick(multiplex_candidates(request, view), view, self._rng)
        return RouteDecision(
            replica,
            directory_cached_tokens(replica, request.block_hashes, request.num_tokens, view),
            "power_of_two",
        )
