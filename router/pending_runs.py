"""Pending (optimistic) directory entries: the blocks of routed requests that their
replica has not confirmed yet (pure Python).

A routed request's blocks past those its replica holds are recorded as one *run* (the
blocks, the request position of the first one, a deadline), so the next request
sharing that new prefix sees it before the replica's KV events arrive. A run costs
O(1 + blocks / STRIDE) to record: it is indexed by the hash at each position of its
first stride and at every STRIDE-aligned position after that, not block by block (a
128-block cold request is 8 small-dict inserts instead of 128 into the million-entry
owner map). A run leaves when its last block is confirmed (by prefix closure the whole
run then is) or when its deadline passes; expiry is lazy (``purge``), in O(expired):
the TTL is constant, so a FIFO queue is sorted by deadline.

``extend`` continues the confirmed depths of a request with the runs that pick up where
each group of replicas stopped: the index at that position and at its stride start
(1–2 small-dict lookups), then a bisection along the run (chained hashes: equal at a
block means equal before it), repeated from where the run ends.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from typing import Iterable, Sequence

from kvroute.replica.block_hash import BlockHash

STRIDE = 16  # pending runs are indexed at every STRIDE-aligned request position


class RunSet:
    """One replica's live runs: ``mask`` is its owner bit in the directory."""

    __slots__ = ("mask", "runs", "ends", "blocks")

    def __init__(self, mask: int) -> None:
        self.mask = mask
        self.runs: dict[_Run, None] = {}  # live runs, oldest first
        self.ends: dict[int, list[_Run]] = {}  # last hash of a live run -> its runs
        self.blocks = 0  # blocks in live runs (a run partly confirmed counts whole)


class _Run:
    """One routed request's blocks past what its replica held: ``hashes`` are the
    request's blocks from position ``start`` on; ``keys`` the index entries it owns, as
    (hash, offset) pairs: no reference back to the run, so a dropped run is freed at
    once by its reference count, not left to the cyclic GC (which walked every live
    run's entries again at each full collection)."""

    __slots__ = ("owner", "hashes", "start", "deadline", "keys", "live")

    def __init__(self, owner: RunSet, hashes: list[int], start: int, deadline: float) -> None:
        self.owner = owner
        self.hashes = hashes
        self.start = start
        self.deadline = deadline
        self.keys: list[tuple[int, int]] = []
        self.live = True


def common_run(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
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


class PendingRuns:
    """Every replica's live runs, indexed by request position (module docstring)."""

    def __init__(self) -> None:
        self._index: dict[int, list[tuple[_Run, int]]] = {}  # hash -> (run, offset in run)
        self._expiry: deque[_Run] = deque()  # live runs, by deadline

    def __bool__(self) -> bool:
        return bool(self._expiry)

    def record(self, owner: RunSet, block_hashes: Sequence[BlockHash], start: int, deadline: float) -> int:
        """Index ``block_hashes[start:]`` (non-empty) as a live run of ``owner``; its
        deadline must not precede any queued run's. Returns the run's length."""
        n = len(block_hashes)
        tail = block_hashes[start:]
        if not isinstance(tail, list):
            tail = list(tail)
        run = _Run(owner, tail, start, deadline)
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
            keys.append((h, pos - start))
        owner.ends.setdefault(tail[-1], []).append(run)
        owner.runs[run] = None
        owner.blocks += len(tail)
        self._expiry.append(run)
        return len(tail)

    def purge(self, now: float) -> int:
        """Drop the runs past their deadline; returns how many blocks they held."""
        expiry = self._expiry
        n = 0
        while expiry and expiry[0].deadline <= now:
            run = expiry.popleft()
            if run.live:
                n += len(run.hashes)
                self._drop(run)
        return n

    def confirm(self, owner: RunSet, stored: Iterable[int]) -> None:
        """Drop ``owner``'s runs whose last block is among ``stored`` (confirmed)."""
        ends = owner.ends
        if ends and not ends.keys().isdisjoint(stored):
            for h in stored:
                runs = ends.get(h)
                if runs:
                    for run in list(runs):
                        self._drop(run)

    def drop_all(self, owner: RunSet) -> None:
        for run in list(owner.runs):
            self._drop(run)

    def _drop(self, run: _Run) -> None:
        """Take a live run out of the index and its owner's accounting."""
        if not run.live:
            return
        run.live = False
        index = self._index
        for h, off in run.keys:
            lst = index[h]
            if len(lst) == 1:
                del index[h]
            else:
                lst.remove((run, off))  # the run's own entry: equal by identity of the run
        owner = run.owner
        last = run.hashes[-1]
        ends = owner.ends[last]
        if len(ends) == 1:
            del owner.ends[last]
        else:
            ends.remove(run)
        del owner.runs[run]
        owner.blocks -= len(run.hashes)

    def extend(self, block_hashes: Sequence[BlockHash], alive: int, depth: dict[int, int]) -> None:
        """Extend ``depth`` ({owner mask: leading blocks held}) with the runs that
        continue the request where each group of replicas in ``alive`` stopped."""
        if not self._index:
            return
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
                b = run.owner.mask
                if not b & group or o >= len(run.hashes) or run.hashes[o] != hp:
                    continue
                end = p + common_run(run.hashes, o, block_hashes, p)
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
