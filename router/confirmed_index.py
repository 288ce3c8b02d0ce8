"""Confirmed directory entries: the blocks each replica's KV events say it holds
(pure Python).

Each block hash maps to an ``int`` bitmask of the replicas that reported it stored
(each replica owns one bit, given by the directory). Per replica the entries sit in an
LRU (``OrderedDict``, oldest first) bounded by the replica's KV capacity in blocks: past
it the least recently stored/touched entry is dropped. Events apply in ``seq`` order
per replica: ``cleared``, then ``removed``, then ``stored`` (``KVEvents`` contract). A
hash's mask has a replica's bit iff the hash is in that replica's LRU.

Stale replicas: an event whose ``seq`` skips ahead marks the replica stale; its entries
are kept and still used for matching (mostly right, and better than nothing), but no
event is applied until ``apply_snapshot`` replaces them exactly. An event with ``seq <=
last`` right after a snapshot was already folded into it and is skipped; any other
``seq != last + 1`` (e.g. a replica restarted at seq 1) marks the replica stale too.

``depths`` finds, for a request, how many leading blocks each replica holds. It relies
on prefix closure: block hashes are chained, a replica stores a block only after its
parent and evicts a chain tail first (``replica/block_pool.py``), so the owner set only
shrinks along the request, and a bisection finds where: 2 lookups for a full hit and
about ``log2(blocks)`` more per distinct depth among the candidates.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from itertools import repeat
from typing import Iterable, Sequence

from kvroute.replica.block_hash import BlockHash


class Applied(enum.Enum):
    NEW = "new"  # the batch was applied
    FOLDED = "folded"  # already part of the last snapshot: skipped
    STALE = "stale"  # a gap: the replica is stale and the batch was not applied


class Confirmed:
    """One replica's confirmed entries and event position."""

    __slots__ = ("mask", "capacity", "lru", "last_seq", "stale", "after_snapshot")

    def __init__(self, mask: int, capacity: int) -> None:
        self.mask = mask
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.last_seq = 0
        self.stale = False
        self.after_snapshot = False


class _Masks(dict):
    """Interning table for owner masks: equal masks share one int object, so a walk
    over a million entries reads a few hot mask objects instead of one cold object per
    block (one cache miss less per block). Identity is only a speed-up (every test is
    by value). It holds one entry per distinct owner set ever seen, a few dozen in
    practice."""

    def __missing__(self, m: int) -> int:
        self[m] = m
        return m


