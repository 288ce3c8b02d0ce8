"""The global block directory: which replica holds which KV block (pure Python).

Contract
--------
* **Confirmed** entries come from the replica's KV events: each block hash maps to an
  ``int`` bitmask of the replicas that reported it stored (each replica owns one bit;
  a removed replica's bit is reused by the next one added, after ``remove_replica``
  cleared it from every entry, in O(entries of that replica), so a reused bit never
  inherits old entries). Per replica the entries sit in an LRU (``OrderedDict``, oldest
  first) bounded by the replica's KV capacity in blocks: past it the least recently
  stored/touched entry is dropped. Events apply in ``seq`` order per replica:
  ``cleared``, then ``removed``, then ``stored`` (``KVEvents`` contract). A hash's mask
  has a replica's bit iff the hash is in that replica's LRU.
* **Stale replicas.** An event whose ``seq`` skips ahead (``seq > last + 1``) marks the
  replica stale: its entries are KEPT and still used for matching (they are mostly
  right, and better than nothing), but no further event is applied until
  ``apply_snapshot(replica, hashes, seq)`` replaces its confirmed set exactly. An event
  with ``seq <= last`` right after a snapshot was already folded into that snapshot and
  is dropped silently; any other ``seq != last + 1`` (e.g. a replica restarted at seq 1)
  marks the replica stale too.
* **Pending** (optimistic) entries: ``add_pending`` records a routed request's blocks
  past those the replica holds as one *run* (the blocks, the position of the first one
  in the request, a deadline), so the next request sharing that new prefix sees it
  before the replica's events arrive. A run costs O(1 + blocks / STRIDE) to record:
  it is indexed by the hash at each position of its first stride and at every
  STRIDE-aligned position after that, not block by block (a 128-block cold request is
  8 small-dict inserts instead of 128 into the million-entry owner map). A run leaves
  when its last block is confirmed (``stored``: by prefix closure the whole run is
  then confirmed) or ``ttl_s`` after it was added; re-adding blocks adds a run with a
  fresh deadline. Expiry is lazy: ``match``/``add_pending`` purge expired runs first,
  in O(expired) (the TTL is constant, so a FIFO queue is sorted by deadline).
  ``pending(replica)`` lists the blocks of its live runs not confirmed yet; the cache
  room (``cache_rooms``) counts a live run's blocks until the run leaves, so a run
  partly confirmed counts its confirmed part twice for a few steps.
* ``match(hashes, candidates)`` gives each candidate the length of the longest LEADING
  run of ``hashes`` it holds, confirmed or pending. **Prefix closure**, the contract it
  relies on: a request's blocks that a replica holds form a leading run. Block hashes
  are chained (a block's hash covers its parent's), a replica stores a block only after
  its parent and evicts a chain tail first (``replica/block_pool.py``), and pending
  runs start at the held depth. Then the confirmed owner set only shrinks along the
  request, and ``match`` finds where by bisection: 2 lookups for a full hit and about
  ``log2(blocks)`` more per distinct depth among the candidates, instead of one lookup
  per block (on a million-block directory each lookup is a few cache misses). Each
  group of candidates stopping at position ``p`` then looks for pending runs that
  continue the request there (the index at ``p`` and at ``p``'s stride start, 1–2
  small-dict lookups), extends by bisection along the run (chained hashes again: equal
  at a block means equal before it), and repeats from where the run ends.
  States that break closure (a hole left by a lost event, a pending tail that outlives
  its head's TTL) are transient; for them a depth may count blocks past the hole.
  ``match_depths`` gives the same as a list in candidate order (the request path's
  form).

Memory (``python -m kvroute.benchmarks.router_overhead``, CPython 3.11, tracemalloc,
hash ints included): 163 bytes per (block, replica) confirmed entry, 183 bytes per
distinct block with 1.125 owners per block on average (the owner-dict slot, the 128-bit
int key and the LRU node; owner masks are interned, so they cost nothing per block); a
block held by several replicas pays the owner slot and key once.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from heapq import heappop, heappush
from itertools import repeat
from typing import Any, Callable, Iterable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.types import ReplicaId

STRIDE = 16  # pending runs are indexed at every STRIDE-aligned request position


class _Replica:
    __slots__ = (
        "rid", "bit", "mask", "capacity", "lru", "runs", "run_ends", "pending_blocks", "last_seq", "stale",
        "after_snapshot",
    )  # fmt: skip

    def __init__(self, rid: ReplicaId, bit: int, capacity: int) -> None:
        self.rid = rid
        self.bit = bit
        self.mask = 1 << bit
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # confirmed, oldest first
        self.runs: dict[_Run, None] = {}  # live pending runs, oldest first
        self.run_ends: dict[int, list[_Run]] = {}  # last hash of a live run -> its runs
        self.pending_blocks = 0  # blocks in live runs
        self.last_seq = 0
        self.stale = False
        self.after_snapshot = False


class _Run:
    """One routed request's blocks past what its replica held: ``hashes`` are the
    request's blocks from position ``start`` on; ``keys`` the index entries it owns."""

    __slots__ = ("rep", "hashes", "start", "deadline", "keys", "live")

    def __init__(self, rep: _Replica, hashes: list[int], start: int, deadline: float) -> None:
        self.rep = rep
        self.hashes = hashes
        self.start = start
        self.deadline = deadline
        self.keys: list[tuple[int, tuple[_Run, int]]] = []
        self.live = True


