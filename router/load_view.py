"""What the router believes about each replica's load (pure Python).

A replica reports ``LoadFigures`` on every KV-event batch. Between two reports the router
adds optimistic increments for each request it routed there: one more in flight, and the
request's *uncached* prompt tokens (as the router predicted them) more queued prefill.
A report supersedes them (the report already counts those requests, or they finished),
so the increments reset to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.replica.kv_events import LoadFigures
from kvroute.router.types import ReplicaId, ReplicaLoad


@dataclass
class _Entry:
    capacity_blocks: int
    figures: LoadFigures
    in_flight: int = 0
    added_tokens: int = 0
    reports: int = 0
    cached: ReplicaLoad | None = None  # rebuilt only after a change: load() is on the request path


class LoadView:
    """Per-replica last report + optimistic increments since it."""

    def __init__(self) -> None:
        self._entries: dict[ReplicaId, _Entry] = {}

    def add_replica(self, replica_id: str, capacity_blocks: int) -> None:
        self._entries[ReplicaId(replica_id)] = _Entry(capacity_blocks, LoadFigures())

    def remove_replica(self, replica_id: str) -> None:
        self._entries.pop(ReplicaId(replica_id), None)

    def report(self, replica_id: str, figures: LoadFigures) -> None:
        """A fresh report from the replica: take it and drop the increments."""
        e = self._get(replica_id)
        e.figures = figures
        e.in_flight = 0
        e.added_tokens = 0
        e.reports += 1
        e.cached = None

    def on_routed(self, replica_id: str, uncached_tokens: int) -> None:
        e = self._get(replica_id)
        e.in_flight += 1
        e.added_tokens += max(uncached_tokens, 0)
        e.cached = None

    def has_report(self, replica_id: str) -> bool:
        return self._get(replica_id).reports > 0

    def load(self, replica_id: str) -> ReplicaLoad:
        e = self._entries.get(replica_id)  # type: ignore[call-overload]
        if e is not None and e.cached is not None:
            return e.cached
        e = self._get(replica_id)
        f = e.figures
        e.cached = ReplicaLoad(
            num_waiting=f.num_waiting,
            num_running=f.num_running,
            queued_prefill_tokens=f.queued_prefill_tokens + e.added_tokens,
            kv_usage=f.kv_usage,
            prefill_tokens_per_s=f.prefill_tokens_per_s,
            decode_step_s=f.decode_step_s,
            capacity_blocks=e.capacity_blocks,
            in_flight=e.in_flight,
        )
        return e.cached

    def figures(self, replica_id: str) -> LoadFigures:
        return self._get(replica_id).figures

    def _get(self, replica_id: str) -> _Entry:
        e = self._entries.get(replica_id)  # type: ignore[call-overload]
        if e is None:
            raise ValueError(f"unknown replica {replica_id!r}; known: {sorted(self._entries)}")
        return e
