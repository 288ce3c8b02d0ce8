"""How many distinct prefixes each replica is serving lately (pure Python).

A prefix is named by its request's first block hash. ``LivePrefixes`` remembers, per
replica, the prefixes the router sent there within the last ``horizon`` decisions
(its own clock: one tick per routed request), in recency order, and counts them.

Why: where caches are full, a replica holding more live prefixes than the others
evicts one of them between that prefix's requests, and those requests recompute it.
Balancing the number of live prefixes per replica, as the affinity routers that only
stick do by their trees' sizes, keeps each one's working set inside its cache. The
count is of the router's own decisions, so several routers each balance the prefixes
they place; the directory cannot say which cached blocks are still being hit (KV
events name stores and evictions, not hits).
"""

from __future__ import annotations

from collections import OrderedDict

from kvroute.replica.block_hash import BlockHash
from kvroute.router.types import ReplicaId


class LivePrefixes:
    """Per replica, the prefixes routed there within the last ``horizon`` decisions."""

    def __init__(self, horizon: int = 2048) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 decision, got {horizon!r}")
        self.horizon = int(horizon)
        self.clock = 0
        self._heads: dict[ReplicaId, OrderedDict[BlockHash, int]] = {}

    def observe(self, replica_id: ReplicaId, head: BlockHash | None) -> None:
        """One routed request (``head``: its first block hash; None: too short to have one)."""
        self.clock += 1
        if head is None:
            return
        heads = self._heads.setdefault(replica_id, OrderedDict())
        heads[head] = self.clock
        heads.move_to_end(head)

    def count(self, replica_id: ReplicaId) -> int:
        """The prefixes ``replica_id`` was sent within the horizon (older ones dropped here)."""
        heads = self._heads.get(replica_id)
        if not heads:
            return 0
        oldest = self.clock - self.horizon
        while heads and next(iter(heads.values())) <= oldest:
            heads.popitem(last=False)
        return len(heads)

    def forget(self, replica_id: ReplicaId) -> None:
        self._heads.pop(replica_id, None)
