"""What a placement evicts, in seconds of someone else's prefill (pure Python): the
kvroute policy's eviction price for cached prefixes.

A replica's prefix cache fills up and stays full: an engine keeps every freed block
cached until it needs the room. From then on every block a request computes there
evicts a cached block from the tail of that replica's LRU. Recomputing a prefix that
another replica holds therefore costs the fleet twice: the prefill itself (in the
request's TTFT) and the prefix the copy pushes out, which its next request must compute
again. An owner's suffix evicts only the suffix's worth.

``eviction_seconds`` prices each candidate: the tokens the request computes there past
the cache's empty room (the directory's capacity - cached - pending, less what the
replica's queued prefills will take first), times ``value`` (the chance an evicted
token would have been used again), at the fleet's prefill rate. Where the caches have
room, nothing is evicted and the price is 0: the rule changes nothing while KV is
plentiful.

``ReuseValue`` estimates ``value`` from the router's own decisions: the prompt tokens
found cached where they went, over the tokens computed (and so cached), both decayed
over ``half_life`` decisions, capped at 1. A workload that reuses what it caches (shared
system prompts, groups of questions) prices an eviction near one recompute; one that
never repeats a prompt prices it near 0, so its misses spread by load as before. It is
one number for the fleet, not per replica: a replica just given new prefixes has no
reuse to show yet, and priced by its own past it looked empty of anything of value and
drew the copies that evicted those new prefixes (router/POLICIES.md).
"""

from __future__ import annotations

from typing import Sequence


class ReuseValue:
    """The decayed share of the prompt tokens the fleet computed (and cached) that later
    requests found cached again, capped at 1."""

    def __init__(self, half_life: float = 256.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life!r}")
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
        return min(1.0, self.reused / self.stored)


def eviction_seconds(
    own: Sequence[int], queued: Sequence[int], rooms: Sequence[int], block_size: int, value: float, fleet_rate: float
) -> list[float]:
    """Per candidate: the seconds of prefill its evictions cost later requests, for
    ``own`` tokens computed there behind ``queued`` tokens, with ``rooms`` empty blocks
    in its cache whose cached tokens are each worth ``value``."""
    per_token = value / fleet_rate
    return [max(0, o - max(0, r * block_size - q)) * per_token for o, q, r in zip(own, queued, rooms)]
