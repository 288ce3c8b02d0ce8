"""What one engine hands another to move a run of cached KV blocks instead of recomputing
them: a header naming every block (hash and token ids) and everything the KV depends on,
and the blocks' bytes. Torch-free: a router or transport reads headers without torch.

The checks here are the importer's guarantee that wrong KV is never served:
``refusal(header, identity)`` names every way a header differs from the importing
engine (hash spec, model, dtype, block size, KV layout), and ``hash_mismatch`` finds the
first block whose hash, recomputed from the header's token ids under the importer's own
spec (with the header's cache salt and LoRA adapter in the root, ARCHITECTURE.md §3.1),
is not the one the header claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.replica.block_hash import BlockHash, HashSpec, hash_blocks


@dataclass(frozen=True)
class KVIdentity:
    """What KV bytes depend on besides the tokens: two engines exchange blocks only
    where these are equal. ``dtype`` is the KV cache's (``float32``, ``bfloat16``, ...;
    ``emulated:PROFILE`` for an emulated engine, whose payloads carry no bytes);
    ``layout`` is ``(layers, kv heads, head dim)``, () for an emulated engine."""

    spec: HashSpec
    model_id: str
    dtype: str
    block_size: int
    layout: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V over every layer (0 for an emulated engine)."""
        return 2 * self.layout[0] * self.row_bytes if self.layout else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer (0 for an emulated engine)."""
        if not self.layout:
            return 0
        _, heads, dim = self.layout
        return self.block_size * heads * dim * _ELEMENT_BYTES[self.dtype]

    def host_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """A payload's host KV shape: ``[layers * 2, num_blocks, row_bytes]`` (uint8)."""
        return (2 * self.layout[0], num_blocks, self.row_bytes)


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVHeader:
    """A run of blocks from a chain's start: block *i* holds ``token_ids[i]`` and is
    cached under ``block_hashes[i]``; ``cache_salt`` and ``lora_name`` are the chain's
    (they are in its root hash). ``source``: the exporting replica's id."""

    identity: KVIdentity
    lora_name: str | None
    cache_salt: str | None
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[tuple[int, ...], ...]
    source: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.identity.block_size


@dataclass(frozen=True)
class KVPayload:
    """A header and its blocks' KV, layer-major as the KV cache holds it (layer 0's K, its
    V, layer 1's K, ...; in each, the blocks in header order): a host ``numpy.uint8``
    array ``[layers * 2, num_blocks, row_bytes]`` (what crosses Ray's object store without
    a copy on read), a device tensor ``[layers * 2, num_blocks, block_size * kv_heads *
    head_dim]`` in the cache's dtype (an export asked to stay on its CUDA device, for a
    device-to-device transport), or None from an emulated engine. Layer-major because a
    gather along the cache's block axis is one fast copy, and a transport may stream it
    layer by layer. ``nbytes``: the KV's size (an emulated payload's is what its
    profile's model would move)."""

    header: KVHeader
    kv: Any
    nbytes: int

    @property
    def num_blocks(self) -> int:
        return self.header.num_blocks


def refusal(header: KVHeader, ours: KVIdentity) -> str | None:
    """Why an engine of identity ``ours`` must refuse ``header``'s KV, naming every
    field that differs; None where they agree. The seed's values are not printed."""
    theirs = header.identity
    why: list[str] = []
    if theirs.spec.seed != ours.spec.seed:
        why.append("hash seed")
    if theirs.model_id != ours.model_id or theirs.spec.model_id != ours.spec.model_id:
        why.append(f"model ({theirs.model_id!r}, here {ours.model_id!r})")
    if theirs.dtype != ours.dtype:
        why.append(f"dtype ({theirs.dtype}, here {ours.dtype})")
    if theirs.block_size != ours.block_size or theirs.spec.block_size != ours.spec.block_size:
        why.append(f"block size ({theirs.block_size}, here {ours.block_size})")
    if theirs.layout != ours.layout:
        why.append(f"KV layout (layers, kv heads, head dim) ({theirs.layout}, here {ours.layout})")
    return "differs from this engine in " + ", ".join(why) if why else None


def shape_problem(header: KVHeader, vocab_size: int) -> str | None:
    """What is malformed in ``header`` (counts, block lengths, token ids); None if nothing."""
    bs = header.identity.block_size
    if len(header.token_ids) != header.num_blocks:
        return f"{header.num_blocks} block hashes but {len(header.token_ids)} blocks of token ids"
    for i, tokens in enumerate(header.token_ids):
        if len(tokens) != bs:
            return f"block {i} holds {len(tokens)} token ids, not {bs}"
        if any(type(t) is not int or not 0 <= t < vocab_size for t in tokens):
            return f"block {i} holds a token id outside [0, {vocab_size})"
    return None


def hash_mismatch(header: KVHeader, spec: HashSpec) -> int | None:
    """The first block whose hash under ``spec``, recomputed from the header's token ids,
    salt and adapter, differs from the header's; None if every one matches."""
    flat = [t for block in header.token_ids for t in block]
    ours = hash_blocks(spec, flat, header.cache_salt, lora_name=header.lora_name)
    for i, (mine, claimed) in enumerate(zip(ours, header.block_hashes)):
        if mine != claimed:
            return i
    return None
