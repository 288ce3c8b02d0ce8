"""LoRA-aware routing on a real ``Router``: load reports name the resident adapters and
their slot-load time, and the kvroute policy prices a cold adapter into the predicted
TTFT (router/policies/kvroute.py), so one adapter's requests gather where it is resident
and spread when that replica is busy."""

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.policies.kvroute import KVRoutePolicy
from kvroute.router.router import Router

SPEC = HashSpec(16)
RATE = dict(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)


def _prompt(seed: int, lora: str | None, blocks: int = 16):
    tokens = [seed * 1000 + i for i in range(blocks * 16 + 3)]
    return hash_blocks(SPEC, tokens, lora_name=lora), len(tokens)


def _router(**loads: LoadFigures) -> Router:
    r = Router(KVRoutePolicy(), 16)
    for rid, fig in loads.items():
        r.add_replica(rid, 10_000)
        r.apply(KVEvents(rid, 1, load=fig))
    return r


def test_a_new_prompt_of_an_adapter_goes_where_it_is_resident():
    r = _router(r0=LoadFigures(**RATE, adapter_load_s=0.5), r1=LoadFigures(**RATE, resident_loras=("x",), adapter_load_s=0.5),
                r2=LoadFigures(**RATE, adapter_load_s=0.5))  # fmt: skip
    h, n = _prompt(1, "x")
    assert r.route(h, n, lora_name="x").replica_id == "r1"


def test_cheap_loads_still_prefer_the_resident_replica_among_near_equals():
    """A load far inside the slack still decides a new prompt's place (a load evicts
    another adapter); the base model's new prompt goes to the roomier cache instead."""
    fig = LoadFigures(**RATE, adapter_load_s=0.001)
    r = _router(r0=fig, r1=LoadFigures(**RATE, resident_loras=("x",), adapter_load_s=0.001))
    r.apply(KVEvents("r1", 2, stored=list(_prompt(9, None, 40)[0]), load=LoadFigures(**RATE, resident_loras=("x",))))
    h, n = _prompt(1, "x")
    assert r.route(h, n, lora_name="x").replica_id == "r1"
    h, n = _prompt(2, None)
    assert r.route(h, n).replica_id == "r0"


def test_a_routed_adapter_counts_resident_until_a_report_says_otherwise():
    r = _router(r0=LoadFigures(**RATE, adapter_load_s=0.5), r1=LoadFigures(**RATE, adapter_load_s=0.5))
    h, n = _prompt(1, "y")
    first = r.route(h, n, lora_name="y")
    assert r.load(first.replica_id).resident_loras == ("y",)
    other = "r1" if first.replica_id == "r0" else "r0"
    h2, n2 = _prompt(2, "y")
    assert r.route(h2, n2, lora_name="y").replica_id == first.replica_id  # cold on the other one
    # a report counting both tickets that no longer lists y (evicted): y is cold there again
    r.apply(KVEvents(first.replica_id, 2, load=LoadFigures(**RATE, adapter_load_s=0.5, route_ticket=2**62)))
    assert r.load(first.replica_id).resident_loras == () and r.load(other).resident_loras == ()


def test_an_adapters_requests_spread_when_its_replica_is_busy():
    busy = LoadFigures(**RATE, num_waiting=6, num_running=8, queued_prefill_tokens=40_000, queued_prefill_s=4.0,
                       resident_loras=("x",), adapter_load_s=0.2)  # fmt: skip
    r = _router(r0=busy, r1=LoadFigures(**RATE, adapter_load_s=0.2))
    h, n = _prompt(3, "x")
    r.apply(KVEvents("r0", 2, stored=list(h), load=busy))  # r0 even holds the prompt
    d = r.route(h, n, lora_name="x")
    assert d.replica_id == "r1" and d.reason == "hot_prefix_replica"


def test_the_owner_of_an_adapters_prefix_wins_over_a_cold_load_elsewhere():
    fig = LoadFigures(**RATE, adapter_load_s=0.3)
    r = _router(r0=fig, r1=LoadFigures(**RATE, adapter_load_s=0.3, resident_loras=("x",)))
    h, n = _prompt(4, "x")
    r.apply(KVEvents("r0", 2, stored=list(h), load=LoadFigures(**RATE, adapter_load_s=0.3, resident_loras=("x",))))
    d = r.route(h, n, lora_name="x")
    assert (d.replica_id, d.reason) == ("r0", "prefix")
    base, _ = _prompt(4, None)
    assert set(base).isdisjoint(h)  # the base model's blocks are not the adapter's


