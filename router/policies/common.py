"""Small helpers the baseline policies share (pure Python)."""

from __future__ import annotations

from typing import Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.policy import ClusterView
from kvroute.router.types import ReplicaId, RouteRequest


def cached_tokens(blocks: int, block_size: int, num_tokens: int) -> int:
    """Tokens a policy expects to be cached for ``blocks`` leading blocks.

    Capped at ``num_tokens - 1``: the engine always computes the last prompt token to
    get logits (ARCHITECTURE.md §4), so at most ``num_tokens - 1`` tokens can be served from
    cache.
    """
    return max(0, min(blocks * block_size, num_tokens - 1))


def least_loaded(candidates: Sequence[ReplicaId], view: ClusterView) -> ReplicaId:
    """The candidate with the shortest queue (``queue_len``); ties go to the earliest."""
    return min(candidates, key=lambda r: view.load(r).queue_len)


def directory_cached_tokens(
    replica_id: ReplicaId, block_hashes: Sequence[BlockHash], num_tokens: int, view: ClusterView
) -> int:
    """What the router's directory says is cached on ``replica_id`` for this prompt."""
    if not block_hashes:
        return 0
    blocks = view.prefix_match(block_hashes, [replica_id]).get(replica_id, 0)
    return cached_tokens(blocks, view.block_size, num_tokens)


def multiplex_candidates(request: RouteRequest, view: ClusterView) -> Sequence[ReplicaId]:
    """Ray Serve's multiplexed-model preference (``MultiplexMixin.apply_multiplex_routing``,
    which its power of two and PrefixCacheAffinityRouter apply to a request with a
    ``multiplexed_model_id``, as Ray Serve LLM gives a LoRA request): the candidates
    that have the request's adapter loaded, else those with the fewest adapters loaded.
    (Ray falls back to every replica after a timeout or when those are full; the
    simulator has neither.) Without an adapter: every candidate."""
    cands = request.candidates
    if request.lora_name is None:
        return cands
    loaded = {r: view.load(r).resident_loras for r in cands}
    having = [r for r in cands if request.lora_name in loaded[r]]
    if having:
        return having
    fewest = min(len(x) for x in loaded.values())
    return [r for r in cands if len(loaded[r]) == fewest]
