"""The fleet's hottest prefixes, and who should move them when the fleet changes (pure Python).

``HotPrefixes`` counts the router's decisions (its own and its peers') by prefix. A
prefix is named by its request's first block hash and remembered as the longest run of
block hashes every request of that name shared (a block hash commits to every token
before it, so two runs agree up to block ``i`` exactly when their hashes at ``i`` are
equal: the common run is found by a binary search, O(log n) per decision). Its score is
its hits, each decayed by half every ``half_life`` decisions, so "hot" means hit often
and lately. At most ``capacity`` prefixes are kept (the coldest are dropped in batches).

Two plans read it together with the directory:

* ``warmup_plan``: for a replica that joins, the hottest prefixes with a score of at
  least ``min_hits`` (1.5: two hits lately), each with the replica that has confirmed
  the most of its blocks (the least loaded among equals) as the source, cut to a block
  budget. The new replica pulls them before it takes load.
* ``handoff_plan``: for a replica that leaves, its hottest prefixes that no survivor
  holds as deeply, each with the survivor that should pull it: the one holding most of
  it already, then the one given fewest hand-offs so far, then the least loaded.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.router.directory import BlockDirectory

# (the prefix's block hashes, the replica to pull them from or to hand them to)
Move = tuple[list[BlockHash], str]


class HotPrefixes:
    """Decayed hit counts of the prefixes the router placed (module docstring)."""

    def __init__(self, capacity: int = 512, half_life: int = 4096, max_blocks: int = 512) -> None:
        if capacity < 1 or half_life < 1 or max_blocks < 1:
            raise ValueError("capacity, half_life and max_blocks must be >= 1")
        self.capacity, self.half_life, self.max_blocks = capacity, half_life, max_blocks
        self.clock = 0
        self._entries: dict[BlockHash, list] = {}  # head -> [score, clock of that score, run of hashes]

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, block_hashes: Sequence[BlockHash]) -> None:
        """One routed request whose full blocks hash to ``block_hashes``."""
        self.clock += 1
        if not block_hashes:
            return
        entry = self._entries.get(block_hashes[0])
        if entry is None:
            if len(self._entries) >= 2 * self.capacity:
                self._trim()
            self._entries[block_hashes[0]] = [1.0, self.clock, list(block_hashes[: self.max_blocks])]
            return
        entry[0] = self._decayed(entry) + 1.0
        entry[1] = self.clock
        run = entry[2]
        n = _common(run, block_hashes)
        if n < len(run):
            del run[n:]

    def score(self, head: BlockHash) -> float:
        entry = self._entries.get(head)
        return 0.0 if entry is None else self._decayed(entry)

    def top(self, k: int, min_hits: float = 0.0) -> list[tuple[float, list[BlockHash]]]:
        """The ``k`` highest-scoring prefixes with a score of at least ``min_hits``:
        (score, run of hashes), hottest first."""
        scored = [(self._decayed(e), e[2]) for e in self._entries.values()]
        scored = [s for s in scored if s[0] >= min_hits]
        scored.sort(key=lambda s: -s[0])
        return scored[:k]

    def _decayed(self, entry: list) -> float:
        return entry[0] * 0.5 ** ((self.clock - entry[1]) / self.half_life)

    def _trim(self) -> None:
        keep = sorted(self._entries.items(), key=lambda kv: -self._decayed(kv[1]))[: self.capacity]
        self._entries = dict(keep)


def _common(run: list[BlockHash], hashes: Sequence[BlockHash]) -> int:
    """How many leading hashes ``run`` and ``hashes`` share (chained hashes: a binary search)."""
    n = min(len(run), len(hashes))
    if n == 0 or run[n - 1] == hashes[n - 1]:
        return n
    lo, hi = 0, n - 1  # run[:lo + 1] is shared (the heads are equal), run[hi] is not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if run[mid] == hashes[mid]:
            lo = mid
        else:
            hi = mid
    return lo + 1


def warmup_plan(
    hot: HotPrefixes, directory: BlockDirectory, joining: str, queue_len: Callable[[str], int],
    k: int = 8, max_blocks: int = 1024, min_hits: float = 1.5,
) -> list[Move]:
    """What ``joining`` should pull before it serves: up to ``k`` hot prefixes (at most
    ``max_blocks`` blocks in all), each as the run its best holder has confirmed."""
    others = [r for r in directory.replicas() if r != joining]
    if not others:
        return []
    selection = directory.select(others)
    plan: list[Move] = []
    budget = max_blocks
    for _, run in hot.top(k, min_hits):
        depths = directory.confirmed_depths(run, selection)
        best = max(range(len(others)), key=lambda i: (depths[i], -queue_len(others[i])))
        depth = min(depths[best], budget)
        if depth > 0:
            plan.append((list(run[:depth]), others[best]))
            budget -= depth
        if budget <= 0:
            break
    return plan


def handoff_plan(
    hot: HotPrefixes, directory: BlockDirectory, leaving: str, queue_len: Callable[[str], int],
    k: int = 8, min_hits: float = 1.5,
) -> list[Move]:
    """Which of ``leaving``'s hot prefixes to hand to which survivor (module docstring):
    those it holds deeper than every survivor, up to ``k``."""
    survivors = [r for r in directory.replicas() if r != leaving]
    if leaving not in directory or not survivors:
        return []
    selection, alone = directory.select(survivors), directory.select([leaving])
    given = dict.fromkeys(survivors, 0)
    plan: list[Move] = []
    for _, run in hot.top(4 * k, min_hits):
        held = directory.confirmed_depths(run, alone)[0]
        depths = directory.confirmed_depths(run, selection)
        if held == 0 or max(depths) >= held:
            continue
        target = min(range(len(survivors)), key=lambda i: (-depths[i], given[survivors[i]], queue_len(survivors[i])))
        given[survivors[target]] += 1
        plan.append((list(run[:held]), survivors[target]))
        if len(plan) >= k:
            break
    return plan
