"""The global block directory: which replica holds which KV block (pure Python).

Contract
--------
* Each block hash maps to an ``int`` bitmask of its owners, confirmed or pending; each
  replica owns one bit index, and a removed replica's index is reused by the next one
  added. ``remove_replica`` clears that bit from every entry at once (eagerly, in
  O(entries of that replica)), so a reused bit never inherits old entries and ``match``
  never reports a removed replica.
* **Confirmed** entries come from the replica's KV events. Per replica they sit in an
  LRU (``OrderedDict``, oldest first) bounded by the replica's KV capacity in blocks:
  past it the least recently stored/touched entry is dropped. Events apply in ``seq``
  order per replica: ``cleared``, then ``removed``, then ``stored`` (``KVEvents``
  contract).
* **Stale replicas.** An event whose ``seq`` skips ahead (``seq > last + 1``) marks the
  replica stale: its entries are KEPT and still used for matching (they are mostly
  right, and better than nothing), but no further event is applied until
  ``apply_snapshot(replica, hashes, seq)`` replaces its confirmed set exactly. An event
  with ``seq <= last`` right after a snapshot was already folded into that snapshot and
  is dropped silently; any other ``seq != last + 1`` (e.g. a replica restarted at seq 1)
  marks the replica stale too.
* **Pending** (optimistic) entries: ``add_pending`` records a routed request's blocks
  for the chosen replica at once, separately from the confirmed entries (a block the
  replica already has confirmed is left as it is). A ``stored`` event for the
  same hash confirms it; a pending entry never confirmed expires ``ttl_s`` after it was
  last added. Expiry is lazy: ``match``/``add_pending`` purge the expired entries first,
  in O(expired) (the TTL is constant, so a FIFO queue is sorted by deadline).
* ``match(hashes, candidates)`` gives each candidate the length of the longest LEADING
  run of ``hashes`` it holds. **Prefix closure**, the contract it relies on: a
  request's blocks that a replica holds form a leading run. Block hashes are chained
  (a block's hash covers its parent's), a replica stores a block only after its parent
  and evicts a chain tail first (``replica/block_pool.py``), and pending entries are
  recorded from the held depth onwards, so a replica never holds block ``i + 1`` of a
  request without block ``i``. Then the owner set only shrinks along the request, and
  ``match`` finds where it shrinks by bisection: 2 lookups for a full hit and about
  ``log2(blocks)`` more per distinct depth among the candidates, instead of one lookup
  per block (on a million-block directory each lookup is a few cache misses).
  States that break closure (a hole left by a lost event, a pending tail that outlives
  its head's TTL) are transient; for them a depth may count blocks past the hole.
  ``match_depths`` gives the same as a list in candidate order (the request path's
  form).
* Invariant the fast paths rely on: a replica's confirmed (LRU) and pending entries are
  disjoint, and its bit is set in a hash's owner mask iff the hash is in one of them.

Memory (``python -m kvroute.benchmarks.router_overhead``, CPython 3.11, tracemalloc,
hash ints included): 163 bytes per (block, replica) confirmed entry, 183 bytes per
distinct block with 1.125 owners per block on average (the owner-dict slot, the 128-bit
int key and the LRU node; owner masks are interned, so they cost nothing per block); a
block held by several replicas pays the owner slot and key once.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from itertools import repeat
from typing import Any, Callable, Iterable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.types import ReplicaId


class _Replica:
    __slots__ = ("rid", "bit", "mask", "capacity", "lru", "pending", "last_seq", "stale", "after_snapshot", "removed")

    def __init__(self, rid: ReplicaId, bit: int, capacity: int) -> None:
        self.rid = rid
        self.bit = bit
        self.mask = 1 << bit
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # confirmed, oldest first
        self.pending: dict[int, float] = {}  # hash -> deadline
        self.last_seq = 0
        self.stale = False
        self.after_snapshot = False
        self.removed = False


class _Masks(dict):
    """Interning table for owner masks: equal masks share one int object, so a walk
    over a million entries reads a few hot mask objects instead of one cold object per
    block (one cache miss less per block in ``match``). Identity is only a speed-up
    (every test is by value). It holds one entry per distinct owner set ever seen, a few
    dozen in practice and never more than the blocks ever stored."""

    def __missing__(self, m: int) -> int:
        self[m] = m
        return m


class BlockDirectory:
    """Block hash → owner replicas, kept exact by KV events (see the module docstring)."""

    def __init__(self, pending_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be positive, got {pending_ttl_s!r}")
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._owners: dict[int, int] = {}
        self._masks = _Masks()
        self._intern = self._masks.__getitem__
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._room: list[int] = []  # by bit: capacity - confirmed - pending, kept current
        self._cand_key: object = None  # last candidate list seen by match, and its (reps, mask)
        self._cand_val: tuple[list[_Replica], int, dict[int, int] | None] = ([], 0, {})
        self._expiry: deque[tuple[float, _Replica, list[int]]] = deque()  # one per add_pending call

    # ------------------------------------------------------------------ membership
    def add_replica(self, replica_id: str, capacity_blocks: int) -> None:
        if replica_id in self._replicas:
            raise ValueError(f"replica {replica_id!r} is already in the directory")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks!r}")
        if self._free_bits:
            bit = min(self._free_bits)
            self._free_bits.remove(bit)
        else:
            bit, self._next_bit = self._next_bit, self._next_bit + 1
        rep = _Replica(ReplicaId(replica_id), bit, capacity_blocks)
        rep.mask = self._intern(rep.mask)
        self._replicas[rep.rid] = rep
        if bit == len(self._room):
            self._room.append(0)
        self._sync_room(rep)
        self._cand_key = None

    def remove_replica(self, replica_id: str) -> None:
        rep = self._get(replica_id)
        keep = ~rep.mask
        owners = self._owners
        for h in rep.lru:
            self._clear(owners, h, keep)
        for h in rep.pending:
            if h not in rep.lru:
                self._clear(owners, h, keep)
        rep.removed = True  # queued expiries of it are skipped
        rep.lru = OrderedDict()
        rep.pending = {}
        del self._replicas[rep.rid]
        self._free_bits.append(rep.bit)
        self._cand_key = None

    def replicas(self) -> list[ReplicaId]:
        return list(self._replicas)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def bit_of(self, replica_id: str) -> int:
        return self._get(replica_id).bit

    def set_capacity(self, replica_id: str, capacity_blocks: int) -> None:
        rep = self._get(replica_id)
        rep.capacity = capacity_blocks
        self._evict_over_capacity(rep)
        self._sync_room(rep)

    # ------------------------------------------------------------------ events
    def apply(
        self, replica_id: str, seq: int, stored: Iterable[BlockHash], removed: Iterable[BlockHash], cleared: bool
    ) -> bool:
        """Apply one event batch. False when the replica is (now) stale and it was not applied."""
        rep = self._get(replica_id)
        if rep.stale:
            return False
        if seq != rep.last_seq + 1:
            if seq <= rep.last_seq and rep.after_snapshot:
                return True  # already folded into the snapshot
            rep.stale = True
            return False
        rep.last_seq = seq
        rep.after_snapshot = False
        owners = self._owners
        mask = rep.mask
        keep = ~mask
        lru = rep.lru
        pending = rep.pending
        if cleared:
            for h in lru:
                self._clear(owners, h, keep)  # lru and pending are disjoint
            lru.clear()
        if removed:
            intern = self._intern
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
        if stored:
            # One lookup per block: insert our bit where nobody holds the block; what
            # comes back tells where h is for this replica without two more lookups
            # (bit clear: neither confirmed nor pending; set: exactly one of them).
            before = len(owners)
            ms = list(map(owners.setdefault, stored, repeat(mask)))
            if len(owners) - before == len(ms):  # all new to everyone (and no repeats)
                lru.update(zip(stored, repeat(None)))
            else:
                intern = self._intern
                for h, m in zip(stored, ms):
                    if m is mask or m & mask:  # inserted just now, or ours already
                        if h in lru:
                            lru.move_to_end(h)
                            continue
                        pending.pop(h, None)  # confirmed (its bit stays), if it was pending
                    else:
                        owners[h] = intern(m | mask)
                    lru[h] = None
        if len(lru) > rep.capacity:
            self._evict_over_capacity(rep)
        self._room[rep.bit] = rep.capacity - len(lru) - len(pending)
        return True

    def apply_snapshot(self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """Replace the replica's confirmed entries by exactly ``block_hashes`` (given
        oldest first, as far as the caller knows), as of event ``seq``; clears stale."""
        rep = self._get(replica_id)
        owners = self._owners
        keep = ~rep.mask
        new = dict.fromkeys(int(h) for h in block_hashes)
        for h in rep.lru:
            if h not in new and h not in rep.pending:
                self._clear(owners, h, keep)
        rep.lru = OrderedDict()
        mask = rep.mask
        intern = self._intern
        for h in new:
            rep.lru[h] = None
            rep.pending.pop(h, None)
            owners[h] = intern(owners.get(h, 0) | mask)
        rep.last_seq = seq
        rep.stale = False
        rep.after_snapshot = True
        self._evict_over_capacity(rep)
        self._sync_room(rep)

    def is_stale(self, replica_id: str) -> bool:
        return self._get(replica_id).stale

    def stale_replicas(self) -> list[ReplicaId]:
        return [r.rid for r in self._replicas.values() if r.stale]

    def last_seq(self, replica_id: str) -> int:
        return self._get(replica_id).last_seq

    # ------------------------------------------------------------------ optimistic entries
    def add_pending(
        self, replica_id: str, block_hashes: Sequence[BlockHash], now: float | None = None, start: int = 0
    ) -> int:
        """Record ``block_hashes[start:]`` as pending on the replica (those it has not
        confirmed); returns how many were not pending there already. Re-adding refreshes
        the TTL. The Router passes ``start`` = the blocks ``match`` found the replica
        holding already, so a hit costs O(new blocks) and leaves those TTLs alone."""
        now = self.clock() if now is None else now
        if self._expiry:
            self._purge(now)
        rep = self._get(replica_id)
        tail = block_hashes[start:] if start else block_hashes
        if not tail:
            return 0
        owners = self._owners
        mask = rep.mask
        pending = rep.pending
        deadline = now + self.pending_ttl_s
        before = len(owners)
        # one lookup per block: insert our bit where nobody holds the block, read the rest
        ms = list(map(owners.setdefault, tail, repeat(mask)))
        if len(owners) - before == len(ms):
            # the usual case (a new suffix): nobody held any of it (and no repeats)
            new = tail if type(tail) is list and tail is not block_hashes else list(tail)  # kept by _expiry
            pending.update(zip(new, repeat(deadline)))
            self._expiry.append((deadline, rep, new))
            self._room[rep.bit] = rep.capacity - len(rep.lru) - len(pending)
            return len(new)
        lru = rep.lru
        intern = self._intern
        new = []
        fresh = 0
        for h, m in zip(tail, ms):
            if m is not mask:
                if m & mask:  # (equal masks are one object: m has other bits too)
                    if h in lru:
                        continue  # confirmed there already: left as it is
                else:
                    owners[h] = intern(m | mask)
                    fresh += 1
            elif h in lru:
                continue
            elif h not in pending:
                fresh += 1  # inserted just now by setdefault
            pending[h] = deadline  # new, or refreshed
            new.append(h)
        if new:
            self._expiry.append((deadline, rep, new))
        self._room[rep.bit] = rep.capacity - len(lru) - len(pending)
        return fresh

    def purge_expired(self, now: float | None = None) -> int:
        return self._purge(self.clock() if now is None else now)

    def _purge(self, now: float) -> int:
        expiry = self._expiry
        owners = self._owners
        n = 0
        while expiry and expiry[0][0] <= now:
            deadline, rep, hashes = expiry.popleft()
            if rep.removed:
                continue
            pending = rep.pending
            keep = ~rep.mask
            for h in hashes:
                if pending.get(h) != deadline:
                    continue  # confirmed or refreshed since
                del pending[h]
                if h not in rep.lru:
                    self._clear(owners, h, keep)
                n += 1
            self._sync_room(rep)
        return n

    # ------------------------------------------------------------------ queries
    def match(self, block_hashes: Sequence[BlockHash], candidates: Iterable[str], now: float | None = None) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` each candidate holds (confirmed or pending)."""
        cands = candidates if isinstance(candidates, (list, tuple)) else list(candidates)
        return dict(zip(cands, self.match_depths(block_hashes, cands, now)))  # type: ignore[arg-type]

    def match_depths(self, block_hashes: Sequence[BlockHash], candidates: Sequence[str], now: float | None = None) -> list[int]:
        """``match`` as a list in the order of ``candidates`` (the request path's form)."""
        if self._expiry:
            self._purge(self.clock() if now is None else now)
        if candidates is self._cand_key:  # the Router passes one tuple object per candidate set
            reps, alive, pos = self._cand_val
        else:
            reps = [self._get(c) for c in candidates]
            alive = 0
            for rep in reps:
                alive |= rep.mask
            pos = {rep.mask: i for i, rep in enumerate(reps)}
            if len(pos) != len(reps):
                pos = None  # a candidate listed twice: no position map
            if type(candidates) is tuple:  # immutable: safe to recognise by identity
                self._cand_key, self._cand_val = candidates, (reps, alive, pos)
        depth = self.depths(block_hashes, alive) if block_hashes else None
        if not depth:
            return [0] * len(reps)
        if pos is None:
            return [depth.get(rep.mask, 0) for rep in reps]
        out = [0] * len(reps)
        for m, d in depth.items():
            out[pos[m]] = d
        return out

    def depths(self, block_hashes: Sequence[BlockHash], alive: int) -> dict[int, int]:
        """{bit mask of a replica in ``alive``: the length of the leading run of
        ``block_hashes`` it holds}, for every replica whose run is non-empty (the
        others hold 0). No expiry purge: ``match`` is the public entry point.

        Relies on prefix closure (module docstring): along the request the owner set,
        restricted to ``alive``, only shrinks. So the replicas still matching (``cur``)
        hold the whole request if they hold its last block; else a bisection finds the
        first block where some of them drop out, they get that depth, and the search
        goes on from there with the rest. Lookups: 2 for a full hit, about
        ``log2(blocks)`` more per distinct depth, instead of one per block."""
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
                lo = last
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
        while cur:
            low = cur & -cur
            depth[low] = lo + 1
            cur ^= low
        return depth

    def owners(self, block_hash: BlockHash) -> list[ReplicaId]:
        m = self._owners.get(block_hash, 0)
        return [r.rid for r in self._replicas.values() if m & r.mask]

    def confirmed(self, replica_id: str) -> list[BlockHash]:
        """The replica's confirmed entries, least recently stored/touched first."""
        return [BlockHash(h) for h in self._get(replica_id).lru]

    def pending(self, replica_id: str) -> list[BlockHash]:
        return [BlockHash(h) for h in self._get(replica_id).pending]

    def cache_fill(self, replica_id: str) -> float:
        """(confirmed + pending entries) / capacity: how full the replica's prefix cache is."""
        rep = self._get(replica_id)
        return (len(rep.lru) + len(rep.pending)) / max(rep.capacity, 1)

    def cache_rooms(self, candidates: Sequence[str], positions: Sequence[int]) -> list[int]:
        """Blocks of room left in the cache of ``candidates[i]`` (capacity - confirmed -
        pending, may be negative) for each ``i`` in ``positions``."""
        room = self._room
        if candidates is self._cand_key:
            reps = self._cand_val[0]
            return [room[reps[i].bit] for i in positions]
        return [room[self._get(candidates[i]).bit] for i in positions]

    def num_blocks(self) -> int:
        """Distinct hashes with at least one owner."""
        return len(self._owners)

    def num_entries(self) -> int:
        return sum(len(r.lru) for r in self._replicas.values())

    def num_pending(self) -> int:
        return sum(len(r.pending) for r in self._replicas.values())

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """JSON-serializable state; hashes as hex strings, pending as remaining seconds."""
        now = self.clock()
        self._purge(now)
        return {
            "pending_ttl_s": self.pending_ttl_s,
            "replicas": {
                r.rid: {
                    "capacity_blocks": r.capacity,
                    "last_seq": r.last_seq,
                    "stale": r.stale,
                    "confirmed": [format(h, "x") for h in r.lru],
                    "pending": [[format(h, "x"), round(d - now, 6)] for h, d in r.pending.items()],
                }
                for r in sorted(self._replicas.values(), key=lambda r: r.bit)
            },
        }

    @classmethod
    def restore(cls, state: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> "BlockDirectory":
        d = cls(state["pending_ttl_s"], clock)
        now = clock()
        for rid, rs in state["replicas"].items():
            d.add_replica(rid, rs["capacity_blocks"])
            d.apply_snapshot(rid, [BlockHash(int(h, 16)) for h in rs["confirmed"]], rs["last_seq"])
            rep = d._replicas[ReplicaId(rid)]
            rep.stale = rs["stale"]
            rep.after_snapshot = False
            for h, remaining in sorted(rs["pending"], key=lambda p: p[1]):
                d.add_pending(rid, [BlockHash(int(h, 16))], now + remaining - d.pending_ttl_s)
        return d

    # ------------------------------------------------------------------ internals
    def _get(self, replica_id: str) -> _Replica:
        rep = self._replicas.get(replica_id)  # type: ignore[call-overload]
        if rep is None:
            raise ValueError(f"unknown replica {replica_id!r}; known: {sorted(self._replicas)}")
        return rep

    def _clear(self, owners: dict[int, int], h: int, keep: int) -> None:
        m = owners.get(h, 0) & keep
        if m:
            owners[h] = self._intern(m)
        else:
            owners.pop(h, None)

    def _sync_room(self, rep: _Replica) -> None:
        self._room[rep.bit] = rep.capacity - len(rep.lru) - len(rep.pending)

    def _evict_over_capacity(self, rep: _Replica) -> None:
        lru = rep.lru
        keep = ~rep.mask
        while len(lru) > rep.capacity:
            h, _ = lru.popitem(last=False)
            if h not in rep.pending:
                self._clear(self._owners, h, keep)