class _Masks(dict):
    """Interning table for owner masks: equal masks share one int object, so a walk
    over a million entries reads a few hot mask objects instead of one cold object per
    block (one cache miss less per block in ``match``). Identity is only a speed-up
    (every test is by value). It holds one entry per distinct owner set ever seen, a few
    dozen in practice and never more than the blocks ever stored."""

    def __missing__(self, m: int) -> int:
        self[m] = m
        return m


def _common_run(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """How many blocks ``a[i:]`` and ``b[j:]`` share from their start, given
    ``a[i] == b[j]``: chained hashes are equal at a block only if equal before it, so
    bisect for the last equal pair (2 compares for a full match)."""
    hi = min(len(a) - i, len(b) - j)  # a[i + k] == b[j + k] for k < lo, first unequal in [lo, hi)
    if a[i + hi - 1] == b[j + hi - 1]:
        return hi
    lo, hi = 1, hi - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[i + mid] == b[j + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class BlockDirectory:
    """Block hash → owner replicas, kept exact by KV events (see the module docstring)."""

    def __init__(self, pending_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be positive, got {pending_ttl_s!r}")
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._owners: dict[int, int] = {}  # confirmed only
        self._masks = _Masks()
        self._intern = self._masks.__getitem__
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._room: list[int] = []  # by bit: capacity - confirmed - pending, kept current
        self._cand_key: object = None  # last candidate list seen by match, and its (reps, mask)
        self._cand_val: tuple[list[_Replica], int, dict[int, int] | None] = ([], 0, {})
        self._index: dict[int, list[tuple[_Run, int]]] = {}  # hash -> (run, offset in run)
        self._expiry: deque[_Run] = deque()  # live runs, by deadline

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
        for run in list(rep.runs):
            self._drop(run)
        rep.lru = OrderedDict()
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
        if cleared:
            for h in lru:
                self._clear(owners, h, keep)
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
            # comes back says whether we held it already (our bit: in our LRU).
            before = len(owners)
            ms = list(map(owners.setdefault, stored, repeat(mask)))
            if len(owners) - before == len(ms):  # all new to everyone (and no repeats)
                lru.update(zip(stored, repeat(None)))
            else:
                intern = self._intern
                for h, m in zip(stored, ms):
                    if m & mask:  # ours already, or inserted just now
                        if h in lru:
                            lru.move_to_end(h)
                            continue
                    else:
                        owners[h] = intern(m | mask)
                    lru[h] = None
            ends = rep.run_ends
            if ends and not ends.keys().isdisjoint(stored):  # a run's last block: all of it is confirmed
                for h in stored:
                    runs = ends.get(h)
                    if runs:
                        for run in list(runs):
                            self._drop(run)
        if len(lru) > rep.capacity:
            self._evict_over_capacity(rep)
        self._room[rep.bit] = rep.capacity - len(lru) - rep.pending_blocks
        return True

    def apply_snapshot(self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """Replace the replica's confirmed entries by exactly ``block_hashes`` (given
        oldest first, as far as the caller knows), as of event ``seq``; clears stale.
        Pending runs are left to their TTL."""
        rep = self._get(replica_id)
        owners = self._owners
        keep = ~rep.mask
        new = dict.fromkeys(int(h) for h in block_hashes)
        for h in rep.lru:
            if h not in new:
                self._clear(owners, h, keep)
        rep.lru = OrderedDict()
        mask = rep.mask
        intern = self._intern
        for h in new:
            rep.lru[h] = None
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
        """Record ``block_hashes[start:]`` as one pending run on the replica, past the
        leading ones it has confirmed; returns how many blocks the run holds (0: none
        recorded). The Router passes ``start`` = the blocks ``match`` found the replica
        holding, so a hit costs O(1) and a new suffix O(1 + blocks / STRIDE)."""
        now = self.clock() if now is None else now
        if self._expiry:
            self._purge(now)
        rep = self._get(replica_id)
        n = len(block_hashes)
        lru = rep.lru
        if start < n and block_hashes[start] in lru:  # skip the confirmed lead (prefix closure)
            if block_hashes[n - 1] in lru:
                return 0
            lo, hi = start, n - 1
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if block_hashes[mid] in lru:
                    lo = mid
                else:
                    hi = mid
            start = hi
        if start >= n:
            return 0
        return self._record_run(rep, block_hashes, start, now + self.pending_ttl_s)

    def _record_run(self, rep: _Replica, block_hashes: Sequence[BlockHash], start: int, deadline: float) -> int:
        """Index ``block_hashes[start:]`` (non-empty) as a live run of ``rep``; its
        deadline must not precede any queued run's (the expiry queue stays sorted)."""
        n = len(block_hashes)
        tail = list(block_hashes[start:])
        run = _Run(rep, tail, start, deadline)
        index = self._index
        keys = run.keys
        # index positions: the first stride from start (a later request stopping there
        # finds the run at its own depth), then each aligned position (found from the
        # stride start of any depth inside the run)
        first = min(n, start - start % STRIDE + STRIDE) if start % STRIDE else start + 1
        for pos in (*range(start, first), *range(first + (-first % STRIDE), n, STRIDE)):
            h = block_hashes[pos]
            entry = (run, pos - start)
            lst = index.get(h)
            if lst is None:
                index[h] = [entry]
            else:
                lst.append(entry)
            keys.append((h, entry))
        last = tail[-1]
        ends = rep.run_ends.get(last)
        if ends is None:
            rep.run_ends[last] = [run]
        else:
            ends.append(run)
        rep.runs[run] = None
        rep.pending_blocks += len(tail)
        self._sync_room(rep)
        self._expiry.append(run)
        return len(tail)

    def purge_expired(self, now: float | None = None) -> int:
        """Drop the runs past their deadline; returns how many blocks they held."""
        return self._purge(self.clock() if now is None else now)

    def _purge(self, now: float) -> int:
        expiry = self._expiry
        n = 0
        while expiry and expiry[0].deadline <= now:
            run = expiry.popleft()
            if run.live:
                n += len(run.hashes)
                self._drop(run)
        return n

    def _drop(self, run: _Run) -> None:
        """Take a live run out of the index and its replica's accounting."""
        if not run.live:
            return
        run.live = False
        index = self._index
        for h, entry in run.keys:
            lst = index[h]
            if len(lst) == 1:
                del index[h]
            else:
                lst.remove(entry)
        rep = run.rep
        last = run.hashes[-1]
        ends = rep.run_ends[last]
        if len(ends) == 1:
            del rep.run_ends[last]
        else:
            ends.remove(run)
        del rep.runs[run]
        rep.pending_blocks -= len(run.hashes)
        if rep.rid in self._replicas:
            self._sync_room(rep)

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

        Confirmed first (module docstring): the replicas still matching (``cur``) hold
        the whole request if they hold its last block; else a bisection finds the first
        block where some of them drop out, they get that depth, and the search goes on
        from there with the rest. Then pending runs extend the depths."""
        get = self._owners.get
        last = len(block_hashes) - 1
        cur = get(block_hashes[0], 0) & alive
        depth: dict[int, int] = {}
        if cur:
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
        if self._index:
            self._extend_pending(block_hashes, alive, depth)
        return depth

    def _extend_pending(self, block_hashes: Sequence[BlockHash], alive: int, depth: dict[int, int]) -> None:
        """Extend ``depth`` with the pending runs that continue the request where each
        group of replicas stopped (module docstring)."""
        n = len(block_hashes)
        index = self._index
        at: dict[int, int] = {}  # position -> replicas (bits) stopped there
        rest = alive
        for b, d in depth.items():
            rest ^= b
            if d < n:
                at[d] = at.get(d, 0) | b
        if rest:
            at[0] = at.get(0, 0) | rest
        todo = list(at)
        todo.sort()
        while todo:
            p = heappop(todo)
            group = at.pop(p)
            q = p - p % STRIDE
            hp = block_hashes[p]
            found = index.get(hp)
            if q != p:
                more = index.get(block_hashes[q])
                if more:
                    found = (found or []) + [(run, off + p - q) for run, off in more]
            if not found:
                continue
            reach: dict[int, int] = {}  # bit -> furthest position a run takes it to
            for run, o in found:
                b = run.rep.mask
                if not b & group or o >= len(run.hashes) or run.hashes[o] != hp:
                    continue
                end = p + _common_run(run.hashes, o, block_hashes, p)
                if end > reach.get(b, p):
                    reach[b] = end
            for b, end in reach.items():
                depth[b] = end
                if end < n:
                    if end in at:
                        at[end] |= b
                    else:
                        at[end] = b
                        heappush(todo, end)

    def owners(self, block_hash: BlockHash) -> list[ReplicaId]:
        """Replicas holding the block, confirmed or in a live pending run."""
        m = self._owners.get(block_hash, 0)
        return [r.rid for r in self._replicas.values() if m & r.mask or any(block_hash in run.hashes for run in r.runs)]

    def confirmed(self, replica_id: str) -> list[BlockHash]:
        """The replica's confirmed entries, least recently stored/touched first."""
        return [BlockHash(h) for h in self._get(replica_id).lru]

    def pending(self, replica_id: str) -> list[BlockHash]:
        """Blocks of the replica's live pending runs not confirmed yet, oldest run first."""
        rep = self._get(replica_id)
        lru = rep.lru
        return [BlockHash(h) for h in dict.fromkeys(h for run in rep.runs for h in run.hashes if h not in lru)]

    def cache_fill(self, replica_id: str) -> float:
        """(confirmed entries + pending run blocks) / capacity: how full the replica's
        prefix cache is."""
        rep = self._get(replica_id)
        return (len(rep.lru) + rep.pending_blocks) / max(rep.capacity, 1)

    def cache_rooms(self, candidates: Sequence[str], positions: Sequence[int]) -> list[int]:
        """Blocks of room left in the cache of ``candidates[i]`` (capacity - confirmed -
        pending run blocks, may be negative) for each ``i`` in ``positions``."""
        room = self._room
        if candidates is self._cand_key:
            reps = self._cand_val[0]
            return [room[reps[i].bit] for i in positions]
        return [room[self._get(candidates[i]).bit] for i in positions]

    def num_blocks(self) -> int:
        """Distinct hashes some replica has confirmed."""
        return len(self._owners)

    def num_entries(self) -> int:
        """(block, replica) confirmed entries."""
        return sum(len(r.lru) for r in self._replicas.values())

    def num_pending(self) -> int:
        """Blocks in live pending runs (a run partly confirmed counts whole until it leaves)."""
        return sum(r.pending_blocks for r in self._replicas.values())

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """JSON-serializable state; hashes as hex strings, pending runs with their
        request position and remaining seconds."""
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
                    "pending": [
                        [run.start, [format(h, "x") for h in run.hashes], round(run.deadline - now, 6)] for run in r.runs
                    ],
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
        runs = [(remaining, rid, start, hashes) for rid, rs in state["replicas"].items() for start, hashes, remaining in rs["pending"]]
        for remaining, rid, start, hashes in sorted(runs, key=lambda r: r[0]):  # the expiry queue stays sorted
            # positions before the run are unknown here: pad them (only its own hashes are indexed)
            blocks = [0] * start + [BlockHash(int(h, 16)) for h in hashes]
            d._record_run(d._get(rid), blocks, start, now + remaining)
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
        self._room[rep.bit] = rep.capacity - len(rep.lru) - rep.pending_blocks

    def _evict_over_capacity(self, rep: _Replica) -> None:
        lru = rep.lru
        keep = ~rep.mask
        while len(lru) > rep.capacity:
            h, _ = lru.popitem(last=False)
            self._clear(self._owners, h, keep)
