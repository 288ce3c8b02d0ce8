"""An approximate, per-replica record of the prompts a policy has routed.

SGLang's cache_aware policy and Ray Serve's PrefixCacheAffinityRouter both keep their
own multi-tenant radix tree of the prompt text they have sent to each worker (no KV
events; the tree approximates what each worker probably has cached). We approximate
that tree over chained block hashes: because block *i*'s hash folds in every block
before it, "replica R holds the leading k blocks" is the same as "the first k hashes
are all in R's set", so a per-replica hash set answers a prefix match exactly as a
radix tree over whole blocks would.

Each replica's set is an LRU bounded by ``max_blocks_per_replica``. A request's hashes
are touched leaf-first, so the root blocks of a prompt are always more recent than its
tail and eviction removes the deepest (leaf) blocks first, as the peers' trees do
(both evict least-recently-used leaves). Eviction runs eagerly on insert rather than
on the peers' background timer, so the state is deterministic.

Tree "size" (used by the smallest-tree rule) is the number of blocks held for that
replica; the peers count characters, which is the same quantity in other units.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.policy import Policy
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest


class ApproxPrefixTree:
    """Multi-tenant approximate prefix tree over block hashes, LRU-bounded per tenant."""

    def __init__(self, max_blocks_per_replica: int | None = None) -> None:
        if max_blocks_per_replica is not None and max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be >= 1 or None, got {max_blocks_per_replica!r}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._lru: dict[ReplicaId, OrderedDict[BlockHash, None]] = {}

    def insert(self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash]) -> None:
        """Record that ``block_hashes`` were sent to ``replica_id`` (most recent use)."""
        lru = self._lru.setdefault(replica_id, OrderedDict())
        # Leaf first, root last: the root ends up most recent, so LRU eviction trims
        # prompts from their tails and never orphans a suffix from its prefix.
        for h in reversed(block_hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        if self.max_blocks_per_replica is not None:
            while len(lru) > self.max_blocks_per_replica:
                lru.popitem(last=False)

    def match(self, block_hashes: Sequence[BlockHash], candidates: Iterable[ReplicaId]) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` this tree believes each candidate holds."""
        out: dict[ReplicaId, int] = {}
        for r in candidates:
            lru = self._lru.get(r)
            n = 0
            if lru:
                for h in block_hashes:
                    if h not in lru:
                        break
                    n += 1
            out[r] = n
        return out

    def size(self, replica_id: ReplicaId) -> int:
        """Blocks recorded for ``replica_id`` (0 if never routed to)."""
        lru = self._lru.get(replica_id)
        return len(lru) if lru else 0

    def contains(self, replica_id: ReplicaId, block_hash: BlockHash) -> bool:
        lru = self._lru.get(replica_id)
        return lru is not None and block_hash in lru

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forget everything recorded for ``replica_id``."""
        self._lru.pop(replica_id, None)

    def replicas(self) -> list[ReplicaId]:
        return list(self._lru)


class TreePolicy(Policy):
    """A policy that learns only from its own decisions: every routed request's blocks
    go into ``self.tree`` (set by the subclass) under the chosen replica."""

    tree: ApproxPrefixTree

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        self.tree.insert(decision.replica_id, request.text_hashes)

    def on_replica_removed(self, replica_id: ReplicaId) -> None:
        self.tree.remove_replica(replica_id)