class ConfirmedIndex:
    """Block hash → owner mask, kept exact by the replicas' events (module docstring)."""

    def __init__(self) -> None:
        self._owners: dict[int, int] = {}
        self._intern = _Masks().__getitem__

    def __len__(self) -> int:
        """Distinct hashes some replica holds."""
        return len(self._owners)

    def add(self, bit: int, capacity: int) -> Confirmed:
        return Confirmed(self._intern(1 << bit), capacity)

    def forget(self, rep: Confirmed) -> None:
        """Take every entry of a replica that leaves (its bit may then be reused)."""
        keep = ~rep.mask
        for h in rep.lru:
            self._clear(h, keep)
        rep.lru = OrderedDict()

    def owners_of(self, block_hash: int) -> int:
        return self._owners.get(block_hash, 0)

    def set_capacity(self, rep: Confirmed, capacity: int) -> None:
        rep.capacity = capacity
        self._evict_over_capacity(rep)

    def apply(self, rep: Confirmed, seq: int, stored: Sequence[int], removed: Iterable[int], cleared: bool) -> Applied:
        """Apply one event batch of ``rep`` (module docstring)."""
        if rep.stale:
            return Applied.STALE
        if seq != rep.last_seq + 1:
            if seq <= rep.last_seq and rep.after_snapshot:
                return Applied.FOLDED
            rep.stale = True
            return Applied.STALE
        rep.last_seq = seq
        rep.after_snapshot = False
        lru = rep.lru
        if cleared:
            keep = ~rep.mask
            for h in lru:
                self._clear(h, keep)
            lru.clear()
        if removed:
            self._remove(rep, removed)
        if stored:
            self._store(rep, stored)
        if len(lru) > rep.capacity:
            self._evict_over_capacity(rep)
        return Applied.NEW

    def _remove(self, rep: Confirmed, removed: Iterable[int]) -> None:
        owners, lru, mask, intern = self._owners, rep.lru, rep.mask, self._intern
        keep = ~mask
        for h in removed:
            if h in lru:
                del lru[h]
                m = owners[h]
                if m is mask:  # held by this replica only (masks are interned)
                    del owners[h]
                elif m & keep:
                    owners[h] = intern(m & keep)
                else:
                    del owners[h]

    def _store(self, rep: Confirmed, stored: Sequence[int]) -> None:
        # One lookup per block: insert our bit where nobody holds the block; what comes
        # back says whether we held it already (our bit: in our LRU).
        owners, lru, mask = self._owners, rep.lru, rep.mask
        before = len(owners)
        ms = list(map(owners.setdefault, stored, repeat(mask)))
        if len(owners) - before == len(ms):  # all new to everyone (and no repeats)
            lru.update(zip(stored, repeat(None)))
            return
        intern = self._intern
        for h, m in zip(stored, ms):
            if m & mask:  # ours already, or inserted just now
                if h in lru:
                    lru.move_to_end(h)
                    continue
            else:
                owners[h] = intern(m | mask)
            lru[h] = None

    def apply_snapshot(self, rep: Confirmed, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """Replace ``rep``'s entries by exactly ``block_hashes`` (oldest first, as far
        as the caller knows), as of event ``seq``; clears stale."""
        owners, mask, intern = self._owners, rep.mask, self._intern
        keep = ~mask
        new = dict.fromkeys(int(h) for h in block_hashes)
        for h in rep.lru:
            if h not in new:
                self._clear(h, keep)
        rep.lru = OrderedDict()
        for h in new:
            rep.lru[h] = None
            owners[h] = intern(owners.get(h, 0) | mask)
        rep.last_seq = seq
        rep.stale = False
        rep.after_snapshot = True
        self._evict_over_capacity(rep)

    def depths(self, block_hashes: Sequence[BlockHash], alive: int) -> dict[int, int]:
        """{mask of a replica in ``alive``: the length of the leading run of
        ``block_hashes`` it holds}, for every replica whose run is non-empty.

        The replicas still matching (``cur``) hold the whole request if they hold its
        last block; else a bisection finds the first block where some of them drop
        out, they get that depth, and the search goes on from there with the rest."""
        get = self._owners.get
        last = len(block_hashes) - 1
        cur = get(block_hashes[0], 0) & alive
        depth: dict[int, int] = {}
        if not cur:
            return depth
        tail = get(block_hashes[last], 0) if last else cur
        lo = 0  # every replica in cur holds blocks [0, lo]
        while cur:
            m = tail & cur
            if m == cur:
                while cur:
                    low = cur & -cur
                    depth[low] = last + 1
                    cur ^= low
                break
            hi = last  # cur holds block lo, not all of cur hold block hi (m there)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                mm = get(block_hashes[mid], 0) & cur
                if mm == cur:
                    lo = mid
                else:
                    hi, m = mid, mm
            dropped = cur ^ m  # their run ends at block hi
            while dropped:
                low = dropped & -dropped
                depth[low] = hi
                dropped ^= low
            cur, lo = m, hi
        return depth

    def _clear(self, h: int, keep: int) -> None:
        owners = self._owners
        m = owners.get(h, 0) & keep
        if m:
            owners[h] = self._intern(m)
        else:
            owners.pop(h, None)

    def _evict_over_capacity(self, rep: Confirmed) -> None:
        lru = rep.lru
        keep = ~rep.mask
        while len(lru) > rep.capacity:
            h, _ = lru.popitem(last=False)
            self._clear(h, keep)
