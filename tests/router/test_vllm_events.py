"""vLLM's KV event wire format into kvroute's directory keys (router/vllm_events.py).

Payloads are real msgpack built as vLLM 0.32's msgspec encoder lays them out
(``[ts, [ {"type": ..., fields} ], dp_rank]``), fed to the real translation."""

import msgpack
import pytest

from kvroute.replica.block_hash import HashSpec, hash_block, hash_blocks, root_hash
from kvroute.router import vllm_events as wire
from kvroute.router.vllm_events import Gap, WorkerStream

SPEC = HashSpec(block_size=4, seed=7, model_id="m")
TOKENS = list(range(100, 116))  # 4 blocks


def stored(keys, parent, tokens, **kw):
    return wire.block_stored(keys, parent, tokens, SPEC.block_size, **kw)


def payload(*events):
    return wire.encode_batch(1.0, list(events))


def test_payload_layout_is_vllms():
    raw = payload(stored([11], None, TOKENS[:4]), wire.block_removed([11]), wire.all_blocks_cleared())
    ts, events, rank = msgpack.unpackb(raw)
    assert (ts, rank) == (1.0, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
                         "token_ids": TOKENS[:4], "block_size": 4, "lora_id": None, "medium": "GPU",
                         "lora_name": None}  # fmt: skip
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    assert wire.decode_seq(wire.encode_seq(513)) == 513
    assert wire.decode_seq(wire.encode_seq(wire.END_SEQ)) == -1


def test_stored_chain_is_keyed_by_kvroute_hashes_and_removed_through_the_map():
    s = WorkerStream("w", SPEC)
    ev = s.feed(0, payload(stored([11, 12], None, TOKENS[:8]), stored([13, 14], 12, TOKENS[8:16])))
    expect = hash_blocks(SPEC, TOKENS)
    assert ev.replica_id == "w" and ev.seq == 1 and ev.stored == expect and not ev.removed
    ev = s.feed(1, payload(wire.block_removed([14, 13])))
    assert ev.seq == 2 and ev.removed == expect[3:1:-1] and not ev.stored
    assert set(s.cache.names) == {11, 12}  # forgotten on removal
    assert s.cache.hashes(wire.DEVICE) == expect[:2]


def test_repeated_store_is_reference_counted():
    s = WorkerStream("w", SPEC)
    s.feed(0, payload(stored([11], None, TOKENS[:4])))
    ev = s.feed(1, payload(stored([11], None, TOKENS[:4])))  # a second physical block
    assert ev.stored == []
    assert s.feed(2, payload(wire.block_removed([11]))).removed == []
    assert s.feed(3, payload(wire.block_removed([11]))).removed == hash_blocks(SPEC, TOKENS[:4])
    assert s.feed(4, payload(wire.block_removed([11]))).removed == []
    assert s.cache.counters.unknown_removals == 1


def test_unknown_parent_leaves_out_the_chain():
    s = WorkerStream("w", SPEC)
    ev = s.feed(0, payload(stored([13, 14], 12, TOKENS[8:16])))
    assert ev.stored == [] and s.cache.counters.orphans == 2 and not s.cache.names


def test_salt_and_lora_go_into_the_root():
    s = WorkerStream("w", SPEC)
    a = s.feed(0, payload(stored([1, 2], None, TOKENS[:8], extra_keys=[["tenant-a"], None]))).stored
    assert a == hash_blocks(SPEC, TOKENS[:8], cache_salt="tenant-a")
    b = s.feed(1, payload(stored([3], None, TOKENS[:4], lora_name="ad", extra_keys=[["ad", "tenant-a"]]))).stored
    assert b == [hash_block(SPEC, root_hash(SPEC, "tenant-a", "ad"), TOKENS[:4])]  # the engine's own rule for adapters
    c = s.feed(2, payload(stored([4], 3, TOKENS[4:8], lora_name="ad", extra_keys=[["ad"]]))).stored
    assert c == [hash_block(SPEC, b[0], TOKENS[4:8])]
    assert len({a[0], b[0], hash_blocks(SPEC, TOKENS[:4])[0]}) == 3


def test_unkeyable_blocks_are_left_out():
    s = WorkerStream("w", SPEC)
    mm = stored([1, 2], None, TOKENS[:8], extra_keys=[[["img", 0]], None])
    wrong_size = wire.block_stored([3], None, TOKENS[:2], 2)
    other_group = {**stored([4], None, TOKENS[:4]), "group_idx": 1}
    storage = stored([5], None, TOKENS[:4], medium="STORAGE")
    ev = s.feed(0, payload(mm, wrong_size, other_group, storage))
    assert ev.stored == [] and not s.cache.names
    assert s.cache.counters.unsupported == 2 + 1 + 1 + 1


def test_medium_cpu_feeds_the_host_tier():
    s = WorkerStream("w", SPEC)
    h = hash_blocks(SPEC, TOKENS[:8])
    s.feed(0, payload(stored([11, 12], None, TOKENS[:8])))
    ev = s.feed(1, payload(stored([11, 12], None, [], medium="CPU"), wire.block_removed([12])))
    assert ev.host_stored == h and ev.removed == [h[1]] and not ev.stored
    assert s.cache.names[12] == h[1]  # still named: the host tier holds it
    ev = s.feed(2, payload(wire.block_removed([12], medium="CPU")))
    assert ev.host_removed == [h[1]] and 12 not in s.cache.names


def test_gap_restart_and_clear():
    s = WorkerStream("w", SPEC)
    s.feed(0, payload(stored([11], None, TOKENS[:4])))
    late = payload(stored([12], 11, TOKENS[4:8]))
    assert s.feed(3, late) == Gap(1, 3)
    assert s.next_seq == 1  # nothing applied
    # the replay delivers 1..3, then the live copy of 3 is a duplicate
    assert s.feed(1, payload(), replayed=True).stored == []
    assert s.feed(2, payload(), replayed=True).stored == []
    assert s.feed(3, late, replayed=True).stored == hash_blocks(SPEC, TOKENS[:8])[1:]
    assert s.feed(3, late) is None
    assert s.feed(4, payload()).stored == []  # the live stream caught up
    # a stream that starts over empties the worker, then applies its batch
    ev = s.feed(0, payload(stored([21], None, TOKENS[4:8])))
    assert ev.cleared and ev.stored == hash_blocks(SPEC, TOKENS[4:8]) and s.restarts == 1
    assert set(s.cache.names) == {21}
    ev = s.feed(1, payload(wire.all_blocks_cleared(), stored([22], None, TOKENS[:4])))
    assert ev.cleared and ev.stored == hash_blocks(SPEC, TOKENS[:4]) and set(s.cache.names) == {22}
    # a gap without a replay: reset, then go on from the new batch
    ev = s.reset(9)
    assert ev.cleared and not ev.stored and not s.cache.names
    assert s.feed(9, payload(stored([31], 22, TOKENS[4:8]))).stored == []  # its parent went with the reset
    assert s.cache.counters.orphans == 1


def test_bad_payload_is_a_value_error_and_applies_nothing():
    s = WorkerStream("w", SPEC)
    with pytest.raises(ValueError, match="msgpack"):
        s.feed(0, b"\xc1")
    with pytest.raises(ValueError, match="KVEventBatch"):
        s.feed(0, msgpack.packb({"ts": 1}))
    with pytest.raises(ValueError, match="tagged"):
        s.feed(0, msgpack.packb([1.0, [[1, 2]], 0]))
    with pytest.raises(ValueError, match="8 bytes"):
        wire.decode_seq(b"\x00")
    assert s.next_seq is None and s.batches == 0
