"""The pool of physical KV blocks: ref counts, the hash table and the LRU free queue.

A block is in exactly one of three states:
- in use: ``ref_cnt > 0`` (held by one or more requests);
- free and cached: ``ref_cnt == 0`` with a hash, in the free queue and the hash table,
  reusable by a later request with the same prefix until it is evicted;
- free and empty: ``ref_cnt == 0`` without a hash, in the free queue.

The free queue is ordered least recently used first. New blocks are taken from its
front; taking a cached block evicts it from the hash table. Freed requests return their
blocks tail-first, so the end of a prefix chain is evicted before its beginning (a
block is only useful while its parents are cached). With a host tier
(``replica/host_tier.py``) an evicted block is offloaded instead of dropped: the pool
records the device -> host copy, which the runner performs before the step that reuses
the device block writes to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, NewType, Sequence

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.host_tier import HostTier
from kvroute.replica.kv_events import PendingEvents

BlockId = NewType("BlockId", int)


@dataclass(eq=False)
class Block:
    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Token ids the block was hashed from: a hit is verified against them, so a hash
    # collision can never serve another prefix's KV.
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Its parent's hash (None: a chain's first block), on a first block the request's
    # cache salt, and the request's LoRA adapter: what an external event stream needs
    # to name the block.
    parent_hash: BlockHash | None = field(default=None, repr=False)
    salt: str | None = field(default=None, repr=False)
    lora_name: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        h = None if self.block_hash is None else f"{self.block_hash:032x}"[:8]
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """Physical blocks plus the prefix-cache hash table and its KV events."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, host: HostTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.host = host
        self.offloads: list[tuple[BlockId, int]] = []  # (device block, host block) copies due this step
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        # block_id -> None, front = least recently used = next to be reused.
        self._free: OrderedDict[BlockId, None] = OrderedDict((b.block_id, None) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        # Net change per hash since the last take_events(): True stored, False removed.
        self._events = PendingEvents()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[BlockId]:
        """Free blocks in eviction order (first is reused next)."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        """The cached block for ``block_hash`` if its stored tokens equal ``token_ids``."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Snapshot of every hash currently in the cache (for a router resync)."""
        return list(self._cached)

    # ------------------------------------------------------------------ changes
    def take_new_blocks(self, n: int) -> list[Block] | None:
        """``n`` blocks from the front of the free queue, evicting cached ones; None if short."""
        if n > len(self._free):
            return None
        out: list[Block] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (= eviction order)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing worth keeping: reuse it before any cached block.
                    self._free[block.block_id] = None
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = None

    def cache_block(
        self, block: Block, block_hash: BlockHash, token_ids: Sequence[int],
        parent_hash: BlockHash | None = None, salt: str | None = None, lora_name: str | None = None,
    ) -> bool:
        """Register a full, computed block under ``block_hash``.

        Returns False (and leaves the block uncached) when caching is off or another
        block already holds this hash, e.g. two requests computed the same prefix in
        the same step.
        """
        assert block.block_hash is None and block.ref_cnt > 0
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash, block.salt, block.lora_name = parent_hash, salt, lora_name
        self._cached[block_hash] = block
        self._events.note(block_hash, True)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        self._events.clear()
        return True

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last call; stored and removed are disjoint."""
        return self._events.take()

    # ------------------------------------------------------------------ internals
    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self._events.note(block.block_hash, False)
        if self.host is not None:
            host_id = self.host.offload(block.block_hash, block.token_ids)
            if host_id is not None:
                self.offloads.append((block.block_id, host_id))
        block.block_hash = None
        block.token_ids = ()
