"""Coalesces a replica's per-step KV events into the batches it sends the router.

The engine numbers one KVEvents batch per step. Under load a replica steps faster than
one router round trip, so the replica keeps at most one message in flight and folds
every step finished meanwhile into the next one: the net ``stored`` / ``removed`` /
``cleared`` of all of them (and of the host tier's ``host_stored`` / ``host_removed``),
numbered by the publisher's own ``seq`` (one per message), with the newest load
figures. No Ray here; the replica deployment drives it.
"""

from __future__ import annotations

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.kv_events import KVEvents, LoadFigures


class _NetChanges:
    """One tier's net stored / removed hashes (ordered sets, disjoint)."""

    def __init__(self) -> None:
        self.stored: dict[BlockHash, None] = {}
        self.removed: dict[BlockHash, None] = {}

    def fold(self, stored: list[BlockHash], removed: list[BlockHash], cleared: bool) -> None:
        if cleared:
            self.stored.clear()
            self.removed.clear()
        for h in removed:
            self.stored.pop(h, None)
            self.removed[h] = None
        for h in stored:
            self.removed.pop(h, None)
            self.stored.pop(h, None)  # re-insert: keeps the newest-last order
            self.stored[h] = None

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class EventPublisher:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.seq = 0  # seq of the last batch handed out (or of the last snapshot)
        self._device, self._host = _NetChanges(), _NetChanges()
        self._cleared = False
        self._load: LoadFigures | None = None
        self._load_dirty = False

    def add(self, events: KVEvents) -> None:
        """Fold one engine step's batch into the pending message."""
        self._device.fold(events.stored, events.removed, events.cleared)
        self._host.fold(events.host_stored, events.host_removed, events.cleared)
        self._cleared = self._cleared or events.cleared
        if events.load is not None:
            self._load_dirty = self._load_dirty or events.load != self._load
            self._load = events.load

    @property
    def has_changes(self) -> bool:
        return bool(self._device or self._host or self._cleared or self._load_dirty)

    def take(self) -> KVEvents:
        """The pending message (possibly empty: a heartbeat), numbered ``seq + 1``."""
        self.seq += 1
        d, h = self._device, self._host
        batch = KVEvents(self.replica_id, self.seq, list(d.stored), list(d.removed), self._cleared, self._load,
                         list(h.stored), list(h.removed))  # fmt: skip
        self._drop_changes()
        self._load_dirty = False
        return batch

    def snapshot_seq(self) -> int:
        """Called when a snapshot of the cache is taken: pending changes are part of it,
        so they are dropped, and the next batch follows the snapshot's ``seq``."""
        self._drop_changes()
        return self.seq

    def _drop_changes(self) -> None:
        self._device, self._host, self._cleared = _NetChanges(), _NetChanges(), False
