"""The block hash shared by the engine's prefix cache and the router's directory.

Contract (ARCHITECTURE.md §3.1): only full blocks are hashed; block *i*'s hash is
``xxh3_128(parent ‖ tokens, seed)`` where ``parent`` is the previous block's hash as 16
little-endian bytes and ``tokens`` are the block's token ids as little-endian uint32.
The first block's parent is a root hash that folds in the model id, the request's LoRA
adapter (its name) and its ``cache_salt``, so tenants with different salts, different
adapters (or the base model) and different models never share a block. Stdlib +
xxhash + numpy only: the router imports this module without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)  # unsigned 128-bit integer

_ROOT_TAG = b"kvroute/root/v1\x00"
_MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class HashSpec:
    """Everything that must agree between a replica and the router for hashes to match.

    ``seed`` comes from cluster config (random per cluster unless set), never from
    ``hash()`` or ``os.urandom`` inside a process.
    """

    block_size: int
    seed: int = 0
    model_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")


def root_hash(spec: HashSpec, cache_salt: str | None = None, lora_name: str | None = None) -> BlockHash:
    """The parent of a request's first block: model id, LoRA adapter and cache salt
    folded in. The adapter part (``0x02 name 0x00``; names hold no NUL) precedes the salt
    part (``0x01 salt``), so no salt can imitate an adapter; without an adapter the
    bytes are those of before adapters existed."""
    lora = b"" if lora_name is None else b"\x02" + lora_name.encode("utf-8") + b"\x00"
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    data = _ROOT_TAG + spec.model_id.encode("utf-8") + b"\x00" + lora + salt
    return BlockHash(xxhash.xxh3_128_intdigest(data, spec.seed))


def hash_packed(seed: int, parent: BlockHash, packed: bytes) -> BlockHash:
    """Hash of one full block whose tokens are already packed as little-endian uint32
    bytes, chained on its parent's hash: the one definition every block hash follows."""
    return BlockHash(xxhash.xxh3_128_intdigest(int(parent).to_bytes(16, "little") + packed, seed))


def hash_block(spec: HashSpec, parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained on its parent's hash."""
    if len(tokens) != spec.block_size:
        raise ValueError(f"a block holds exactly {spec.block_size} tokens, got {len(tokens)}")
    return hash_packed(spec.seed, parent, np.asarray(tokens, dtype="<u4").tobytes())


def hash_blocks(
    spec: HashSpec,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from block ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (or the root when starting at
    0), which lets a caller extend a memoized list without rehashing it.
    """
    bs = spec.block_size
    if parent is None:
        if start_block != 0:
            raise ValueError("parent is required when start_block > 0")
        parent = root_hash(spec, cache_salt, lora_name)
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    raw = arr.astype("<u4").tobytes()
    out: list[BlockHash] = []
    seed = spec.seed
    for i in range(start_block, len(token_ids) // bs):
        parent = hash_packed(seed, parent, raw[i * bs * 4 : (i + 1) * bs * 4])
        out.append(parent)
    return out
