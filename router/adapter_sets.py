"""Which LoRA adapters are still in use, how many replicas each one's demand needs, and
which replicas a cold adapter may take a slot on (pure Python).

``AdapterDemand`` keeps each adapter's request count, and their total, decayed on the
router's request clock (each routed request ages every count by ``2 ** (-1 / half_life)``,
done lazily: one multiplication per read). An adapter is *live* while its decayed count
is at least ``live_floor``: requested about once in the last ``half_life`` requests or
more often.

An adapter's copies share its demand. The fair load of one replica is the total demand
over the replicas with adapter slots; an adapter whose demand per copy is above it
*wants* another copy: one replica cannot serve its share without falling behind the
others (a Zipf-hot adapter alone outruns a replica). With ``by_demand`` its set grows
by demand; the kvroute policy leaves that off (``adapter_copies``, measured worse).

``slot_price`` says, for each candidate, what a slot there costs the request's adapter:

- 0 where it is resident;
- below 1 where a slot is free or held by an adapter no longer live: the share of live
  demand already resident there, so a new adapter goes where the least demand is;
- from 1 to 1.5 where it evicts a copy of a live adapter ``hysteresis`` times less in
  demand per copy than the request's adapter would be after the copy, if that copy is
  redundant, or if the request's adapter wants another copy (replication on purpose;
  the price grows with the demand it evicts). The evicted adapter's demand per copy
  must be that much lower, so two adapters never trade a slot back and forth;
- 2 plus the smallest demand per copy among its residents otherwise: the copy evicts a
  live adapter, whose next request pays a slot load and takes another adapter's slot in
  turn, so a miss goes where it evicts the least demand.

The policy keeps candidates priced below 2 (owners, free slots and the copies above,
among which the predicted TTFT decides), or the cheapest where none is.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

EVICTS_LIVE = 2.0  # a slot price from here on evicts an adapter still in use


class AdapterDemand:
    """Decayed request counts per adapter and in total (module docstring)."""

    def __init__(self, half_life: float = 256.0, live_floor: float = 0.5) -> None:
        if half_life <= 0 or live_floor <= 0:
            raise ValueError(f"half_life and live_floor must be positive, got {half_life!r}, {live_floor!r}")
        self.decay = 2.0 ** (-1.0 / half_life)
        self.live_floor = live_floor
        self.clock = 0  # requests seen
        self._counts: dict[str, tuple[float, int]] = {}  # adapter -> (count, clock when last updated)
        self._total = (0.0, 0)  # every adapter's count together, as one entry

    def observe(self, adapter: str | None) -> None:
        """One routed request (of ``adapter``; None: a base-model request ages the counts too)."""
        self.clock += 1
        if adapter is not None:
            self._counts[adapter] = (self.count(adapter) + 1.0, self.clock)
            self._total = (self._aged(self._total) + 1.0, self.clock)

    def _aged(self, entry: tuple[float, int]) -> float:
        c, at = entry
        return c * self.decay ** (self.clock - at)

    def count(self, adapter: str) -> float:
        entry = self._counts.get(adapter)
        return 0.0 if entry is None else self._aged(entry)

    def total(self) -> float:
        """Every adapter's decayed count, summed."""
        return self._aged(self._total)

    def live(self, adapter: str) -> bool:
        return self.count(adapter) >= self.live_floor


def slot_price(
    adapter: str, resident: Sequence[Iterable[str]], slots: Sequence[int], demand: AdapterDemand, hysteresis: float = 2.0,
    by_demand: bool = True,
) -> list[float]:
    """Per candidate (its ``resident`` adapters, its ``slots``; 0: no limit), what a
    slot for ``adapter`` costs there (the module docstring's scale; ``by_demand`` False:
    an adapter that wants another copy gets one only where it evicts no live one)."""
    sets = [set(r) for r in resident]
    copies = Counter(a for s in sets for a in s)
    mine = demand.count(adapter)
    own = mine / (copies[adapter] + 1)  # per copy, with one more
    counts = {a: demand.count(a) for a in copies}
    total = sum(counts.values()) + 1.0
    wants = by_demand and copies[adapter] > 0 and mine / copies[adapter] > demand.total() / max(sum(map(bool, slots)), 1)
    out: list[float] = []
    for s, m in zip(sets, slots):
        if not m or adapter in s:
            out.append(0.0)
            continue
        live = [(counts[a], copies[a]) for a in s]
        if len(s) < m or any(c < demand.live_floor for c, _ in live):  # the share of demand already there
            out.append(sum(c / n for c, n in live if c >= demand.live_floor) / total)
            continue
        colder = [c / n for c, n in live if (n > 1 or wants) and own >= hysteresis * c / n]
        if colder:  # replication on purpose: the least demand it can evict, against its own
            out.append(1.0 + min(colder) / own / 2)
        else:  # evicts a live copy: where it evicts the least demand per copy
            out.append(EVICTS_LIVE + min(c / n for c, n in live))
    return out


def cheapest(prices: Sequence[float]) -> list[bool]:
    """The candidates the policy may choose among: those that evict no live adapter
    against the demand rules (below ``EVICTS_LIVE``), or, where every one does, the
    cheapest."""
    low = min(prices)
    if low < EVICTS_LIVE:
        return [p < EVICTS_LIVE for p in prices]
    return [p == low for p in prices]
