"""Coalesces a replica's per-step KV events into the batches it sends the router.

The engine numbers one KVEvents batch per step. Under load a replica steps faster than
one router round trip, so the replica keeps at most one message in flight and folds
every step finished meanwhile into the next one: the net ``stored`` / ``removed`` /
``cleared`` of all of them, numbered by the publisher's own ``seq`` (one per message),
with the newest load figures. No Ray here; the replica deployment drives it.
"""

from __future__ import annotations

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.kv_events import KVEvents, LoadFigures


class EventPublisher:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.seq = 0  # seq of the last batch handed out (or of the last snapshot)
        self._stored: dict[BlockHash, None] = {}  # ordered sets, disjoint
        self._removed: dict[BlockHash, None] = {}
        self._cleared = False
        self._load: LoadFigures | None = None
        self._load_dirty = False

    def add(self, events: KVEvents) -> None:
        """Fold one engine step's batch into the pending message."""
        if events.cleared:
            self._stored.clear()
            self._removed.clear()
            self._cleared = True
        for h in events.removed:
            self._stored.pop(h, None)
            self._removed[h] = None
        for h in events.stored:
            self._removed.pop(h, None)
            self._stored.pop(h, None)  # re-insert: keeps the newest-last order
            self._stored[h] = None
        if events.load is not None:
            self._load_dirty = self._load_dirty or events.load != self._load
            self._load = events.load

    @property
    def has_changes(self) -> bool:
        return bool(self._stored or self._removed or self._cleared or self._load_dirty)

    def take(self) -> KVEvents:
        """The pending message (possibly empty: a heartbeat), numbered ``seq + 1``."""
        self.seq += 1
        batch = KVEvents(
            self.replica_id, self.seq, list(self._stored), list(self._removed), self._cleared, self._load
        )
        self._stored, self._removed, self._cleared, self._load_dirty = {}, {}, False, False
        return batch

    def snapshot_seq(self) -> int:
        """Called when a snapshot of the cache is taken: pending changes are part of it,
        so they are dropped, and the next batch follows the snapshot's ``seq``."""
        self._stored, self._removed, self._cleared = {}, {}, False
        return self.seq
