"""KV under pressure, for the kvroute policy (pure Python): what a placement evicts, in
seconds of someone else's prefill, and which candidates have the blocks a request needs.

A replica's prefix cache fills up and stays full: an engine keeps every freed block
cached until it needs the room. From then on every block a request computes there
evicts a cached block from the tail of that replica's LRU. Recomputing a prefix that
another replica holds therefore costs the fleet twice: the prefill itself (in the
request's TTFT) and the prefix the copy pushes out, which its next request must compute
again. An owner's suffix evicts only the suffix's worth.

``eviction_seconds`` prices each candidate: the tokens the request computes there past
the cache's empty room (the directory's capacity - cached - pending, less what the
replica's queued prefills will take first), times ``value`` (what an evicted token costs
later requests, in recomputes), at the fleet's prefill rate. Where the caches have room,
nothing is evicted and the price is 0: the rule changes nothing while KV is plentiful.

``ReuseValue`` estimates ``value`` from the router's own decisions: the prompt tokens
found cached where they went, per token computed (and so cached), both decayed over
``half_life`` decisions, capped at ``cap``. A workload that never repeats a prompt
prices an eviction near 0, so its misses spread by load as before; one whose cached
tokens are each found again about twice (a group of questions on one prefix) prices it
near two recomputes: the evicted prefix's next request recomputes it, and that evicts
another still in use. It is one number for the fleet, not per replica: a replica just
given new prefixes has no reuse to show yet, and priced by its own past it looked empty
of anything of value and drew the copies that evicted those new prefixes
(router/POLICIES.md).
"""

from __future__ import annotations

from typing import Sequence

from kvroute.router.types import CandidateTable


class ReuseValue:
    """The prompt tokens requests found cached where they went per token computed (and
    cached), both decayed over ``half_life`` decisions, capped at ``cap``."""

    def __init__(self, half_life: float = 256.0, cap: float = 4.0) -> None:
        if half_life <= 0 or cap <= 0:
            raise ValueError(f"half_life and cap must be positive, got {half_life!r}, {cap!r}")
        self.cap = float(cap)
        self.decay = 2.0 ** (-1.0 / half_life)
        self.reused = 0.0
        self.stored = 0.0

    def observe(self, reused: int, computed: int) -> None:
        """One decision: ``reused`` prompt tokens found cached where it went,
        ``computed`` tokens computed (and cached) there."""
        d = self.decay
        self.reused = self.reused * d + reused
        self.stored = self.stored * d + computed

    @property
    def value(self) -> float:
        if self.stored <= 0:
            return 1.0 if self.reused > 0 else 0.0
        return min(self.cap, self.reused / self.stored)


def eviction_seconds(
    own: Sequence[int], queued: Sequence[int], rooms: Sequence[int], block_size: int, value: float, fleet_rate: float
) -> list[float]:
    """Per candidate: the seconds of prefill its evictions cost later requests, for
    ``own`` tokens computed there behind ``queued`` tokens, with ``rooms`` empty blocks
    in its cache whose cached tokens are each worth ``value``."""
    per_token = value / fleet_rate
    return [max(0, o - max(0, r * block_size - q)) * per_token for o, q, r in zip(own, queued, rooms)]


def kv_admissible(
    table: CandidateTable, cached: dict[int, int], n: int, block_size: int, saturated: bool, ok: list[bool] | None
) -> tuple[list[bool] | None, list[float] | None]:
    """``ok`` narrowed to the candidates whose free blocks, less those their queued
    prefills take, hold what the request needs there (an owner: its suffix), and the
    owners that will once their next KV release frees its blocks (that wait comes
    back per candidate, to add to its TTFT; None: no wait anywhere); a saturated
    fleet's owner of half the prompt or more always passes. ``ok`` unchanged when
    everyone fits, or when no one would."""
    room = [f - q / block_size for f, q in zip(table.free_blocks, table.queued)]
    if min(room) * block_size >= n:
        return ok, None
    short = [n - cached.get(i, 0) - r * block_size for i, r in enumerate(room)]  # tokens missing
    fits = [s <= 0 for s in short]
    waits = None
    if table.release is not None and not all(fits):
        release_s, release_blocks = table.release()
        waits = [0.0] * len(short)
        for i in cached:  # (an owner only: a copy would wait for blocks and evict too)
            if 0 < short[i] <= release_blocks[i] * block_size and release_s[i]:
                fits[i], waits[i] = True, release_s[i]
    if saturated:
        for i, c in cached.items():
            if 2 * c >= n:
                fits[i] = True
    if ok is not None:
        fits = [a and b for a, b in zip(ok, fits)]
    return (fits if any(fits) else ok), waits
