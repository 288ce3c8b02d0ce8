"""SGLang router's ``cache_aware`` policy, over block hashes.

Rules, as SGLang documents them (router guide, "Cache-Aware Load-Balancing Router",
https://docs.sglang.ai/router/router.html, source docs/router/router.md in
https://github.com/sgl-project/sglang):

1. Load of a worker = requests the router has sent it that are not finished; here
   ``ReplicaLoad.queue_len``. The system is *imbalanced* when BOTH
   ``max_load - min_load > balance_abs_threshold`` AND
   ``max_load > balance_rel_threshold * min_load`` (over the candidates). Then the
   request goes to the least-loaded worker (reason ``"balance"``).
2. Otherwise the prompt is matched against the router's own approximate tree of what it
   has routed to each worker (SGLang never sees the workers' KV events). The match rate
   is the best worker's matched length / prompt length. If it is strictly greater than
   ``cache_threshold`` the request goes to the worker with the highest match
   (``"cache_hit"``);
3. else to the worker with the smallest tree, i.e. the most free cache
   (``"smallest_tree"``).
4. Every routed prompt is inserted into the chosen worker's tree; trees are trimmed
   least-recently-used leaves first once larger than ``max_tree_size``; a removed
   worker's tree is dropped.

Defaults are those of the sglang-router CLI we benchmark (``python -m
sglang_router.launch_router --help``, 0.3.x): ``cache_threshold=0.3``,
``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``, ``max_tree_size=2**26``
characters (here blocks). The router guide's older defaults (0.5 / 32 / 1.0001 /
2**24) are not the CLI's.

Approximations (ours): the tree is over full-block hashes instead of characters
(``approx_tree.ApproxPrefixTree``), so match length and tree size are in blocks and a
prompt shorter than one block always has match rate 0; ``max_tree_size`` bounds each
replica's block count and is enforced at insert instead of on SGLang's 60 s eviction
timer. Ties (SGLang leaves them to iteration order): among equally good workers, the
shorter queue wins, then the earlier candidate. ``expected_cached_tokens`` is the
chosen worker's match in this policy's own tree.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

from kvroute.router.policies.approx_tree import ApproxPrefixTree, TreePolicy
from kvroute.router.policies.common import cached_tokens, least_loaded
from kvroute.router.policy import ClusterView
from kvroute.router.types import RouteDecision, RouteRequest

SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS_THRESHOLD = 64
SGLANG_BALANCE_REL_THRESHOLD = 1.5
SGLANG_MAX_TREE_SIZE = 2**26


class CacheAwareSGLangPolicy(TreePolicy):
    name: ClassVar[str] = "cache_aware_sglang"
    default_max_tree_size: ClassVar[int] = SGLANG_MAX_TREE_SIZE

    def __init__(
        self,
        cache_threshold: float = SGLANG_CACHE_THRESHOLD,
        balance_abs_threshold: int = SGLANG_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = SGLANG_BALANCE_REL_THRESHOLD,
        max_tree_size: int | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be non-negative")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxPrefixTree(self.default_max_tree_size if max_tree_size is None else max_tree_size)

    def imbalanced(self, loads: Iterable[int]) -> bool:
        """Rule 1: the load gap passes both thresholds."""
        loads = list(loads)
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        cands = request.candidates
        loads = {r: view.load(r).queue_len for r in cands}
        matches = self.tree.match(request.text_hashes, cands)
        if self.imbalanced(loads.values()):
            replica = least_loaded(cands, view)
            reason = "balance"
        else:
            total = len(request.text_hashes)
            best = max(matches.values())
            if total > 0 and best / total > self.cache_threshold:
                replica = min(cands, key=lambda r: (-matches[r], loads[r]))
                reason = "cache_hit"
            else:
                replica = min(cands, key=lambda r: (self.tree.size(r), loads[r]))
                reason = "smallest_tree"
        return RouteDecision(
            replica, cached_tokens(matches[replica], view.block_size, request.num_tokens), reason
        )
