"""Per-request block tables on top of the block pool: prefix hits and slot allocation."""

from __future__ import annotations

from typing import NamedTuple, Union

from kvroute.replica.block_hash import BlockHash
from kvroute.replica.block_pool import Block, BlockId, BlockPool
from kvroute.replica.host_tier import HostTier
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request


class HostHit(NamedTuple):
    """A prefix block found in the host tier only: admission restores it."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]


Hit = Union[Block, HostHit]


class CopyPlan(NamedTuple):
    """The KV copies a step needs before its forward pass, in this order: device ->
    host offloads of evicted blocks, then host -> device restores."""

    offloads: list[tuple[BlockId, int]]  # (device block, host block)
    restores: list[tuple[int, BlockId]]  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores)


class KVCacheManager:
    """Decides which physical blocks back each request's tokens.

    Blocks are allocated only for the tokens about to be computed, and a block is
    registered in the prefix cache as soon as the step that fills it is scheduled
    (its KV is written before any later request in the same or a later step reads it).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host = HostTier(host_blocks) if host_blocks and enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching, self.host)
        self._restores: list[tuple[int, BlockId]] = []
        self.req_blocks: dict[RequestId, list[Block]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[RequestId, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached (either tier)
        self.host_hits = 0  # of which found in the host tier only

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: RequestId) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[Hit], int]:
        """The longest run of cached blocks from the start of ``request``: device
        blocks, or ``HostHit``s for blocks only the host tier holds.

        The last token is always left to compute (its logits are needed), so a prompt
        that is entirely cached hits every block but the one holding its last token.
        Verified against stored token ids; does not take references. A request that
        wants prompt logprobs computes its whole prompt (no hits).
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return [], 0
        hashes = request.update_block_hashes()
        max_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[Hit] = []
        for i in range(min(max_blocks, len(hashes))):
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            block = self.pool.lookup(hashes[i], tokens)
            if block is not None:
                hits.append(block)
            elif self.host is not None and self.host.lookup(hashes[i], tokens) is not None:
                hits.append(HostHit(hashes[i], tuple(tokens)))
            else:
                break
        return hits, len(hits) * bs

    def record_query(self, num_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
        self.host_hits += num_host_hit_tokens

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, new_computed: list[Hit] = ()
    ) -> int:
        """Free-queue blocks that allocate_slots would consume (hits on free blocks and
        host hits, which each restore into a fresh block, included)."""
        have = len(self.req_blocks.get(request.request_id, ())) + len(new_computed)
        total = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        required = -(-total // self.block_size)
        revived = sum(1 for b in new_computed if isinstance(b, HostHit) or b.ref_cnt == 0)
        return max(required - have, 0) + revived

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: list[Hit] = ()
    ) -> list[Block] | None:
        """Back ``num_new_tokens`` more tokens of ``request`` (after its cache hits).

        ``new_computed`` are prefix hits from :meth:`get_computed_blocks` for a request
        being admitted; they are referenced, not recomputed (a host hit is restored into
        a fresh device block, registered under its hash at once). Returns the newly
        taken blocks, or None (with nothing changed) if the pool is short.
        """
        if self.num_blocks_needed(request, num_new_tokens, new_computed) > self.pool.num_free_blocks:
            return None
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        if new_computed:
            assert not blocks and request.num_computed_tokens == 0
            blocks.extend(self._reference_hits(new_computed, request))
            self._num_cached_blocks[rid] = len(new_computed)
        total = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(blocks)
        new_blocks: list[Block] = []
        if need > 0:
            taken = self.pool.take_new_blocks(need)
            assert taken is not None
            new_blocks = taken
            blocks.extend(new_blocks)
        self._cache_full_blocks(request, total)
        return new_blocks

    def _reference_hits(self, hits: list[Hit], request: Request) -> list[Block]:
        """Device blocks for ``hits``, in order: device hits referenced, host hits
        restored. Both kinds are secured before any block is taken (a take may evict or
        offload): device hits leave the free queue, host hits are pinned."""
        host_ids = {h.block_hash: self.host.pin(h.block_hash) for h in hits if isinstance(h, HostHit)}
        self.pool.touch([h for h in hits if isinstance(h, Block)])
        out: list[Block] = []
        for i, h in enumerate(hits):
            if isinstance(h, HostHit):
                (block,) = self.pool.take_new_blocks(1)  # counted by num_blocks_needed
                parent = out[i - 1].block_hash if i else None
                salt = None if i else request.cache_salt
                self.pool.cache_block(block, h.block_hash, h.token_ids, parent, salt, request.lora_name)
                self._restores.append((host_ids[h.block_hash], block.block_id))
                h = block
            out.append(h)
        return out

    def take_copies(self) -> CopyPlan:
        """The copies planned since the last call (the step being scheduled); releases
        the host blocks they pinned."""
        plan = CopyPlan(self.pool.offloads, self._restores)
        self.pool.offloads, self._restores = [], []
        if self.host is not None:
            self.host.unpin_all()
        return plan

    def _cache_full_blocks(self, request: Request, num_computed_after_step: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(num_computed_after_step, request.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = request.update_block_hashes()
        blocks = self.req_blocks[rid]
        bs = self.block_size
        for i in range(start, end):
            if blocks[i].block_hash is None:
                parent, salt = (hashes[i - 1], None) if i else (None, request.cache_salt)
                tokens = request.token_ids[i * bs : (i + 1) * bs]
                self.pool.cache_block(blocks[i], hashes[i], tokens, parent, salt, request.lora_name)
        self._num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the chain's end is evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.pool.cached_block_hashes()

    def cached_block(self, block_hash: BlockHash) -> Block | None:
        """The device block cached under ``block_hash`` (token ids, parent, salt, adapter)."""
        return self.pool.cached_block(block_hash)

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        return self.pool.take_events()

    def take_host_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """The host tier's (stored, removed, cleared) since the last call."""
        return self.host.take_events() if self.host is not None else ([], [], False)

    def host_block_hashes(self) -> list[BlockHash]:
        return self.host.cached_block_hashes() if self.host is not None else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, on the device and in the host tier; only possible
        while no block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.reset()
        return True
