"""Live prefixes per replica (router/live_prefixes.py) and the kvroute rule built on
them: where every cache is equally full and equally fast, a new prefix goes to the
replica serving the fewest prefixes lately, not to whichever the tie-break names; where
the caches have room, the count changes nothing."""

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.live_prefixes import LivePrefixes
from kvroute.router.policies.kvroute import KVRoutePolicy
from kvroute.router.router import Router

SPEC = HashSpec(16)


def test_a_prefix_counts_on_each_replica_it_was_sent_to_until_the_horizon_passes():
    live = LivePrefixes(horizon=3)
    live.observe("r0", 1)
    live.observe("r0", 2)
    live.observe("r1", 1)
    live.observe("r0", 1)  # 1 again: refreshed, not counted twice
    assert (live.count("r0"), live.count("r1"), live.count("r9")) == (2, 1, 0)
    live.observe("r1", None)  # too short to name a prefix: the clock moves on
    assert live.count("r0") == 1  # 2 was last sent 4 decisions ago
    live.observe("r1", 3)
    live.observe("r1", 3)
    assert live.count("r1") == 1 and live.count("r0") == 0
    live.forget("r1")
    assert live.count("r1") == 0
    with pytest.raises(ValueError):
        LivePrefixes(horizon=0)


def _prompt(group: int, n: int = 4) -> list[int]:
    return [group * 1000 + j for j in range(16 * n)]


@pytest.mark.parametrize("balance, capacity, expect", [(True, 8, "r1"), (False, 8, "r0"), (True, 64, "r0")])
def test_a_new_prefix_goes_where_the_fewest_prefixes_are_served(balance, capacity, expect):
    """r0 serves three 4-block prefixes, r1 one of 12 blocks; both caches are equally
    full and both idle. A new prefix goes to r1 with the count; without it, the
    tie-break by its first block decides (r0 for the prompt picked). Where both caches
    have room for it (64 blocks), nothing is evicted wherever it goes, and the count
    does not move it from the tie-break's choice."""
    r = Router(KVRoutePolicy(balance_prefixes=balance), 16)
    for rid in ("r0", "r1"):
        r.add_replica(rid, capacity)  # 8 blocks: two 4-block prefixes fill a cache
    for g, rid, n in [(1, "r0", 4), (2, "r0", 4), (3, "r0", 4), (4, "r1", 12)]:
        tokens = _prompt(g, n)
        r.route(hash_blocks(SPEC, tokens), len(tokens), [rid])
    idle = LoadFigures(prefill_tokens_per_s=10_000.0, decode_step_s=0.02, route_ticket=2**62)
    for rid in ("r0", "r1"):
        r.apply(KVEvents(rid, 1, load=idle))
    tokens = next(t for t in map(_prompt, range(9, 99)) if hash_blocks(SPEC, t)[0] % 2 == 0)  # the tie-break: r0
    hashes = hash_blocks(SPEC, tokens)
    d = r.route(hashes, len(tokens))
    assert d.reason == "cold" and d.replica_id == expect
