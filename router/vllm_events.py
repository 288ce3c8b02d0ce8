"""vLLM's KV event stream, decoded and translated into kvroute's directory keys.

Wire format, as read in the installed vLLM 0.32.0 source
(``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``,
``vllm/v1/core/kv_cache_utils.py``, ``vllm/config/kv_events.py``):

- PUB socket (``KVEventsConfig.endpoint``), one multipart message per engine step that
  changed the cache: ``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian counter
  starting at 0 for each publisher (a restarted worker starts over), ``topic`` the UTF-8
  of ``KVEventsConfig.topic`` (default empty).
- ``payload``: msgpack of ``KVEventBatch``, an array ``[ts, events, data_parallel_rank]``.
  Each event is a map tagged ``"type"``: ``BlockStored`` {block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, and when not default: extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership,
  session_id}; ``BlockRemoved`` {block_hashes, medium, group_idx, ...};
  ``AllBlocksCleared`` {}. Block hashes are 64-bit ints by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) or digest bytes; ``medium`` is "GPU", "CPU"
  (the offloading connector) or "STORAGE".
- A ``BlockStored`` lists consecutive blocks of one request: block *i*'s parent is block
  *i − 1*, the first block's is ``parent_block_hash`` (None: the request's first block).
  ``token_ids`` holds ``block_size`` tokens per block. ``extra_keys`` has one entry per
  block, untagged: the LoRA name first when ``lora_name`` is set, then multimodal
  ``(identifier, offset)`` pairs, then the ``cache_salt`` string (first block only),
  then prompt-embedding digests (bytes).
- Replay (``KVEventsConfig.replay_endpoint``, a ROUTER socket): send
  ``[b"", start_seq as 8-byte big-endian]`` from a DEALER; the worker answers every
  buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``, then
  ``[b"", b"", -1 as 8 signed bytes, b""]``.

Translation: the directory is keyed on kvroute's own chained hash (ARCHITECTURE.md
§3.1), recomputed from each stored block's token ids and its parent's kvroute hash, never
on vLLM's hash (its function and seed are the worker's business). The first block of a
chain hangs off ``root_hash(spec, cache_salt, lora_name)`` (the engine's own rule), so salts and
LoRA adapters never share blocks, as in vLLM. ``WorkerCache`` keeps the engine-hash ->
kvroute-hash map that removals need and forgets an entry once no tier holds the block;
repeated stores of one engine hash (two physical blocks, or the offloading connector's
re-announcements) are reference-counted, as vLLM asks of consumers (a request sent
with ``kv_cache_report_mode="full"`` re-announces its reused blocks without a new copy:
such a block stays counted until the directory's LRU bound drops it). Blocks it cannot
key exactly are left out, and with them every block chained on them: a parent it never
saw (history lost), multimodal or prompt-embedding extra keys, a block size other than
the spec's, a token id that is not a uint32, a KV cache group other than 0, a medium
other than GPU (device tier) or CPU (host tier). The directory then holds less than the
worker, never more. A batch is unpacked once by msgpack's C decoder and walked once
(``WorkerCache``): the per-block work is one hash call and a few dict operations.
Stdlib, msgpack and xxhash only: no torch, no ZMQ.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

from kvroute.replica.block_hash import BlockHash, HashSpec, hash_packed, root_hash
from kvroute.replica.kv_events import KVEvents

VLLM_VERSION_READ = "0.32.0"
END_SEQ = -1
DEVICE, HOST = "GPU", "CPU"

EngineHash = Any  # int or bytes, as the worker sends it


# ---------------------------------------------------------------------- wire format
def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """``(ts, events, data_parallel_rank)`` of one ``KVEventBatch`` payload."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a msgpack KVEventBatch: {exc}") from exc
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(batch[1], list):
        raise ValueError(f"a KVEventBatch is [ts, events, data_parallel_rank], got {type(batch).__name__}")
    events = batch[1]
    for ev in events:
        if not isinstance(ev, dict) or "type" not in ev:
            raise ValueError(f"a KV event is a map tagged 'type', got {ev!r:.80}")
    return float(batch[0]), events, batch[2] if len(batch) == 3 else None


