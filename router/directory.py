"""The global block directory: which replica holds which KV block (pure Python).

Two parts, one per source of truth:

* the **confirmed index** (``confirmed_index.py``): what each replica's KV events say it
  holds, as an owner bitmask per block hash and a per-replica LRU bounded by its KV
  capacity; events apply in ``seq`` order, a gap makes the replica stale until a
  snapshot;
* the **pending runs** (``pending_runs.py``): what the router has just sent to a replica
  and the replica has not confirmed yet, so the next request sharing that new prefix
  follows the first one; a run leaves when its last block is confirmed or its TTL
  (``pending_ttl_s``) passes.

``BlockDirectory`` gives each replica a bit (a removed replica's bit is reused by the
next one added, after every entry of it was cleared) and answers ``match``: the leading
blocks of a request each candidate holds, confirmed or pending. A pending run starts
where its replica's confirmed blocks end, so with prefix closure (§3.3 of
ARCHITECTURE.md) a replica's blocks of a request stay a leading run. States that break
closure (a hole left by a lost event, a pending tail that outlives its head's TTL) are
transient; for them a depth may count blocks past the hole.

A replica with a host tier (``EngineConfig.host_kv_blocks``) has a second confirmed
index, fed by its events' ``host_stored``/``host_removed`` and bounded by its host
capacity: ``host_depths`` gives, past each candidate's device match, how many more
leading blocks its host tier holds (a restore away instead of a recompute).

Candidates are resolved once per candidate set (``select``) and the selection reused
until membership changes: the ``Router`` keeps those selections.

Memory (``python -m kvroute.benchmarks.router_overhead``, CPython 3.11, tracemalloc,
hash ints included): 163 bytes per (block, replica) confirmed entry, 183 bytes per
distinct block with 1.125 owners per block on average (the owner-dict slot, the 128-bit
int key and the LRU node; owner masks are interned, so they cost nothing per block); a
block held by several replicas pays the owner slot and key once.
"""

from __future__ import annotations

import time
from itertools import filterfalse
from typing import Any, Callable, Iterable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.confirmed_index import Applied, Confirmed, ConfirmedIndex
from kvroute.router.pending_runs import PendingRuns, RunSet
from kvroute.router.types import ReplicaId


class _Replica:
    __slots__ = ("rid", "bit", "confirmed", "pending", "host", "alone")

    def __init__(self, rid: ReplicaId, bit: int, confirmed: Confirmed, host: Confirmed | None) -> None:
        self.rid = rid
        self.bit = bit
        self.confirmed = confirmed
        self.pending = RunSet(confirmed.mask)
        self.host = host  # its host tier's confirmed entries (None: no host tier)
        self.alone: Selection = Selection([self])  # this replica as a candidate list (``depth_on``)

    @property
    def room(self) -> int:
        """Blocks of room left in its cache: capacity - confirmed - pending (may be < 0)."""
        c = self.confirmed
        return c.capacity - len(c.lru) - self.pending.blocks


class Selection:
    """A candidate list resolved against the directory: its replicas, their bits
    together, and each bit's position (None when a replica is listed twice). Valid
    until a replica is added or removed."""

    __slots__ = ("replicas", "alive", "position")

    def __init__(self, replicas: list[_Replica]) -> None:
        self.replicas = replicas
        self.alive = 0
        for rep in replicas:
            self.alive |= rep.confirmed.mask
        pos = {rep.confirmed.mask: i for i, rep in enumerate(replicas)}
        self.position = pos if len(pos) == len(replicas) else None


