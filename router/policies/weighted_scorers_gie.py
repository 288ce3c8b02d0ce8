"""Gateway API Inference Extension (GIE) endpoint picker: weighted scorers, max score.

Rules (GIE's EPP scheduler, https://gateway-api-inference-extension.sigs.k8s.io/ and
the scorer plugins under pkg/epp/scheduling/framework/plugins/ in
https://github.com/kubernetes-sigs/gateway-api-inference-extension; llm-d's write-up
of the same Filter -> Score -> Pick cycle at
https://llm-d.ai/docs/architecture/core/router/epp/scheduling). The default scheduling
profile scores every candidate with three scorers, each in [0, 1], adds them with
per-scorer weights, and the max-score picker takes the highest total:

- prefix-cache: fraction of the prompt's blocks found cached on the candidate
  (longest matched prefix / prompt blocks; 0 for a prompt with no full block);
- queue: ``(max_q - q) / (max_q - min_q)`` over the candidates, where ``q`` is the
  waiting-queue length; 1.0 for all when every queue is equal (fewer is better);
- kv-cache-utilization: ``1 - kv_usage``.

Weights default to 1:1:1 (the project's chosen GIE profile; GIE's sample configs also
raise the prefix weight, e.g. 3, which ``prefix_weight`` allows). Ties on the total are
broken uniformly at random, as GIE's max-score picker shuffles candidates before taking
the max; here with ``random.Random(seed)`` over the candidate order given.

Differences from GIE (ours): GIE's prefix scorer keeps its own approximate LRU index of
routed prompt blocks; here the prefix score reads the router's directory
(``view.prefix_match``), which is kept exact by KV events. ``q`` is the waiting queue as
the router sees it, ``num_waiting + in_flight`` (requests routed since the last report
have not started yet). ``expected_cached_tokens`` is the chosen candidate's directory
match.
"""

from __future__ import annotations

import random
from typing import ClassVar

from kvroute.router.policies.common import cached_tokens
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest


class WeightedScorersGIEPolicy(Policy):
    name: ClassVar[str] = "weighted_scorers_gie"

    def __init__(
        self,
        prefix_weight: float = 1.0,
        queue_weight: float = 1.0,
        kv_weight: float = 1.0,
        seed: int = 0,
    ) -> None:
        if min(prefix_weight, queue_weight, kv_weight) < 0:
            raise ValueError("scorer weights must be non-negative")
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self._rng = random.Random(seed)

    def scores(self, request: RouteRequest, view: ClusterView) -> dict[ReplicaId, float]:
        """Weighted total per candidate (exposed for tests and diagnostics)."""
        return self._evaluate(request, view)[0]

    def _evaluate(
        self, request: RouteRequest, view: ClusterView
    ) -> tuple[dict[ReplicaId, float], dict[ReplicaId, int]]:
        cands = request.candidates
        total_blocks = len(request.block_hashes)
        matches = view.prefix_match(request.block_hashes, cands) if total_blocks else {}
        loads = {r: view.load(r) for r in cands}
        queues = {r: loads[r].num_waiting + loads[r].in_flight for r in cands}
        q_max, q_min = max(queues.values()), min(queues.values())
        out: dict[ReplicaId, float] = {}
        for r in cands:
            prefix = matches.get(r, 0) / total_blocks if total_blocks else 0.0
            queue = 1.0 if q_max == q_min else (q_max - queues[r]) / (q_max - q_min)
            kv = 1.0 - loads[r].kv_usage
            out[r] = self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv
        return out, matches

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        scores, matches = self._evaluate(request, view)
        best = max(scores.values())
        tied = [r for r in request.candidates if scores[r] == best]
        replica = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        blocks = matches.get(replica, 0)
        return RouteDecision(replica, cached_tokens(blocks, view.block_size, request.num_tokens), "score")
