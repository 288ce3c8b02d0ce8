"""Small helpers the baseline policies share (pure Python)."""

from __future__ import annotations

from typing import Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.policy import ClusterView
from kvroute.router.types import ReplicaId


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
