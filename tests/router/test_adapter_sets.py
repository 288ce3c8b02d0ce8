"""Adapter slot prices (router/adapter_sets.py) and the kvroute rule built on them: a
cold adapter does not take a slot from an adapter still requested while a replica
holds it or has a free slot, even a busier one; new adapters go where the least live
demand is resident."""

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.adapter_sets import AdapterDemand, cheapest, slot_price
from kvroute.router.policies.kvroute import KVRoutePolicy
from kvroute.router.router import Router

SPEC = HashSpec(16)
RATE = dict(prefill_tokens_per_s=10_000.0, decode_step_s=0.02, adapter_load_s=0.002, max_loras=2)


def test_demand_halves_every_half_life_and_dies_below_the_floor():
    d = AdapterDemand(half_life=4, live_floor=0.5)
    d.observe("a")
    for _ in range(3):
        d.observe(None)
    assert d.count("a") == pytest.approx(0.5 ** 0.75) and d.live("a")
    d.observe("b")
    d.observe(None)
    assert d.count("a") == pytest.approx(0.5 ** 1.25) and not d.live("a") and d.live("b") and d.count("never") == 0.0
    with pytest.raises(ValueError):
        AdapterDemand(half_life=0)


def _demand(**counts: int) -> AdapterDemand:
    d = AdapterDemand(half_life=1e9)
    for name, n in counts.items():
        for _ in range(n):
            d.observe(name)
    return d


def test_slot_prices_order_resident_free_redundant_and_live():
    d = _demand(x=8, a=4, b=5, c=2, e=1)
    resident = [("x",), ("a",), ("a", "b"), ("a", "c"), ("b", "e")]
    price = slot_price("x", resident, [2] * 5, d)
    assert price[0] == 0.0  # resident
    assert 0.0 < price[1] < 1.0  # a free slot; the share of demand already there
    assert 1.0 < price[2] == price[3] < 1.5  # evicts a redundant copy of a (x needs it 2x more per copy)
    assert 1.0 < price[4] < 1.5  # x (8 of 20 over 5 replicas) wants a copy: e, single but 4x colder per copy, may go
    legacy = slot_price("x", resident, [2] * 5, d, by_demand=False)
    assert legacy[4] == pytest.approx(2.0 + 1.0)  # b too much in demand, e a single copy: a live copy, e's 1 at least
    assert slot_price("x", [(), ("a",)], [2, 2], d)[0] < slot_price("x", [(), ("a",)], [2, 2], d)[1]
    dead = AdapterDemand(half_life=1)
    dead.observe("a")
    for _ in range(5):
        dead.observe(None)
    assert slot_price("x", [("a", "b")], [2], dead)[0] < 1.0  # a and b no longer requested: their slots are free


def test_an_adapter_past_a_replicas_fair_share_evicts_a_much_colder_one_for_a_copy():
    """h draws 12 of 26 requests over 3 replicas (fair share 8.7): one copy cannot keep
    up, so with ``by_demand`` it may evict the single copy of an adapter at least twice
    colder per copy than its own would be (c: 1 against 6), never a hot one (w: 5, g: 4);
    without it, only a redundant copy (e's, 2 per copy) could give up its slot."""
    d = _demand(h=12, w=5, c=1, e=4, g=4)
    resident = [("h", "e"), ("w", "c"), ("e", "g")]
    price = slot_price("h", resident, [2] * 3, d)
    assert price[0] == 0.0 and 1.0 < price[1] < price[2] < 1.5  # c's slot before e's redundant copy
    assert cheapest(price) == [True, True, True]  # the TTFT decides between the owner and a copy
    legacy = slot_price("h", resident, [2] * 3, d, by_demand=False)
    assert legacy[1] == pytest.approx(2.0 + 1.0) and 1.0 < legacy[2] < 1.5
    assert cheapest(legacy) == [True, False, True]
    cool = _demand(h=6, w=5, c=1, e=4, g=4)  # h under the fair share (6.7): c's slot is not for a copy
    assert slot_price("h", resident, [2] * 3, cool)[1] >= 2.0
    assert cheapest([2.5, 3.0, 2.5]) == [True, False, True]  # every slot evicts a live one: the cheapest


def _router(scarcity: bool) -> Router:
    r = Router(KVRoutePolicy(scarcity=scarcity), 16)
    for rid in ("r0", "r1"):
        r.add_replica(rid, 10_000)
    for i, name in enumerate(["x", "y", "z"] * 3):  # x on r0, y and z fill r1's two slots
        tokens = [1000 * i + j for j in range(64 + 3)]
        r.route(hash_blocks(SPEC, tokens, lora_name=name), len(tokens), ["r0"] if name == "x" else ["r1"], lora_name=name)
    seen = 2**62  # the reports count every routed request: nothing runs, y and z stay resident
    busy = LoadFigures(**RATE, num_waiting=6, queued_prefill_tokens=40_000, resident_loras=("x",), route_ticket=seen)
    r.apply(KVEvents("r0", 1, load=busy))
    r.apply(KVEvents("r1", 1, load=LoadFigures(**RATE, resident_loras=("y", "z"), route_ticket=seen)))
    return r


@pytest.mark.parametrize("scarcity", [True, False])
def test_a_cold_adapter_does_not_evict_one_still_requested(scarcity):
    """w has no copy; r1's slots hold y and z, both requested, r0 has a free slot but a
    4 s queue: the slot price sends w to r0; without it, the shorter queue wins and w
    evicts y or z, whose next request evicts another in turn."""
    r = _router(scarcity)
    tokens = list(range(50_000, 50_000 + 67))
    d = r.route(hash_blocks(SPEC, tokens, lora_name="w"), len(tokens), lora_name="w")
    assert d.replica_id == ("r0" if scarcity else "r1")


def test_survival_credits_a_prefix_by_the_evictions_ahead_of_it():
    """Two owners of the same 64-block prefix: r0's cache has room for the suffix and
    its queue, r1's empty room is 0, so its queue and the suffix evict from its 800
    evictable cached blocks first, and its credit falls with the share they take."""
    from kvroute.router.survival import survive
    from kvroute.router.types import CandidateTable, ReplicaLoad

    loads = [ReplicaLoad(capacity_blocks=1000, kv_usage=0.0, queued_prefill_tokens=0),
             ReplicaLoad(capacity_blocks=1000, kv_usage=0.2, queued_prefill_tokens=16 * 400)]  # fmt: skip
    rooms = {0: 900, 1: 0}  # r1: every free block holds a cached prefix
    table = CandidateTable.from_loads(["r0", "r1"], [64, 64], loads, lambda pos: [rooms[i] for i in pos])
    cached = {0: 1024, 1: 1024}
    survive(table, cached, 1024 + 16 * 400, 16)  # r1 evicts 400 + 400 of its 800 free blocks
    assert cached == {0: 1024, 1: 0}
    cached = {0: 1024, 1: 1024}
    survive(table, cached, 1024 + 16 * 100, 16)  # 400 + 100 of 800: 3/8 survive
    assert cached == {0: 1024, 1: 384}
