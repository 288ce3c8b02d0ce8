"""How much of a replica's cached prefix will still be there when a request is admitted
(pure Python): the kvroute policy's ``survival`` option."""

from __future__ import annotations

from math import inf

from kvroute.router.types import CandidateTable


def survive(table: CandidateTable, cached: dict[int, int], n: int, block_size: int) -> None:
    """Each owner's cached tokens (``cached``, by candidate position) times the chance
    they survive until the ``n``-token request is admitted: the blocks its queued
    prefills and this request's suffix allocate past the cache's empty room (the
    directory's capacity - cached - pending) are evicted from its evictable cached
    blocks (reported free, less that room), and the prefix is taken to sit anywhere
    among those."""
    owners = list(cached)
    rooms = table.room(owners)  # type: ignore[misc]
    for i, room in zip(owners, rooms):
        free = table.free_blocks[i]
        evict = (table.queued[i] + n - cached[i]) / block_size - max(room, 0)
        evictable = free - max(room, 0)
        if evict > 0 and evictable > 0 and free != inf:
            cached[i] = round(cached[i] * max(0.0, 1.0 - evict / evictable))
