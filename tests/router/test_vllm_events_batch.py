"""``WorkerCache.apply`` walks each event's blocks in one loop (tokens packed once per
event, parents carried, roots memoized): it must do exactly what applying the events
one block at a time with ``hash_block`` did. ``_Reference`` is that per-block
translation, kept here as the oracle; random streams (known and unknown parents,
repeated stores, both tiers, salts, adapters, unkeyable shapes, clears) go through
both, compared after every batch: the changes taken, the names, the reference counts
in order, the counters."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvroute.replica.block_hash import HashSpec, hash_block, hash_blocks, root_hash
from kvroute.replica.kv_events import PendingEvents
from kvroute.router import vllm_events as wire
from kvroute.router.vllm_events import Counters, WorkerCache, WorkerStream

SPEC = HashSpec(block_size=4, seed=11, model_id="m")
DEVICE, HOST = wire.DEVICE, wire.HOST


class _Unkeyable(Exception):
    pass


class _Reference:
    """The translation one event and one block at a time (each block's tokens through
    ``hash_block``, its parent looked up, every change noted in a ``PendingEvents``)."""

    def __init__(self, spec: HashSpec) -> None:
        self.spec = spec
        self.names: dict[Any, int] = {}
        self.refs: dict[str, dict[Any, int]] = {DEVICE: {}, HOST: {}}
        self.counters = Counters()
        self._changes = {DEVICE: PendingEvents(), HOST: PendingEvents()}

    def clear(self) -> None:
        self.names.clear()
        for tier in (DEVICE, HOST):
            self.refs[tier].clear()
            self._changes[tier].clear()

    def apply(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.counters.events += 1
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.clear()
            elif _tier(ev) is None or ev.get("group_idx") not in (None, 0):
                self.counters.unsupported += 1
            elif kind == "BlockStored":
                self._store(ev, _tier(ev))
            elif kind == "BlockRemoved":
                for key in ev["block_hashes"]:
                    self._unref(key, _tier(ev))
            else:
                self.counters.unsupported += 1

    def take(self):
        stored, removed, cleared = self._changes[DEVICE].take()
        host_stored, host_removed, host_cleared = self._changes[HOST].take()
        return stored, removed, host_stored, host_removed, cleared or host_cleared

    def _store(self, ev, tier) -> None:
        keys, parent = ev["block_hashes"], ev["parent_block_hash"]
        extra = ev.get("extra_keys") or [None] * len(keys)
        for i, key in enumerate(keys):
            name = self.names.get(key)
            if name is None:
                try:
                    name = self._name(ev, i, parent, extra[i] if i < len(extra) else None)
                except _Unkeyable:
                    self.counters.unsupported += len(keys) - i
                    return
                if name is None:
                    self.counters.orphans += len(keys) - i
                    return
                self.names[key] = name
            self._ref(key, tier)
            parent = key

    def _name(self, ev, i, parent, extra):
        bs = self.spec.block_size
        tokens = ev["token_ids"]
        if ev["block_size"] != bs or len(tokens) != bs * len(ev["block_hashes"]):
            raise _Unkeyable
        salt = _salt(extra, ev.get("lora_name"), first=parent is None)
        if parent is None:
            parent_name = root_hash(self.spec, salt, ev.get("lora_name"))
        else:
            parent_name = self.names.get(parent)
            if parent_name is None:
                return None
        return hash_block(self.spec, parent_name, tokens[i * bs : (i + 1) * bs])

    def _ref(self, key, tier) -> None:
        refs = self.refs[tier]
        refs[key] = refs.get(key, 0) + 1
        if refs[key] == 1:
            self._changes[tier].note(self.names[key], True)

    def _unref(self, key, tier) -> None:
        refs = self.refs[tier]
        n = refs.get(key, 0)
        if n == 0:
            self.counters.unknown_removals += 1
            return
        if n > 1:
            refs[key] = n - 1
            return
        del refs[key]
        self._changes[tier].note(self.names[key], False)
        if not any(key in r for r in self.refs.values()):
            del self.names[key]


def _tier(ev):
    medium = ev.get("medium")
    return DEVICE if medium in (None, DEVICE) else HOST if medium == HOST else None


def _salt(extra, lora_name, first):
    items = list(extra or ())
    if lora_name is not None and items and items[0] == lora_name:
        items.pop(0)
    if not items:
        return None
    if first and len(items) == 1 and isinstance(items[0], str):
        return items[0]
    raise _Unkeyable


# ---------------------------------------------------------------------- random streams
def _stored_event(rng: random.Random, known: list[int], fresh) -> dict[str, Any]:
    bs = SPEC.block_size
    n = rng.randint(1, 6)
    roll = rng.random()
    keys = [rng.choice(known) if known and rng.random() < 0.3 else fresh() for _ in range(n)]
    if roll < 0.05 and len(keys) > 1:
        keys[1] = keys[0]  # one key twice in an event
    parent = None if not known or rng.random() < 0.3 else rng.choice(known + [fresh()])  # sometimes an orphan
    tokens = [rng.randrange(50) for _ in range(n * bs)]  # few token values: equal names under different keys
    lora = rng.choice([None, None, "ad"])
    extra: list | None = None
    r = rng.random()
    if r < 0.15:
        extra = [[lora, "tenant"] if lora else ["tenant"]] + [[lora] if lora else None] * (n - 1)
    elif r < 0.2:
        extra = [[["img", 0]]] + [None] * (n - 1)  # multimodal: unkeyable
    elif r < 0.25:
        extra = [None, ["salt-on-a-later-block"]][: n] + [None] * max(0, n - 2)  # a salt off the first block
    elif r < 0.5:
        extra = [None] * n
    ev = wire.block_stored(keys, parent, tokens, bs, medium=rng.choice([DEVICE, DEVICE, DEVICE, HOST, None]),
                           extra_keys=extra, lora_name=lora)  # fmt: skip
    r = rng.random()
    if r < 0.04:
        ev["block_size"] = bs * 2
    elif r < 0.08:
        ev["token_ids"] = tokens[:-1]
    elif r < 0.11:
        ev["group_idx"] = 1
    elif r < 0.14:
        ev["medium"] = "STORAGE"
    elif r < 0.5:
        ev["group_idx"] = 0
    known.extend(k for k in keys if rng.random() < 0.9)
    return ev


def _stream(seed: int, batches: int = 300) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    known: list[int] = []
    counter = iter(range(1, 10**9))
    fresh = lambda: next(counter) if rng.random() < 0.5 else next(counter).to_bytes(8, "big")  # noqa: E731
    out = []
    for _ in range(batches):
        batch = []
        for _ in range(rng.randint(0, 5)):
            r = rng.random()
            if r < 0.5:
                batch.append(_stored_event(rng, known, fresh))
            elif r < 0.9:
                n = rng.randint(1, 6)
                keys = [rng.choice(known) if known and rng.random() < 0.85 else fresh() for _ in range(n)]
                batch.append(wire.block_removed(keys, medium=rng.choice([DEVICE, DEVICE, HOST, None])))
            elif r < 0.93:
                batch.append(wire.all_blocks_cleared())
                known.clear()
            elif r < 0.96:
                batch.append({"type": "SomethingNew", "medium": DEVICE})
            else:
                batch.append({**wire.block_removed([1]), "medium": "STORAGE"})
        out.append(batch)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_batch_walk_does_what_the_per_block_translation_did(seed):
    new, ref = WorkerCache(SPEC), _Reference(SPEC)
    peak, host, cleared = 0, 0, 0
    for events in _stream(seed):
        new.apply(wire.decode_batch(wire.encode_batch(1.0, events))[1])
        ref.apply(wire.decode_batch(wire.encode_batch(1.0, events))[1])
        taken = new.take()
        assert taken == ref.take()
        peak, host, cleared = max(peak, len(new.names)), host + len(taken[2]) + len(taken[3]), cleared + taken[4]
        assert new.names == ref.names
        assert {t: list(r.items()) for t, r in new.refs.items()} == {t: list(r.items()) for t, r in ref.refs.items()}
        assert new.counters == ref.counters
        assert new.hashes(DEVICE) == [ref.names[k] for k in ref.refs[DEVICE]]
    c = new.counters
    assert c.orphans and c.unsupported and c.unknown_removals and peak > 10 and host and cleared  # every path reached


def test_a_token_id_that_is_not_a_uint32_leaves_the_chain_out_and_the_stream_goes_on():
    s = WorkerStream("w", SPEC)
    ok = list(range(100, 104))
    ev = s.feed(0, wire.encode_batch(1.0, [wire.block_stored([1, 2], None, ok + [5, 6, 7, 2**32], 4),
                                           wire.block_stored([3], None, [1, 2, 3, -1], 4),
                                           wire.block_stored([4], None, ok, 4)]))  # fmt: skip
    assert ev.stored == hash_blocks(SPEC, ok) and set(s.cache.names) == {4}
    assert s.cache.counters.unsupported == 3


def test_memoized_roots_stay_exact_past_their_bound(monkeypatch):
    monkeypatch.setattr(wire, "_MAX_ROOTS", 2)
    s = WorkerStream("w", SPEC)
    toks = list(range(4))
    for i, salt in enumerate(["a", "b", "c", "a", None, "b"]):
        extra = [[salt]] if salt else None
        ev = s.feed(i, wire.encode_batch(1.0, [wire.block_stored([100 + i], None, toks, 4, extra_keys=extra)]))
        assert ev.stored == [hash_block(SPEC, root_hash(SPEC, salt), toks)]
        assert len(s.cache._roots) <= 2
