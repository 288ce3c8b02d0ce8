"""The host tier of the KV cache: hashed blocks the device pool evicted, kept in host
memory (pure Python bookkeeping; the bytes live in the model runner's host tensor).

A device block evicted from the prefix cache is offloaded here instead of dropped
(``offload``); a later prefix lookup that misses on the device but finds the block here
restores it: the KV cache manager takes a fresh device block, registers it under the
hash at once, and plans a host -> device copy that the runner performs before the
step's forward pass (``replica/kv_cache_manager.py``). The tier is inclusive: a restored
block stays here too, so evicting it from the device again costs no copy.

Each host block holds one hash and its token ids (a hit is verified against them, as
on the device). Eviction is LRU (front of ``_lru`` first); a block read by a restore
planned for the current step is pinned until the step's copy plan is taken, so no
offload of the same step overwrites it. Changes are reported as net stored/removed
hashes per step, like the device pool's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.kv_events import PendingEvents


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"host tier num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # hash -> (host block id, token ids); front = least recently used
        self._lru: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pinned: set[BlockHash] = set()
        self._events = PendingEvents()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The host block holding ``block_hash`` with exactly ``token_ids``, or None."""
        entry = self._lru.get(block_hash)
        if entry is None or entry[1] != tuple(token_ids):
            return None
        return entry[0]

    def pin(self, block_hash: BlockHash) -> int:
        """Keep the block (a restore of this step reads it) and mark it recently used."""
        self._lru.move_to_end(block_hash)
        self._pinned.add(block_hash)
        return self._lru[block_hash][0]

    def unpin_all(self) -> None:
        self._pinned.clear()

    def offload(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """Make room for and record ``block_hash``; the host block to copy it into, or
        None when no copy is needed (already here: only touched) or possible (every
        host block pinned)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if not self._free and not self._evict_one():
            return None
        host_id = self._free.pop()
        self._lru[block_hash] = (host_id, tuple(token_ids))
        self._events.note(block_hash, True)
        return host_id

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash held, least recently used first (a router resync)."""
        return list(self._lru)

    def reset(self) -> None:
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._pinned.clear()
        self._events.clear()

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last call; stored and removed disjoint."""
        return self._events.take()

    def _evict_one(self) -> bool:
        for block_hash in self._lru:
            if block_hash not in self._pinned:
                host_id, _ = self._lru.pop(block_hash)
                self._free.append(host_id)
                self._events.note(block_hash, False)
                return True
        return False
