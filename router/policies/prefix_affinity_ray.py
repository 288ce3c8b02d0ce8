"""Ray Serve's ``PrefixCacheAffinityRouter`` rules, over block hashes.

Rules, as Ray documents them ("PrefixCacheAffinityRouter for LLM inference
optimization", https://docs.ray.io/en/latest/serve/llm/prefix-aware-request-router.html,
source doc/source/serve/advanced-guides/prefix-aware-request-router.md in
https://github.com/ray-project/ray):

1. Load check: if the highest minus the lowest queue length among the candidates is
   greater than ``imbalanced_threshold``, fall back to plain power of two choices
   (reason ``"power_of_two"``).
2. Otherwise match the prompt against the router's own prefix tree of the prompts it
   has routed to each replica ("tenant"); match rate = matched length / prompt length.
   If the rate is at least ``match_rate_threshold`` the best-matching replicas form the
   short list (``"cache_hit"``);
3. else the replicas with the smallest tree do (``"smallest_tree"``), to spread cache
   usage.
4. From the short list the replica with the shortest queue is taken (Ray hands the list
   back to its power-of-two machinery, which probes queue lengths and takes the
   shortest). After routing, the prompt is inserted into the chosen replica's tree; a
   dead replica's entries are removed.

Defaults are Ray's: ``imbalanced_threshold=10``, ``match_rate_threshold=0.1``, and tree
eviction off (``do_eviction=False``; when on, Ray trims at 400,000 characters down to
360,000). Here ``max_tree_blocks=None`` means no eviction; set a block count to bound
each replica's tree (LRU, leaves first).

A LoRA request (Ray Serve LLM: a multiplexed model id) is routed among the replicas
with its adapter loaded, else those with the fewest loaded (``common.multiplex_candidates``),
as Ray's router applies multiplex routing before its prefix match.

Approximations (ours): the tree is over full-block hashes instead of characters
(``approx_tree.ApproxPrefixTree``); queue length is ``ReplicaLoad.queue_len``; ties in
the final queue comparison go to the earlier candidate. ``expected_cached_tokens`` is
the chosen replica's match in this policy's own tree.
"""

from __future__ import annotations

import random
from typing import ClassVar

from kvroute.router.policies.approx_tree import ApproxPrefixTree, TreePolicy
from kvroute.router.policies.common import cached_tokens, multiplex_candidates
from kvroute.router.policies.power_of_two import power_of_two_pick
from kvroute.router.policy import ClusterView
from kvroute.router.types import RouteDecision, RouteRequest

RAY_IMBALANCED_THRESHOLD = 10
RAY_MATCH_RATE_THRESHOLD = 0.1


class PrefixAffinityRayPolicy(TreePolicy):
    name: ClassVar[str] = "prefix_affinity_ray"

    def __init__(
        self,
        imbalanced_threshold: int = RAY_IMBALANCED_THRESHOLD,
        match_rate_threshold: float = RAY_MATCH_RATE_THRESHOLD,
        max_tree_blocks: int | None = None,
        seed: int = 0,
    ) -> None:
        if imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold must be >= 0, got {imbalanced_threshold!r}")
        if not 0.0 <= match_rate_threshold <= 1.0:
            raise ValueError(f"match_rate_threshold must be in [0, 1], got {match_rate_threshold!r}")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = ApproxPrefixTree(max_tree_blocks)
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        cands = multiplex_candidates(request, view)
        loads = {r: view.load(r).queue_len for r in cands}
        matches = self.tree.match(request.text_hashes, cands)
        if max(loads.values()) - min(loads.values()) > self.imbalanced_threshold:
            replica = power_of_two_pick(cands, view, self._rng)
            reason = "power_of_two"
        else:
            total = len(request.text_hashes)
            best = max(matches.values())
            if total > 0 and best > 0 and best / total >= self.match_rate_threshold:
                short = [r for r in cands if matches[r] == best]
                reason = "cache_hit"
            else:
                smallest = min(self.tree.size(r) for r in cands)
                short = [r for r in cands if self.tree.size(r) == smallest]
                reason = "smallest_tree"
            replica = min(short, key=lambda r: loads[r])
        return RouteDecision(
            replica, cached_tokens(matches[replica], view.block_size, request.num_tokens), reason
        )