class BlockDirectory:
    """Block hash → owner replicas, confirmed by KV events or pending (module docstring)."""

    def __init__(self, pending_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be positive, got {pending_ttl_s!r}")
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._confirmed = ConfirmedIndex()
        self._host = ConfirmedIndex()  # the replicas' host tiers
        self._pending = PendingRuns()
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    # ------------------------------------------------------------------ membership
    def add_replica(self, replica_id: str, capacity_blocks: int, host_capacity_blocks: int = 0) -> None:
        if replica_id in self._replicas:
            raise ValueError(f"replica {replica_id!r} is already in the directory")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks!r}")
        if self._free_bits:
            bit = min(self._free_bits)
            self._free_bits.remove(bit)
        else:
            bit, self._next_bit = self._next_bit, self._next_bit + 1
        rid = ReplicaId(replica_id)
        host = self._host.add(bit, host_capacity_blocks) if host_capacity_blocks > 0 else None
        self._replicas[rid] = _Replica(rid, bit, self._confirmed.add(bit, capacity_blocks), host)

    def remove_replica(self, replica_id: str) -> None:
        rep = self._get(replica_id)
        self._confirmed.forget(rep.confirmed)
        if rep.host is not None:
            self._host.forget(rep.host)
        self._pending.drop_all(rep.pending)
        del self._replicas[rep.rid]
        self._free_bits.append(rep.bit)

    def replicas(self) -> list[ReplicaId]:
        return list(self._replicas)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def known(self, replica_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """``replica_ids`` split into those in the directory and the others (order kept)."""
        ids = replica_ids if isinstance(replica_ids, (list, tuple)) else list(replica_ids)
        return list(filter(self._replicas.__contains__, ids)), list(filterfalse(self._replicas.__contains__, ids))

    def bit_of(self, replica_id: str) -> int:
        return self._get(replica_id).bit

    def set_capacity(self, replica_id: str, capacity_blocks: int) -> None:
        self._confirmed.set_capacity(self._get(replica_id).confirmed, capacity_blocks)

    def select(self, candidates: Sequence[str]) -> Selection:
        """Resolve ``candidates`` (ValueError naming an unknown one)."""
        return Selection([self._get(c) for c in candidates])

    # ------------------------------------------------------------------ events
    def apply(
        self, replica_id: str, seq: int, stored: Sequence[BlockHash], removed: Iterable[BlockHash], cleared: bool,
        host_stored: Sequence[BlockHash] = (), host_removed: Iterable[BlockHash] = (),
    ) -> bool:
        """Apply one event batch (device and host tier, one ``seq``). False when the
        replica is (now) stale and it was not applied."""
        rep = self._get(replica_id)
        applied = self._confirmed.apply(rep.confirmed, seq, stored, removed, cleared)
        if applied is Applied.NEW and stored:
            self._pending.confirm(rep.pending, stored)  # a run's last block: all of it is confirmed
        if rep.host is not None:
            self._host.apply(rep.host, seq, host_stored, host_removed, cleared)
        return applied is not Applied.STALE

    def apply_snapshot(
        self, replica_id: str, block_hashes: Sequence[BlockHash], seq: int, host_hashes: Sequence[BlockHash] = ()
    ) -> None:
        """Replace the replica's confirmed entries by exactly ``block_hashes`` (and its
        host tier's by ``host_hashes``; each given oldest first, as far as the caller
        knows), as of event ``seq``; clears stale. Pending runs are left to their TTL."""
        rep = self._get(replica_id)
        self._confirmed.apply_snapshot(rep.confirmed, block_hashes, seq)
        if rep.host is not None:
            self._host.apply_snapshot(rep.host, host_hashes, seq)

    def is_stale(self, replica_id: str) -> bool:
        return self._get(replica_id).confirmed.stale

    def stale_replicas(self) -> list[ReplicaId]:
        return [r.rid for r in self._replicas.values() if r.confirmed.stale]

    def last_seq(self, replica_id: str) -> int:
        return self._get(replica_id).confirmed.last_seq

    def capacities(self, replica_id: str) -> tuple[int, int]:
        """The replica's device and host tier capacities in blocks (0: no host tier)."""
        rep = self._get(replica_id)
        return rep.confirmed.capacity, 0 if rep.host is None else rep.host.capacity

    # ------------------------------------------------------------------ optimistic entries
    def add_pending(
        self, replica_id: str, block_hashes: Sequence[BlockHash], now: float | None = None, start: int = 0
    ) -> int:
        """Record ``block_hashes[start:]`` as one pending run on the replica, past the
        leading ones it has confirmed; returns how many blocks the run holds (0: none
        recorded). The Router passes ``start`` = the blocks ``match`` found the replica
        holding, so a hit costs O(1) and a new suffix O(1 + blocks / STRIDE)."""
        now = self.clock() if now is None else now
        if self._pending:
            self._pending.purge(now)
        rep = self._get(replica_id)
        n = len(block_hashes)
        lru = rep.confirmed.lru
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
        return self._pending.record(rep.pending, block_hashes, start, now + self.pending_ttl_s)

    def purge_expired(self, now: float | None = None) -> int:
        """Drop the runs past their deadline; returns how many blocks they held."""
        return self._pending.purge(self.clock() if now is None else now)

    # ------------------------------------------------------------------ queries
    def match(self, block_hashes: Sequence[BlockHash], candidates: Iterable[str], now: float | None = None) -> dict[ReplicaId, int]:
        """Leading blocks of ``block_hashes`` each candidate holds (confirmed or pending)."""
        cands = candidates if isinstance(candidates, (list, tuple)) else list(candidates)
        return dict(zip(cands, self.match_depths(block_hashes, self.select(cands), now)))  # type: ignore[arg-type]

    def depth_on(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """``match`` for one replica (a peer's decision): its leading blocks held."""
        return self.match_depths(block_hashes, self._get(replica_id).alone)[0]

    def match_depths(self, block_hashes: Sequence[BlockHash], selection: Selection, now: float | None = None) -> list[int]:
        """``match`` as a list in the selection's order (the request path's form)."""
        if self._pending:
            self._pending.purge(self.clock() if now is None else now)
        reps = selection.replicas
        if not block_hashes:
            return [0] * len(reps)
        depth = self._confirmed.depths(block_hashes, selection.alive)
        self._pending.extend(block_hashes, selection.alive, depth)
        if not depth:
            return [0] * len(reps)
        pos = selection.position
        if pos is None:
            return [depth.get(rep.confirmed.mask, 0) for rep in reps]
        out = [0] * len(reps)
        for m, d in depth.items():
            out[pos[m]] = d
        return out

    def confirmed_depths(self, block_hashes: Sequence[BlockHash], selection: Selection) -> list[int]:
        """Leading blocks of ``block_hashes`` each of the selection's replicas has
        confirmed (pending runs left out: what a replica can hand over now)."""
        if not block_hashes:
            return [0] * len(selection.replicas)
        depth = self._confirmed.depths(block_hashes, selection.alive)
        return [depth.get(rep.confirmed.mask, 0) for rep in selection.replicas]

    def host_depths(self, block_hashes: Sequence[BlockHash], selection: Selection, depths: Sequence[int]) -> list[int] | None:
        """For each of the selection's replicas, how many blocks past ``depths[i]`` (its
        device match) its host tier holds in a row; None when no candidate has a host
        tier entry (the common case costs one pass over the candidates)."""
        reps = selection.replicas
        if not any(rep.host is not None and rep.host.lru for rep in reps):
            return None
        out = [0] * len(reps)
        n = len(block_hashes)
        for i, rep in enumerate(reps):
            if rep.host is None or not rep.host.lru:
                continue
            lru, d = rep.host.lru, depths[i]
            j = d
            while j < n and block_hashes[j] in lru:
                j += 1
            out[i] = j - d
        return out

    def host_confirmed(self, replica_id: str) -> list[BlockHash]:
        """The replica's host-tier entries, least recently stored/touched first."""
        host = self._get(replica_id).host
        return [] if host is None else [BlockHash(h) for h in host.lru]

    def owners(self, block_hash: BlockHash) -> list[ReplicaId]:
        """Replicas holding the block, confirmed or in a live pending run."""
        m = self._confirmed.owners_of(block_hash)
        return [
            r.rid for r in self._replicas.values()
            if m & r.confirmed.mask or any(block_hash in run.hashes for run in r.pending.runs)
        ]  # fmt: skip

    def confirmed(self, replica_id: str) -> list[BlockHash]:
        """The replica's confirmed entries, least recently stored/touched first."""
        return [BlockHash(h) for h in self._get(replica_id).confirmed.lru]

    def pending(self, replica_id: str) -> list[BlockHash]:
        """Blocks of the replica's live pending runs not confirmed yet, oldest run first."""
        rep = self._get(replica_id)
        lru = rep.confirmed.lru
        return [BlockHash(h) for h in dict.fromkeys(h for run in rep.pending.runs for h in run.hashes if h not in lru)]

    def cache_fill(self, replica_id: str) -> float:
        """(confirmed entries + pending run blocks) / capacity: how full the replica's
        prefix cache is."""
        rep = self._get(replica_id)
        return (len(rep.confirmed.lru) + rep.pending.blocks) / max(rep.confirmed.capacity, 1)

    def cache_rooms(self, selection: Selection, positions: Sequence[int]) -> list[int]:
        """Blocks of room left in the cache of the selection's ``i``-th replica
        (capacity - confirmed - pending run blocks, may be negative) for each ``i`` in
        ``positions``."""
        reps = selection.replicas
        if isinstance(positions, range) and len(positions) == len(reps):
            return [r.room for r in reps]
        return [reps[i].room for i in positions]

    def num_blocks(self) -> int:
        """Distinct hashes some replica has confirmed."""
        return len(self._confirmed)

    def num_entries(self) -> int:
        """(block, replica) confirmed entries."""
        return sum(len(r.confirmed.lru) for r in self._replicas.values())

    def num_pending(self) -> int:
        """Blocks in live pending runs (a run partly confirmed counts whole until it leaves)."""
        return sum(r.pending.blocks for r in self._replicas.values())

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """JSON-serializable state; hashes as hex strings, pending runs with their
        request position and remaining seconds."""
        now = self.clock()
        self._pending.purge(now)
        return {
            "pending_ttl_s": self.pending_ttl_s,
            "replicas": {
                r.rid: {
                    "capacity_blocks": r.confirmed.capacity,
                    "last_seq": r.confirmed.last_seq,
                    "stale": r.confirmed.stale,
                    "confirmed": [format(h, "x") for h in r.confirmed.lru],
                    "pending": [
                        [run.start, [format(h, "x") for h in run.hashes], round(run.deadline - now, 6)]
                        for run in r.pending.runs
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
            confirmed = d._get(rid).confirmed
            confirmed.stale = rs["stale"]
            confirmed.after_snapshot = False
        runs = [(remaining, rid, start, hashes) for rid, rs in state["replicas"].items() for start, hashes, remaining in rs["pending"]]
        for remaining, rid, start, hashes in sorted(runs, key=lambda r: r[0]):  # the expiry queue stays sorted
            # positions before the run are unknown here: pad them (only its own hashes are indexed)
            blocks = [0] * start + [BlockHash(int(h, 16)) for h in hashes]
            d._pending.record(d._get(rid).pending, blocks, start, now + remaining)
        return d

    def _get(self, replica_id: str) -> _Replica:
        rep = self._replicas.get(replica_id)  # type: ignore[call-overload]
        if rep is None:
            raise ValueError(f"unknown replica {replica_id!r}; known: {sorted(self._replicas)}")
        return rep
