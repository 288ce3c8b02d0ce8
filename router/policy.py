"""The interface every routing policy implements, ours and the baselines alike."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.types import ReplicaId, ReplicaLoad, RouteDecision, RouteRequest


class ClusterView(Protocol):
    """What a policy may read of the router's state (the Router implements it)."""

    block_size: int

    def prefix_match(self, block_hashes: Sequence[BlockHash], candidates: Sequence[ReplicaId]) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` each candidate holds (confirmed or pending)."""
        ...

    def load(self, replica_id: ReplicaId) -> ReplicaLoad: ...

    def cache_fill(self, replica_id: ReplicaId) -> float:
        """Fraction of the replica's KV capacity its cached + pending blocks take."""
        ...


class Policy(ABC):
    """Chooses one replica among ``request.candidates`` (never empty when called).

    Policies are plain objects; the Router calls ``on_routed`` after every decision and
    ``on_replica_removed`` when a replica leaves, so a policy that keeps its own
    approximate state (e.g. SGLang's per-worker tree) can update it.
    """

    name: ClassVar[str]

    @abstractmethod
    def choose(self, request: RouteRequest, view: ClusterView) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None

    def on_replica_removed(self, replica_id: ReplicaId) -> None:
        return None
