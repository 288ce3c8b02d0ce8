"""The router's hot prefixes and the moves it plans when a replica joins or leaves
(``router/hot_prefixes.py``), on real chained block hashes and a real Router."""

from __future__ import annotations

import random

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents
from kvroute.router.hot_prefixes import HotPrefixes
from kvroute.router.router import Router

SPEC = HashSpec(4, 7, "m")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _hashes(tokens: list[int]) -> list:
    return hash_blocks(SPEC, tokens)


def test_a_prefix_is_the_run_its_requests_share_and_hot_by_decayed_hits():
    system = _tokens(1, 40)  # 10 shared blocks
    hot = HotPrefixes(half_life=4)
    for i in range(3):
        hot.observe(_hashes(system + _tokens(100 + i, 20)))
    cold = _hashes(_tokens(9, 40))
    hot.observe(cold)
    top = hot.top(5)
    assert [run for _, run in top] == [_hashes(system), cold]  # the forks' common run, then the lone one
    assert 2.0 < top[0][0] < 3.0  # three hits, the oldest two decayed
    for _ in range(12):  # three half-lives of other decisions
        hot.observe(cold)
    assert hot.top(1)[0][1] == cold
    assert hot.score(_hashes(system)[0]) < 0.4


def test_the_coldest_prefixes_are_dropped_past_capacity():
    hot = HotPrefixes(capacity=4)
    keep = _hashes(_tokens(0, 8))
    for _ in range(5):
        hot.observe(keep)
    for i in range(1, 20):
        hot.observe(_hashes(_tokens(i, 8)))
    assert len(hot) <= 8
    assert hot.top(1)[0][1] == keep


def _router(*replicas: str) -> Router:
    router = Router("kvroute", SPEC.block_size)
    for rid in replicas:
        router.add_replica(rid, 1000)
    return router


def _store(router: Router, rid: str, hashes: list, seq: int = 1) -> None:
    assert router.apply(KVEvents(rid, seq, stored=list(hashes)))


def test_warmup_plan_names_the_hottest_prefixes_and_their_deepest_holder():
    router = _router("a", "b", "new")
    hot_tokens, warm_tokens = _tokens(1, 64), _tokens(2, 64)
    hot, warm = _hashes(hot_tokens), _hashes(warm_tokens)
    _store(router, "a", hot[:10] + warm)
    _store(router, "b", hot)
    for _ in range(4):
        router.route(hot, len(hot_tokens), ["a", "b"])
    for _ in range(2):
        router.route(warm, len(warm_tokens), ["a", "b"])
    router.route(_hashes(_tokens(3, 64)), 64, ["a", "b"])  # hit once: not hot
    plan = router.warmup_plan("new", k=8, max_blocks=1000)
    assert plan == [(hot, "b"), (warm, "a")]
    assert router.warmup_plan("new", k=8, max_blocks=20) == [(hot, "b"), (warm[:4], "a")]  # the block budget


def test_handoff_plan_moves_what_only_the_leaver_holds_and_spreads_it():
    router = _router("a", "b", "c")
    runs = [_hashes(_tokens(s, 32)) for s in range(4)]
    _store(router, "a", [h for run in runs for h in run])
    _store(router, "b", runs[0])  # the first is held as deeply by a survivor: nothing to move
    _store(router, "c", runs[1][:3])
    for run in runs:
        for _ in range(3):
            router.route(run, 32, ["a"])
    plan = dict((tuple(run), target) for run, target in router.handoff_plan("a", k=8))
    assert tuple(runs[0]) not in plan
    assert plan[tuple(runs[1])] == "c"  # it holds the head already
    assert {plan[tuple(runs[2])], plan[tuple(runs[3])]} == {"b", "c"}  # no holder: spread
    assert router.handoff_plan("b") == [] and router.handoff_plan("nobody") == []
