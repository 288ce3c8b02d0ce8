"""Consistent hashing on the prompt's first block: sticky, load-blind affinity.

Rules (the classic ring of Karger et al., as used for session / prefix affinity by
Envoy's ring-hash load balancer,
https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/load_balancing/load_balancers#ring-hash):
each replica owns ``virtual_nodes`` points on a 64-bit ring; a request's key is its
FIRST full block's hash, and it goes to the owner of the first point clockwise from the
key that belongs to a candidate (reason ``"hash"``). So every prompt that shares its
first block (e.g. one system prompt) lands on one replica, whatever the load, and adding
or removing a replica moves only the keys on the arcs it gains or loses (about
1/N of them), never the rest.

A prompt with no full block has nothing cacheable and no block hash to key on (the
router is never given token ids), so it goes to the shortest queue (``"no_block"``),
ties to the earlier candidate.

Defaults: ``virtual_nodes=160`` (ketama's figure), points and keys hashed with
``xxh3_64`` under ``seed``. The ring holds every replica seen as a candidate;
``on_replica_removed`` takes a replica's points out. ``expected_cached_tokens`` is what
the router's directory says the chosen replica holds.
"""

from __future__ import annotations

import bisect
from typing import ClassVar, Sequence

import xxhash

from kvroute.router.policies.common import directory_cached_tokens, least_loaded
from kvroute.router.policy import ClusterView, Policy
from kvroute.router.types import ReplicaId, RouteDecision, RouteRequest


class ConsistentHashPolicy(Policy):
    name: ClassVar[str] = "consistent_hash"

    def __init__(self, virtual_nodes: int = 160, seed: int = 0) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes!r}")
        self.virtual_nodes = virtual_nodes
        self._seed = seed
        self._members: set[ReplicaId] = set()
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[ReplicaId] = []  # owner of each position, same order

    def _rebuild(self) -> None:
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"{r}#{i}".encode(), self._seed), r)
            for r in self._members
            for i in range(self.virtual_nodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def _ensure(self, candidates: Sequence[ReplicaId]) -> None:
        new = set(candidates) - self._members
        if new:
            self._members |= new
            self._rebuild()

    def lookup(self, key: int, candidates: Sequence[ReplicaId]) -> ReplicaId:
        """Owner of the first ring point at or after ``key`` that is a candidate."""
        self._ensure(candidates)
        allowed = set(candidates)
        n = len(self._points)
        start = bisect.bisect_left(self._points, key)
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if owner in allowed:
                return owner
        raise AssertionError("every candidate has points on the ring")

    def key(self, first_block: int) -> int:
        return xxhash.xxh3_64_intdigest(int(first_block).to_bytes(16, "little"), self._seed)

    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision:
        if request.block_hashes:
            replica = self.lookup(self.key(request.block_hashes[0]), request.candidates)
            reason = "hash"
        else:
            replica = least_loaded(request.candidates, view)
            reason = "no_block"
        return RouteDecision(
            replica,
            directory_cached_tokens(replica, request.block_hashes, request.num_tokens, view),
            reason,
        )

    def on_replica_removed(self, replica_id: ReplicaId) -> None:
        if replica_id in self._members:
            self._members.discard(replica_id)
            self._rebuild()