@pytest.mark.parametrize("load_s,expect", [((0.4, 0.0, 0.2), [0.4, 0.3, 0.0]), ((0.0, 0.0, 0.0), [0.05, 0.05, 0.0])])
def test_adapter_waits_price_unknown_loads_at_the_known_mean_or_default(load_s, expect):
    waits = KVRoutePolicy().adapter_waits([0.0, 0.0, 0.0], [True, True, False], list(load_s))
    assert waits == pytest.approx(expect)


@pytest.mark.parametrize("load_s,expect", [(0.5, "r0"), (0.01, "r1")])
def test_a_cold_load_is_weighed_against_the_resident_replicas_queue(load_s, expect):
    queued = LoadFigures(**RATE, num_waiting=1, queued_prefill_tokens=1000, queued_prefill_s=0.1, resident_loras=("x",),
                         adapter_load_s=load_s)  # fmt: skip
    r = _router(r0=queued, r1=LoadFigures(**RATE, adapter_load_s=load_s))
    h, n = _prompt(5, "x")
    assert r.route(h, n, lora_name="x").replica_id == expect


def test_a_replica_whose_slots_running_requests_hold_takes_no_other_adapter():
    """r0 owns the prompt and is idle-ish, but its running requests hold both its slots
    with other adapters: x would wait there for one to drain, so r1 takes it."""
    full = LoadFigures(**RATE, num_running=2, running_loras=("p", "q"), resident_loras=("p", "q"), max_loras=2)
    r = _router(r0=full, r1=LoadFigures(**RATE, num_running=6, max_loras=2, running_loras=("p",)))
    h, n = _prompt(6, "x")
    r.apply(KVEvents("r0", 2, stored=list(h), load=full))
    assert r.route(h, n, lora_name="x").replica_id == "r1"
    assert r.load("r1").running_loras == ("p", "x")  # routed since the last report: x holds r1's second slot
    assert r.route(_prompt(7, "p")[0], n, lora_name="p").replica_id == "r0"  # p runs there: no wait
    assert r.route(*_prompt(8, "x"), lora_name="x").replica_id == "r1"
    # no slot anywhere for y: the rule steps aside and the TTFT decides (r0: fewer running)
    assert r.route(*_prompt(9, "y"), lora_name="y").replica_id == "r0"


@pytest.mark.parametrize("cap", [0, 40])
def test_an_owner_at_the_serving_layers_cap_is_passed_over_by_the_policy_not_by_serve(cap):
    """x is resident on r0 only, and r0 holds 40 requests. With no cap the slot rule
    keeps x on r0 (every other slot holds an adapter still in use). When r0's load
    report says its serving layer takes at most 40 at once, Serve would hand the request
    to the shortest queue, whatever it holds: the policy picks the replica itself, the
    one where x evicts the least demand (r2's w, requested once; r1's least is q, twice)."""
    busy = dict(**RATE, num_running=40, resident_loras=("x",), running_loras=("x",), max_loras=2, max_requests=cap)
    r = _router(r0=LoadFigures(**busy),
                r1=LoadFigures(**RATE, num_running=1, resident_loras=("p", "q"), max_loras=2, max_requests=cap),
                r2=LoadFigures(**RATE, num_running=3, resident_loras=("v", "w"), max_loras=2, max_requests=cap))  # fmt: skip
    for name in ["p", "p", "p", "q", "q", "w", "v", "v", "x", "x"]:
        r.policy.demand.observe(name)
    h, n = _prompt(9, "x")
    r.apply(KVEvents("r0", 2, stored=list(h), load=LoadFigures(**busy)))
    assert r.route(h, n, lora_name="x").replica_id == ("r2" if cap else "r0")


@pytest.mark.parametrize("cap,expect", [(0, "r0"), (41, "r0"), (40, "r1")])
def test_a_base_model_owner_at_the_cap_is_passed_over_too(cap, expect):
    """r0 owns the prompt with 40 requests, r1 has 30: within the batch slack r0 keeps
    its prefix's request, unless its serving layer's cap is 40."""
    r = _router(r0=LoadFigures(**RATE, num_running=40, max_requests=cap), r1=LoadFigures(**RATE, num_running=30, max_requests=cap))
    h, n = _prompt(3, None)
    r.apply(KVEvents("r0", 2, stored=list(h), load=LoadFigures(**RATE, num_running=40, max_requests=cap)))
    assert r.route(h, n).replica_id == expect
