"""The eviction price (router/eviction.py) and the kvroute rule built on it: where the
caches are full of prefixes still in use, recomputing a prefix that a busy owner holds
costs the prefix it evicts, so the request stays on its owner; where the other cache
holds only prefixes nobody asked for again, nothing of value is evicted and the
request goes where it starts sooner."""

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.eviction import ReuseValue, eviction_seconds
from kvroute.router.policies.kvroute import KVRoutePolicy
from kvroute.router.router import Router

SPEC = HashSpec(16)
RATE = dict(prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
SEEN = 2**62  # a report that counts every routed request


def test_reuse_value_is_the_share_of_stored_tokens_found_again():
    v = ReuseValue(half_life=1e9)
    assert v.value == 0.0  # nothing seen: nothing of value cached
    v.observe(0, 1000)
    v.observe(500, 500)
    assert v.value == pytest.approx(500 / 1500)
    v.observe(1500, 0)  # each stored token found again twice over
    assert v.value == pytest.approx(2000 / 1500)
    v.observe(50_000, 100)
    assert v.value == 4.0  # capped
    with pytest.raises(ValueError):
        ReuseValue(half_life=0)
    with pytest.raises(ValueError):
        ReuseValue(cap=0)


def test_reuse_value_decays_over_its_half_life():
    v = ReuseValue(half_life=1)
    v.observe(1000, 1000)
    v.observe(0, 1000)  # the older decision counts half
    assert v.value == pytest.approx(500 / 1500)


def test_eviction_seconds_count_only_what_the_empty_room_does_not_hold():
    own, queued = [1000, 1000, 1000, 64], [0, 800, 0, 0]
    rooms = [100, 100, 0, 0]  # blocks of 16 tokens: 1600, 1600, 0 and 0 tokens of empty room
    s = eviction_seconds(own, queued, rooms, 16, 0.5, 1000.0)
    assert s == [0.0, pytest.approx(0.1), pytest.approx(0.5), pytest.approx(0.032)]


def _router(eviction: bool, reuse: bool) -> Router:
    """r0 and r1 with 200-block caches: r0 holds a 64-block prefix P, asked for four
    times (``reuse``) or once; r1 is full of 3 other 64-block prompts, each asked for
    twice (``reuse``) or once. Then r0 reports a 0.15 s queue, r1 an idle replica."""
    r = Router(KVRoutePolicy(eviction=eviction), 16)
    for rid in ("r0", "r1"):
        r.add_replica(rid, 200)
    prefix = list(range(1024))
    for i in range(4 if reuse else 1):
        tokens = prefix + [10_000 + 100 * i + j for j in range(16)]
        r.route(hash_blocks(SPEC, tokens), len(tokens), ["r0"])
    for k in range(3):
        tokens = [20_000 + 2000 * k + j for j in range(1024)]
        for _ in range(2 if reuse else 1):
            r.route(hash_blocks(SPEC, tokens), len(tokens), ["r1"])
    r.apply(KVEvents("r0", 1, load=LoadFigures(**RATE, num_waiting=1, queued_prefill_s=0.15, route_ticket=SEEN,
                                               kv_usage=0.3)))  # fmt: skip
    r.apply(KVEvents("r1", 1, load=LoadFigures(**RATE, route_ticket=SEEN, kv_usage=0.0)))
    return r


@pytest.mark.parametrize(("eviction", "reuse", "expect"), [(True, True, "r0"), (False, True, "r1"), (True, False, "r1")])
def test_a_copy_that_evicts_live_prefixes_loses_to_a_busy_owner(eviction, reuse, expect):
    """r0's 0.15 s queue is past the owner's slack against r1's cold 0.1 s prefill; on
    r1 the copy evicts 65 blocks of cached prompts (0.1 s of someone's prefill where
    the fleet finds what it caches again), so with the price the request waits on r0;
    without it, or in a fleet that never found a prompt cached again, it goes to r1."""
    r = _router(eviction, reuse)
    tokens = list(range(1024)) + [90_000 + j for j in range(16)]
    d = r.route(hash_blocks(SPEC, tokens), len(tokens))
    assert d.replica_id == expect


def _kv_short_owner(release_s: float, release_blocks: int) -> Router:
    """r0 holds a 64-block prefix but only 10 free blocks (running requests hold the
    rest) and reports when its next running request ends; r1 is idle and empty."""
    r = Router(KVRoutePolicy(), 16)
    for rid in ("r0", "r1"):
        r.add_replica(rid, 1000)
    prefix = list(range(1024))
    r.route(hash_blocks(SPEC, prefix + [5]), 1025, ["r0"])
    r.apply(KVEvents("r0", 1, load=LoadFigures(**RATE, num_running=4, kv_usage=0.99, route_ticket=SEEN,
                                               release_s=release_s, release_blocks=release_blocks)))  # fmt: skip
    r.apply(KVEvents("r1", 1, load=LoadFigures(**RATE, route_ticket=SEEN)))
    return r


@pytest.mark.parametrize(("release_s", "release_blocks", "expect"), [(0.02, 50, "r0"), (1.0, 50, "r1"), (0.02, 5, "r1")])
def test_an_owner_short_of_blocks_waits_for_the_next_release_when_it_is_soon(release_s, release_blocks, expect):
    """The request's 25-block suffix is 15 blocks more than r0 has free: a release of
    50 blocks in 0.02 s makes r0 (0.04 s of suffix + the wait) beat r1's 0.14 s
    recompute; a release 1 s away, or one too small, leaves the owner out as before."""
    r = _kv_short_owner(release_s, release_blocks)
    tokens = list(range(1024)) + [70_000 + j for j in range(400)]
    assert r.route(hash_blocks(SPEC, tokens), len(tokens)).replica_id == expect
