"""Which LoRA adapters are still in use, and which replicas a cold adapter may take a
slot on without evicting one of them (pure Python).

``AdapterDemand`` keeps each adapter's request count decayed on the router's request
clock (each routed request ages every count by ``2 ** (-1 / half_life)``, done lazily:
one multiplication per read). An adapter is *live* while its decayed count is at least
``live_floor``: requested about once in the last ``half_life`` requests or more often.

``slot_price`` says, for each candidate where the request's adapter is not resident,
what a slot there costs: 0 where the adapter is resident; below 1 where a slot is free or
held by an adapter no longer live (the share of live demand already resident there, so
a new adapter goes where the least demand is);
1 where it would evict a redundant copy of a live adapter that is much less in demand
per copy than the request's adapter would be after the copy (replication on purpose,
with ``hysteresis``); 2 where it would evict a live adapter's copy otherwise, which
cycles replicas through adapters: the evicted adapter's next request pays a slot load
and takes another adapter's slot in turn; 2 plus the smallest decayed count per copy
among its resident adapters, so a miss goes where it evicts the least demand. The
policy keeps the cheapest candidates.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


class AdapterDemand:
    """Decayed request counts per adapter (module docstring)."""

    def __init__(self, half_life: float = 256.0, live_floor: float = 0.5) -> None:
        if half_life <= 0 or live_floor <= 0:
            raise ValueError(f"half_life and live_floor must be positive, got {half_life!r}, {live_floor!r}")
        self.decay = 2.0 ** (-1.0 / half_life)
        self.live_floor = live_floor
        self.clock = 0  # requests seen
        self._counts: dict[str, tuple[float, int]] = {}  # adapter -> (count, clock when last updated)

    def observe(self, adapter: str | None) -> None:
        """One routed request (of ``adapter``; None: a base-model request ages the counts too)."""
        self.clock += 1
        if adapter is not None:
            self._counts[adapter] = (self.count(adapter) + 1.0, self.clock)

    def count(self, adapter: str) -> float:
        entry = self._counts.get(adapter)
        if entry is None:
            return 0.0
        c, at = entry
        return c * self.decay ** (self.clock - at)

    def live(self, adapter: str) -> bool:
        return self.count(adapter) >= self.live_floor


def slot_price(
    adapter: str, resident: Sequence[Iterable[str]], slots: Sequence[int], demand: AdapterDemand, hysteresis: float = 2.0
) -> list[float]:
    """Per candidate (its ``resident`` adapters, its ``slots``; 0: no limit): 0 where
    ``adapter`` is resident, below 1 where a slot is free or dead (the share of the
    fleet's live demand its resident adapters already draw, per copy), 1 where the copy evicts a
    redundant copy of an adapter ``hysteresis`` times less in demand per copy, 2 where
    it evicts a live copy, plus the least demand per copy among those it may evict (the
    least recently used is usually the least requested)."""
    sets = [set(r) for r in resident]
    copies = Counter(a for s in sets for a in s)
    own = demand.count(adapter) / (copies[adapter] + 1)
    counts = {a: demand.count(a) for a in copies}
    total = sum(counts.values()) + 1.0
    out: list[float] = []
    for s, m in zip(sets, slots):
        if not m or adapter in s:
            out.append(0.0)
            continue
        live = [(counts[a], copies[a]) for a in s]
        if len(s) < m or any(c < demand.live_floor for c, _ in live):  # the share of demand already there
            out.append(sum(c / n for c, n in live if c >= demand.live_floor) / total)
        elif any(n > 1 and own >= hysteresis * c / n for c, n in live):
            out.append(1.0)
        else:  # evicts a live copy: where it evicts the least demand per copy
            out.append(2.0 + min(c / n for c, n in live))
    return out