def encode_batch(ts: float, events: Sequence[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)


def decode_seq(seq: bytes) -> int:
    if len(seq) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(seq)}")
    return int.from_bytes(seq, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def block_stored(block_hashes: Sequence[EngineHash], parent: EngineHash | None, token_ids: Sequence[int],
                 block_size: int, medium: str = DEVICE, extra_keys: list | None = None,
                 lora_name: str | None = None) -> dict[str, Any]:  # fmt: skip
    ev = {"type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent,
          "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": medium,
          "lora_name": lora_name}  # fmt: skip
    if extra_keys is not None:
        ev["extra_keys"] = extra_keys
    return ev


def block_removed(block_hashes: Sequence[EngineHash], medium: str = DEVICE) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


# ---------------------------------------------------------------------- translation
class _Unkeyable(Exception):
    """A stored block kvroute cannot key exactly (see the module docstring)."""


@dataclass
class Counters:
    events: int = 0
    orphans: int = 0  # blocks whose parent is unknown
    unsupported: int = 0  # blocks or events left out for their shape (module docstring)
    unknown_removals: int = 0


class WorkerCache:
    """What one worker holds, in kvroute hashes, per tier, rebuilt from its events.

    ``apply`` walks a decoded batch once, each event's blocks in one tight loop with
    the dicts it touches bound to locals: an event's token ids are packed into
    little-endian uint32 bytes once (not per block), each new block is one
    ``hash_packed`` of its parent's hash and its slice of them, root hashes are
    memoized per (salt, adapter), and the net changes are two ordered sets per tier
    (stored, removed; disjoint), so a block costs a few dict operations and one hash
    call. ``take`` hands them out as the stream's next ``KVEvents``."""

    def __init__(self, hash_spec: HashSpec) -> None:
        self.spec = hash_spec
        self.names: dict[EngineHash, BlockHash] = {}
        self.refs: dict[str, dict[EngineHash, int]] = {DEVICE: {}, HOST: {}}
        self.counters = Counters()
        # per tier (stored, removed) since the last take: a store and a removal of one
        # hash in between cancel out (KVEvents' contract), insertion order kept
        self._net: dict[str, tuple[dict[BlockHash, None], dict[BlockHash, None]]] = {DEVICE: ({}, {}), HOST: ({}, {})}
        self._cleared = False
        self._roots: dict[tuple[str | None, str | None], BlockHash] = {}

    def hashes(self, tier: str) -> list[BlockHash]:
        return [self.names[k] for k in self.refs[tier]]

    def clear(self) -> None:
        self.names.clear()
        for tier in (DEVICE, HOST):
            self.refs[tier].clear()
            for changes in self._net[tier]:
                changes.clear()
        self._cleared = True

    def apply(self, events: Sequence[dict[str, Any]]) -> None:
        counters = self.counters
        for ev in events:
            counters.events += 1
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.clear()
                continue
            medium = ev.get("medium")
            tier = DEVICE if medium is None or medium == DEVICE else HOST if medium == HOST else None
            if tier is None or ev.get("group_idx") not in (None, 0):
                counters.unsupported += 1
            elif kind == "BlockStored":
                self._store(ev, tier)
            elif kind == "BlockRemoved":
                self._remove(ev["block_hashes"], tier)
            else:
                counters.unsupported += 1

    def take(self) -> tuple[list[BlockHash], list[BlockHash], list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, host_stored, host_removed, cleared) since the last call."""
        (stored, removed), (host_stored, host_removed) = self._net[DEVICE], self._net[HOST]
        out = (list(stored), list(removed), list(host_stored), list(host_removed), self._cleared)
        for changes in (stored, removed, host_stored, host_removed):
            changes.clear()
        self._cleared = False
        return out

    def _store(self, ev: dict[str, Any], tier: str) -> None:
        """One ``BlockStored``: each block named (known, or hashed on its parent's name)
        and referenced in ``tier``; the first block that cannot be keyed ends it."""
        keys, parent = ev["block_hashes"], ev["parent_block_hash"]
        extra = ev.get("extra_keys") or [None] * len(keys)
        names, refs = self.names, self.refs[tier]
        stored, removed = self._net[tier]
        raw: bytes | None = None  # the event's token ids as little-endian uint32, packed on first need
        step, seed = 4 * self.spec.block_size, self.spec.seed
        parent_name: BlockHash | None = None  # the name of ``parent`` once looked up
        for i, key in enumerate(keys):
            name = names.get(key)
            if name is None:
                try:
                    if raw is None:
                        raw = self._tokens(ev, len(keys))
                    x = extra[i] if i < len(extra) else None
                    salt = _salt(x, ev.get("lora_name"), first=parent is None) if x else None
                except _Unkeyable:
                    self.counters.unsupported += len(keys) - i
                    return
                if parent is None:
                    parent_name = self._root(salt, ev.get("lora_name"))
                elif parent_name is None:
                    parent_name = names.get(parent)
                    if parent_name is None:
                        self.counters.orphans += len(keys) - i
                        return
                name = names[key] = hash_packed(seed, parent_name, raw[i * step : (i + 1) * step])
                refs[key] = 1  # a key no tier holds has no name (_remove forgets it)
                if removed and name in removed:
                    del removed[name]
                else:
                    stored[name] = None
            else:
                n = refs.get(key, 0)
                refs[key] = n + 1
                if n == 0:
                    if removed and name in removed:
                        del removed[name]
                    else:
                        stored[name] = None
            parent, parent_name = key, name

    def _remove(self, keys: Sequence[EngineHash], tier: str) -> None:
        """One ``BlockRemoved``: each key unreferenced in ``tier``, its name forgotten
        once no tier holds it."""
        names, refs = self.names, self.refs[tier]
        other = self.refs[HOST if tier == DEVICE else DEVICE]
        stored, removed = self._net[tier]
        for key in keys:
            n = refs.get(key, 0)
            if n == 1:
                del refs[key]
                name = names[key]
                if stored and name in stored:
                    del stored[name]
                else:
                    removed[name] = None
                if not other or key not in other:
                    del names[key]
            elif n:
                refs[key] = n - 1
            else:
                self.counters.unknown_removals += 1

    def _tokens(self, ev: dict[str, Any], num_blocks: int) -> bytes:
        """The event's token ids as little-endian uint32 bytes (what ``hash_block``
        hashes); ``_Unkeyable`` for another block size, a token count that is not whole
        blocks, or a token id that is not a uint32."""
        bs = self.spec.block_size
        tokens = ev["token_ids"]
        if ev["block_size"] != bs or len(tokens) != bs * num_blocks:
            raise _Unkeyable
        try:
            packed = array(_UINT32, tokens)
        except (TypeError, ValueError, OverflowError):
            raise _Unkeyable from None
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tobytes()

    def _root(self, salt: str | None, lora_name: str | None) -> BlockHash:
        """``root_hash`` memoized (a few salts and adapters recur on every chain)."""
        key = (salt, lora_name)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:
                self._roots.clear()
            root = self._roots[key] = root_hash(self.spec, salt, lora_name)
        return root


_MAX_ROOTS = 4096
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def _salt(extra: Any, lora_name: str | None, first: bool) -> str | None:
    """The cache salt among one block's untagged extra keys; only the LoRA name and (on
    a chain's first block) one salt string are keyable."""
    items = list(extra or ())
    if lora_name is not None and items and items[0] == lora_name:
        items.pop(0)
    if not items:
        return None
    if first and len(items) == 1 and isinstance(items[0], str):
        return items[0]
    raise _Unkeyable


# ---------------------------------------------------------------------- one stream
@dataclass(frozen=True)
class Gap:
    """Batches ``[first, next_seq)`` were not received."""

    first: int
    next_seq: int


class WorkerStream:
    """One worker's stream in order: vLLM ``seq`` checks, then translation into kvroute
    ``KVEvents`` numbered by this stream's own ``seq`` (one per applied batch).

    ``feed`` answers a ``Gap`` instead of applying a batch that skips ahead: the caller
    replays the missing batches (``feed(..., replayed=True)``) and feeds the batch again,
    or calls ``reset`` to drop the worker's blocks and go on from there. A batch numbered
    below the next one expected is the worker starting over (emptied, then applied),
    unless a replay just delivered it (a duplicate, ignored)."""

    def __init__(self, worker_id: str, hash_spec: HashSpec) -> None:
        self.worker_id = worker_id
        self.cache = WorkerCache(hash_spec)
        self.seq = 0  # kvroute seq of the last KVEvents handed out
        self.next_seq: int | None = None  # vLLM seq expected next (None: nothing seen yet)
        self.batches = self.restarts = 0
        self._replayed_upto = -1

    def feed(self, seq: int, payload: bytes, replayed: bool = False) -> KVEvents | Gap | None:
        """Apply one batch; None for a duplicate. Raises ValueError for a bad payload
        (nothing applied)."""
        expected = self.next_seq
        if expected is not None and seq > expected:
            return Gap(expected, seq)
        if expected is not None and seq < expected and (replayed or seq <= self._replayed_upto):
            return None
        _, events, _ = decode_batch(payload)
        if expected is not None and seq < expected:
            self.restarts += 1
            self.cache.clear()
        if replayed:
            self._replayed_upto = seq
        else:
            self._replayed_upto = -1
        self.next_seq = seq + 1
        self.batches += 1
        self.cache.apply(events)
        return self._events()

    def reset(self, next_seq: int) -> KVEvents:
        """Forget the worker's blocks (history lost) and expect ``next_seq`` next."""
        self.cache.clear()
        self.next_seq = next_seq
        self._replayed_upto = -1
        return self._events()

    def _events(self) -> KVEvents:
        stored, removed, host_stored, host_removed, cleared = self.cache.take()
        self.seq += 1
        return KVEvents(self.worker_id, self.seq, stored, removed, cleared, None, host_stored, host_removed)
