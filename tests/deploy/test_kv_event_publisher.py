"""The engine's cache changes as vLLM KV events (deploy/kv_event_publisher.py): each
stored block carries its parent, its token ids and, on a chain's first block, the
request's salt, also for blocks restored from the host tier; the translation
(router/vllm_events.py) names them with the engine's own hashes."""

from kvroute.deploy.kv_event_publisher import vllm_events
from kvroute.replica.block_hash import HashSpec
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.kv_events import KVEvents
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router import vllm_events as wire
from kvroute.router.vllm_events import WorkerStream

BS = 4
SPEC = HashSpec(BS, 5, "test")


def _admit(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> Request:
    req = Request(RequestId(rid), tokens, SamplingParams(max_tokens=4), SPEC, cache_salt=salt)
    hits, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits) is not None
    return req


def _step(kv: KVCacheManager, stream: WorkerStream, seq: int) -> KVEvents:
    stored, removed, cleared = kv.take_events()
    events = vllm_events(kv, KVEvents("r", seq, stored, removed, cleared))
    return stream.feed(seq, wire.encode_batch(0.0, events))


def test_engine_events_translate_back_to_the_engine_hashes():
    kv = KVCacheManager(4, BS, host_blocks=8)
    stream = WorkerStream("r", SPEC)
    a = _admit(kv, "a", list(range(13)), salt="t1")  # 3 full blocks, salted
    events = vllm_events(kv, KVEvents("r", 1, list(a.block_hashes), [], False))
    assert [e["parent_block_hash"] for e in events] == [None, *[h.to_bytes(16, "big") for h in a.block_hashes[:2]]]
    assert events[0]["extra_keys"] == [["t1"]] and "extra_keys" not in events[1]
    assert events[1]["token_ids"] == list(range(4, 8))
    assert _step(kv, stream, 0).stored == a.block_hashes
    kv.free(a)
    b = _admit(kv, "b", list(range(100, 113)))  # evicts a's blocks into the host tier
    ev = _step(kv, stream, 1)
    assert ev.stored == b.block_hashes and sorted(ev.removed) == sorted(a.block_hashes)
    kv.take_copies()
    kv.free(b)
    a2 = _admit(kv, "a2", list(range(13)), salt="t1")  # restored from the host tier
    assert kv.take_copies().restores
    ev = _step(kv, stream, 2)
    assert sorted(ev.stored) == sorted(a2.block_hashes) and sorted(ev.removed) == sorted(b.block_hashes)
    assert kv.cached_block(a2.block_hashes[1]).parent_hash == a2.block_hashes[0]
    assert kv.cached_block(a2.block_hashes[0]).salt == "t1"
    assert stream.cache.counters.orphans == 0 and set(stream.cache.hashes(wire.DEVICE)) == set(kv.cached_block_hashes())
    kv.free(a2)
    assert kv.reset_prefix_cache()
    ev = _step(kv, stream, 3)
    assert ev.cleared and stream.cache.hashes(wire.DEVICE) == []


def test_adapter_blocks_carry_the_adapter_and_translate_back():
    """An adapter's blocks name it (``lora_name`` on every block, first in the extra
    keys, before the first block's salt), as vLLM's do, and translate back to the
    engine's own hashes, also when restored from the host tier; the same tokens without
    the adapter are other blocks."""
    kv = KVCacheManager(4, BS, host_blocks=8)
    stream = WorkerStream("r", SPEC)

    def admit(rid: str, lora: str | None, salt: str | None = None) -> Request:
        req = Request(RequestId(rid), list(range(13)), SamplingParams(max_tokens=4), SPEC, cache_salt=salt, lora_name=lora)
        hits, _ = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits) is not None
        return req

    a = admit("a", "sql", salt="t1")  # 3 full blocks of the pool's 4
    events = vllm_events(kv, KVEvents("r", 0, list(a.block_hashes), [], False))
    assert [e["lora_name"] for e in events] == ["sql"] * 3
    assert [e["extra_keys"] for e in events] == [[["sql", "t1"]], [["sql"]], [["sql"]]]
    assert _step(kv, stream, 0).stored == a.block_hashes
    kv.free(a)
    base = admit("base", None, salt="t1")
    assert not set(base.block_hashes) & set(a.block_hashes)
    ev = _step(kv, stream, 1)  # base's blocks evict a's into the host tier
    assert ev.stored == base.block_hashes and sorted(ev.removed) == sorted(a.block_hashes)
    kv.take_copies()
    kv.free(base)
    a2 = admit("a2", "sql", salt="t1")
    assert kv.take_copies().restores and a2.block_hashes == a.block_hashes
    assert sorted(_step(kv, stream, 2).stored) == sorted(a.block_hashes)
    assert all(kv.cached_block(h).lora_name == "sql" for h in a.block_hashes)
    assert set(stream.cache.hashes(wire.DEVICE)) == set(kv.cached_block_hashes())
