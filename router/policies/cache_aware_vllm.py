"""vllm-router's ``cache_aware`` policy, over block hashes.

Rules, as vllm-router's source states them (``src/policies/cache_aware.rs`` and the
radix tree in ``src/tree.rs``, https://github.com/vllm-project/router, read at its
current head; the wheel benchmarked is 0.1.17, whose CLI defaults are the same):

1. Load of a worker = requests in flight there (``ReplicaLoad.queue_len`` here). The
   system is *imbalanced* when BOTH ``max_load - min_load > balance_abs_threshold`` AND
   ``max_load > balance_rel_threshold * min_load``; then the request goes to the least
   loaded worker (reason ``"balance"``), and its prompt still enters that worker's tree.
2. Otherwise the prompt text is matched against one radix tree shared by all workers;
   match rate = matched characters / prompt characters. Above ``cache_threshold`` the
   request goes to the *last worker that was sent text through the deepest matched
   node* (the tree caches each node's most recent tenant; reason ``"cache_hit"``);
3. else to the least loaded worker (``"min_load"``), not to the smallest tree as in
   SGLang's router, from which vllm-router's policy descends.
4. Every routed prompt is inserted under the chosen worker; trees are trimmed to
   ``max_tree_size`` characters per worker on a timer; a removed worker is dropped.
   (Session keys from headers and chat histories are not used by completions.)

Rule 2's recency is, we believe, what separates it from SGLang's router on salted
tenants (router/POLICIES.md has the measured hit rates): tenants that share a
system prompt's text (each with its own ``cache_salt``) all follow the worker that last
took that text, so their salted prefixes stay together on one worker and mostly hit;
SGLang's tree returns an arbitrary tenant of the node, which scatters them.

Defaults are the wheel's CLI defaults: ``cache_threshold=0.3``,
``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``, ``max_tree_size=2**25``.

Approximations (ours): the tree is over full-block hashes (``approx_tree``), so match
length and tree size are in blocks; the node's last tenant is the last replica routed a
prompt whose text hashes contain the deepest matched block (kept for as many hashes as
one tree may hold); when that replica is gone the best matchers' shortest queue wins.
Eviction happens at insert, not on a timer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

from kvroute.replica.block_hash import BlockHash
from kvroute.router.policies.cache_aware_sglang import CacheAwareSGLangPolicy
from kvroute.router.policies.common import cached_tokens, least_loaded
from kvroute.router.policy import ClusterView
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest


class CacheAwareVLLMPolicy(CacheAwareSGLangPolicy):
    """Takes SGLang's constructor; the thresholds' defaults are the same in both CLIs."""

    name: ClassVar[str] = "cache_aware_vllm"
    default_max_tree_size: ClassVar[int] = 2**25

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._last: OrderedDict[BlockHash, ReplicaId] = OrderedDict()  # block -> last replica routed it

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        cands = request.candidates
        hashes = request.text_hashes
        loads = {r: view.load(r).queue_len for r in cands}
        matches = self.tree.match(hashes, cands)
        best = max(matches.values())
        if self.imbalanced(loads.values()):
            replica, reason = least_loaded(cands, view), "balance"
        elif hashes and best / len(hashes) > self.cache_threshold:
            last = self._last.get(hashes[best - 1])
            if last is None or matches.get(last, 0) < best:
                last = min((r for r in cands if matches[r] == best), key=lambda r: loads[r])
            replica, reason = last, "cache_hit"
        else:
            replica, reason = least_loaded(cands, view), "min_load"
        return RouteDecision(replica, cached_tokens(matches[replica], view.block_size, request.num_tokens), reason)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        super().on_routed(request, decision)
        for h in request.text_hashes:
            self._last[h] = decision.replica_id
            self._last.move_to_end(h)
        while len(self._last) > self.tree.max_blocks_per_replica:
            self._last.popitem(last=False)
