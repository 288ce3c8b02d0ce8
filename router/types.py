"""Small objects the router hands across its boundary (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, Sequence

from kvroute.replica.block_hash import BlockHash

ReplicaId = NewType("ReplicaId", str)


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of one request: its full-block hashes (computed once, at
    the caller, with the cluster's HashSpec) and its prompt length in tokens."""

    block_hashes: Sequence[BlockHash]
    num_tokens: int
    candidates: Sequence[ReplicaId]


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes, how many of its tokens the router expects to be cached
    there, and why (a short machine-readable reason, e.g. "prefix", "load",
    "hot_prefix_replica", "round_robin", "no_candidates")."""

    replica_id: ReplicaId
    expected_cached_tokens: int
    reason: str


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's load as the router sees it: the last reported figures plus the
    optimistic increments for requests routed since that report."""

    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    capacity_blocks: int = 0
    in_flight: int = 0  # routed here since the last report

    @property
    def queue_len(self) -> int:
        return self.num_waiting + self.num_running + self.in_flight
