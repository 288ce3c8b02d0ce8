"""Baseline routing policies on hand-built cases, against a tiny fake ClusterView."""

from __future__ import annotations

import random
from typing import Sequence

import pytest

from kvroute.replica.block_hash import BlockHash, HashSpec, hash_blocks
from kvroute.router.policies import POLICIES, make_policy, policy_names
from kvroute.router.policies.approx_tree import ApproxPrefixTree
from kvroute.router.policies.cache_aware_sglang import CacheAwareSGLangPolicy
from kvroute.router.policies.cache_aware_vllm import CacheAwareVLLMPolicy
from kvroute.router.policies.consistent_hash import ConsistentHashPolicy
from kvroute.router.policies.oracle import OraclePolicy
from kvroute.router.policies.power_of_two import PowerOfTwoPolicy
from kvroute.router.policies.prefix_affinity_ray import PrefixAffinityRayPolicy
from kvroute.router.policies.round_robin import RoundRobinPolicy
from kvroute.router.policies.weighted_scorers_gie import WeightedScorersGIEPolicy
from kvroute.router.types import ReplicaId, ReplicaLoad, RouteDecision, RouteRequest

BS = 16
SPEC = HashSpec(BS)
A, B, C, D = (ReplicaId(x) for x in "abcd")


class FakeView:
    """block_size / prefix_match / load from plain dicts (the real Router is elsewhere)."""

    block_size = BS

    def __init__(self, held: dict[ReplicaId, Sequence[BlockHash]] | None = None, loads: dict | None = None):
        self.held = {r: set(hs) for r, hs in (held or {}).items()}
        self.loads: dict[ReplicaId, ReplicaLoad] = dict(loads or {})

    def prefix_match(self, block_hashes, candidates):
        out = {}
        for r in candidates:
            n = 0
            for h in block_hashes:
                if h not in self.held.get(r, ()):
                    break
                n += 1
            out[r] = n
        return out

    def load(self, replica_id):
        return self.loads.get(replica_id, ReplicaLoad())


def prompt(group: int, n_blocks: int, suffix: int = 0) -> list[int]:
    """``n_blocks`` full blocks: a group's shared prefix, the last block varied by ``suffix``."""
    toks = [group * 100_000 + i for i in range(n_blocks * BS)]
    if suffix:
        toks[-1] = 9_000_000 + suffix
    return toks


def req(tokens: list[int], candidates=(A, B, C)) -> RouteRequest:
    return RouteRequest(hash_blocks(SPEC, tokens), len(tokens), list(candidates))


def q(n: int, **kw) -> ReplicaLoad:
    return ReplicaLoad(num_waiting=n, **kw)


def route(policy, request, view) -> RouteDecision:
    """What the Router does: choose, then tell the policy."""
    d = policy.choose(request, view)
    policy.on_routed(request, d)
    return d


# --- round robin --------------------------------------------------------------------


def test_round_robin_cycles_and_reports_directory_cache():
    r = req(prompt(1, 4))
    view = FakeView(held={B: r.block_hashes[:2]})
    pol = RoundRobinPolicy()
    got = [route(pol, r, view) for _ in range(5)]
    assert [d.replica_id for d in got] == [A, B, C, A, B]
    assert {d.reason for d in got} == {"round_robin"}
    assert [d.expected_cached_tokens for d in got] == [0, 32, 0, 0, 32]


# --- power of two -------------------------------------------------------------------


def test_power_of_two_picks_shorter_of_its_two_seeded_samples():
    cands = [A, B, C, D]
    view = FakeView(loads={A: q(5), B: q(1), C: q(3), D: q(1)})
    pol, shadow = PowerOfTwoPolicy(seed=7), random.Random(7)
    for _ in range(50):
        x, y = shadow.sample(cands, 2)
        want = y if view.load(y).queue_len < view.load(x).queue_len else x  # tie: first sample
        d = route(pol, req(prompt(1, 1), cands), view)
        assert (d.replica_id, d.reason) == (want, "power_of_two")


def test_power_of_two_is_deterministic_per_seed_and_handles_one_candidate():
    view = FakeView()
    p1, p2 = PowerOfTwoPolicy(seed=3), PowerOfTwoPolicy(seed=3)
    r = req(prompt(1, 1), [A, B, C, D])
    assert [p1.choose(r, view).replica_id for _ in range(20)] == [p2.choose(r, view).replica_id for _ in range(20)]
    assert PowerOfTwoPolicy().choose(req(prompt(1, 1), [C]), view).replica_id == C


# --- the approximate tree -------------------------------------------------------------


def test_approx_tree_evicts_leaves_first_at_the_size_limit():
    tree = ApproxPrefixTree(max_blocks_per_replica=4)
    h = hash_blocks(SPEC, prompt(1, 3))
    g = hash_blocks(SPEC, prompt(2, 3))
    tree.insert(A, h)
    assert tree.size(A) == 3 and tree.match(h, [A, B]) == {A: 3, B: 0}
    tree.insert(A, g)  # 6 > 4: h's two deepest blocks go, its root stays
    assert tree.size(A) == 4
    assert [tree.contains(A, x) for x in h] == [True, False, False]
    assert tree.match(h, [A]) == {A: 1} and tree.match(g, [A]) == {A: 3}
    tree.insert(A, h[:1])  # touching h's root makes g's deepest block the LRU one
    tree.insert(A, hash_blocks(SPEC, prompt(3, 1)))
    assert tree.match(g, [A]) == {A: 2} and tree.match(h, [A]) == {A: 1}
    tree.remove_replica(A)
    assert tree.size(A) == 0 and tree.match(g, [A]) == {A: 0}
    with pytest.raises(ValueError):
        ApproxPrefixTree(0)


# --- SGLang cache_aware -----------------------------------------------------------------


def test_sglang_defaults_are_the_benchmarked_clis():
    p = CacheAwareSGLangPolicy()
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)
    assert p.tree.max_blocks_per_replica == 2**26
    v = CacheAwareVLLMPolicy()
    assert (v.cache_threshold, v.balance_abs_threshold, v.balance_rel_threshold) == (0.3, 64, 1.5)
    assert v.tree.max_blocks_per_replica == 2**25


def test_sglang_high_match_goes_to_best_match_low_match_to_smallest_tree():
    pol = CacheAwareSGLangPolicy(cache_threshold=0.5)
    view = FakeView()
    first = route(pol, req(prompt(1, 4, suffix=1)), view)
    assert (first.replica_id, first.reason, first.expected_cached_tokens) == (A, "smallest_tree", 0)
    # same group, 3 of 4 blocks match A's tree: 0.75 > 0.5
    d = route(pol, req(prompt(1, 4, suffix=2)), view)
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (A, "cache_hit", 48)
    # a new group matches nothing: smallest tree among B, C (both 0) -> B (candidate order)
    d = route(pol, req(prompt(2, 4)), view)
    assert (d.replica_id, d.reason) == (B, "smallest_tree")
    # exactly 0.5 is not > 0.5: A holds 2 of group 3's 4 blocks
    pol2 = CacheAwareSGLangPolicy(cache_threshold=0.5)
    pol2.tree.insert(A, hash_blocks(SPEC, prompt(3, 2)))
    pol2.tree.insert(B, hash_blocks(SPEC, prompt(4, 5)))
    d = pol2.choose(req(prompt(3, 4)), view)
    assert (d.replica_id, d.reason) == (C, "smallest_tree")  # C's tree is empty
    pol2.cache_threshold = 0.49
    assert pol2.choose(req(prompt(3, 4)), view).reason == "cache_hit"


@pytest.mark.parametrize("policy_cls", [CacheAwareSGLangPolicy, CacheAwareVLLMPolicy, PrefixAffinityRayPolicy])
def test_text_matching_peers_see_the_prompt_not_the_tenants_salt(policy_cls):
    """Two tenants, one system prompt, different cache_salt: their KV cannot be shared,
    but a router matching text believes it can (the peers' real behaviour)."""
    pol, view = policy_cls(), FakeView()
    toks = prompt(1, 4)
    text = hash_blocks(SPEC, toks)

    def salted(salt: str) -> RouteRequest:
        return RouteRequest(hash_blocks(SPEC, toks, salt), len(toks), [A, B, C], unsalted_hashes=text)

    assert salted("t1").block_hashes != salted("t2").block_hashes
    first = route(pol, salted("t1"), view)
    second = pol.choose(salted("t2"), view)
    assert second.replica_id == first.replica_id and second.expected_cached_tokens == 4 * BS - 1  # the last token is always computed
    # keyed on the salted hashes they would see nothing in common
    assert policy_cls().choose(RouteRequest(hash_blocks(SPEC, toks, "t2"), len(toks), [A, B, C]), view).expected_cached_tokens == 0


def test_sglang_imbalance_needs_both_thresholds_and_goes_to_least_loaded():
    pol = CacheAwareSGLangPolicy(balance_abs_threshold=32, balance_rel_threshold=1.0001)
    r = req(prompt(1, 4))
    pol.tree.insert(A, r.block_hashes)
    # diff 33 > 32 and 33 > 1.0001 * 0 -> imbalanced -> least loaded, despite A's full match
    d = pol.choose(r, FakeView(loads={A: q(33), B: q(5), C: q(0)}))
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (C, "balance", 0)
    # diff exactly 32 is not > 32 -> balanced -> cache hit on A
    d = pol.choose(r, FakeView(loads={A: q(32), B: q(5), C: q(0)}))
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (A, "cache_hit", 63)
    # relative threshold: 100 vs 99.99 fails max > 1.0001*min even though diff would not
    loose = CacheAwareSGLangPolicy(balance_abs_threshold=0, balance_rel_threshold=2.0)
    loose.tree.insert(A, r.block_hashes)
    assert loose.choose(r, FakeView(loads={A: q(10), B: q(6), C: q(6)})).reason == "cache_hit"
    assert loose.choose(r, FakeView(loads={A: q(13), B: q(6), C: q(6)})).reason == "balance"


def test_sglang_ties_shorter_queue_then_candidate_order():
    pol = CacheAwareSGLangPolicy()
    r = req(prompt(1, 4))
    pol.tree.insert(A, r.block_hashes)
    pol.tree.insert(B, r.block_hashes)
    assert pol.choose(r, FakeView(loads={A: q(2), B: q(1)})).replica_id == B
    assert pol.choose(r, FakeView(loads={A: q(1), B: q(1)})).replica_id == A


def test_sglang_tree_size_limit():
    pol = CacheAwareSGLangPolicy(max_tree_size=3)
    view = FakeView()
    r = req(prompt(1, 4), [A])
    route(pol, r, view)
    # leaf-first touch keeps the root: the 4th (deepest) block is the one evicted
    assert pol.tree.size(A) == 3 and pol.tree.match(r.block_hashes, [A]) == {A: 3}
    assert [pol.tree.contains(A, h) for h in r.block_hashes] == [True, True, True, False]
    d = pol.choose(r, view)
    assert (d.reason, d.expected_cached_tokens) == ("cache_hit", 48)


def test_sglang_on_replica_removed_drops_its_tree():
    pol = CacheAwareSGLangPolicy()
    view = FakeView()
    r = req(prompt(1, 4))
    pol.tree.insert(B, r.block_hashes)
    assert pol.choose(r, view).replica_id == B
    pol.on_replica_removed(B)
    assert pol.tree.size(B) == 0
    d = pol.choose(r, view)
    assert (d.replica_id, d.reason) == (A, "smallest_tree")


# --- vllm-router cache_aware -------------------------------------------------------------


def test_vllm_high_match_follows_the_last_replica_routed_that_text():
    pol = CacheAwareVLLMPolicy()
    view = FakeView(loads={A: q(3), B: q(1), C: q(2)})
    first = route(pol, req(prompt(1, 4, suffix=1)), view)
    assert (first.replica_id, first.reason) == (B, "min_load")  # nothing matches: least loaded, not smallest tree
    # the balance rule moves one request of the group to C: C is now the text's last worker,
    # and the group follows it although B holds the text too and has the shorter queue
    moved = route(pol, req(prompt(1, 4, suffix=2)), FakeView(loads={A: q(200), B: q(100), C: q(0)}))
    assert (moved.replica_id, moved.reason) == (C, "balance")
    d = route(pol, req(prompt(1, 4, suffix=3)), view)
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (C, "cache_hit", 48)
    # a routed prompt makes its replica the last one for every block it shares
    route(pol, req(prompt(1, 4, suffix=4)), FakeView(loads={A: q(200), B: q(0), C: q(0)}))  # imbalanced -> B
    d = pol.choose(req(prompt(1, 4, suffix=5)), view)
    assert (d.replica_id, d.reason) == (B, "cache_hit")
    # the last worker removed: the best matcher with the shortest queue
    pol.on_replica_removed(B)
    assert pol.choose(req(prompt(1, 4, suffix=6)), view).replica_id == C


def test_vllm_low_match_and_imbalance_go_to_least_loaded():
    pol = CacheAwareVLLMPolicy()
    r = req(prompt(1, 10))
    pol.tree.insert(A, r.block_hashes[:3])  # 0.3 is not > 0.3
    d = pol.choose(r, FakeView(loads={A: q(0), B: q(2), C: q(1)}))
    assert (d.replica_id, d.reason) == (A, "min_load")
    d = pol.choose(r, FakeView(loads={A: q(5), B: q(2), C: q(1)}))
    assert (d.replica_id, d.reason) == (C, "min_load")
    pol.tree.insert(A, r.block_hashes)
    # diff 65 > 64 and 66 > 1.5 * 1: imbalanced, despite A's full match
    d = pol.choose(r, FakeView(loads={A: q(66), B: q(2), C: q(1)}))
    assert (d.replica_id, d.reason) == (C, "balance")
    d = pol.choose(r, FakeView(loads={A: q(65), B: q(2), C: q(1)}))
    assert (d.replica_id, d.reason) == (A, "cache_hit")


# --- Ray PrefixCacheAffinityRouter ------------------------------------------------------


def test_ray_defaults_are_rays():
    p = PrefixAffinityRayPolicy()
    assert (p.imbalanced_threshold, p.match_rate_threshold, p.tree.max_blocks_per_replica) == (10, 0.1, None)


def test_ray_imbalance_falls_back_to_seeded_power_of_two():
    pol, shadow = PrefixAffinityRayPolicy(seed=5), random.Random(5)
    r = req(prompt(1, 4), [A, B, C, D])
    pol.tree.insert(A, r.block_hashes)
    view = FakeView(loads={A: q(11), B: q(0), C: q(4), D: q(2)})  # 11 - 0 > 10
    for _ in range(20):
        x, y = shadow.sample([A, B, C, D], 2)
        want = y if view.load(y).queue_len < view.load(x).queue_len else x
        d = pol.choose(r, view)
        assert (d.replica_id, d.reason) == (want, "power_of_two")
    # 10 - 0 is not > 10: balanced, so the full match on A wins
    d = pol.choose(r, FakeView(loads={A: q(10), B: q(0), C: q(4), D: q(2)}))
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (A, "cache_hit", 63)


def test_ray_match_rate_at_threshold_uses_best_matchers_by_shortest_queue():
    pol = PrefixAffinityRayPolicy()
    r = req(prompt(1, 10))
    pol.tree.insert(A, r.block_hashes[:1])  # 1 of 10 blocks = 0.1 >= 0.1
    pol.tree.insert(B, r.block_hashes[:1])
    pol.tree.insert(C, hash_blocks(SPEC, prompt(7, 1)))
    d = pol.choose(r, FakeView(loads={A: q(3), B: q(2), C: q(0)}))
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (B, "cache_hit", 16)
    # SGLang would not call 0.1 a hit
    sg = CacheAwareSGLangPolicy()
    sg.tree = pol.tree
    assert sg.choose(r, FakeView()).reason == "smallest_tree"


def test_ray_low_match_goes_to_smallest_tree_then_shortest_queue():
    pol = PrefixAffinityRayPolicy()
    view = FakeView(loads={A: q(1), B: q(2), C: q(0)})
    pol.tree.insert(A, hash_blocks(SPEC, prompt(5, 3)))
    d = route(pol, req(prompt(1, 20)), view)  # no match at all; B and C have empty trees
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (C, "smallest_tree", 0)
    assert pol.tree.size(C) == 20
    d = pol.choose(req(prompt(2, 20)), view)
    assert (d.replica_id, d.reason) == (B, "smallest_tree")
    pol.on_replica_removed(C)
    assert pol.tree.size(C) == 0


# --- GIE weighted scorers ---------------------------------------------------------------


def test_gie_score_arithmetic():
    r = req(prompt(1, 4))
    view = FakeView(
        held={A: r.block_hashes, B: r.block_hashes[:2]},
        loads={
            A: ReplicaLoad(num_waiting=3, in_flight=1, kv_usage=0.5),
            B: ReplicaLoad(num_waiting=2, num_running=50, kv_usage=0.25),  # running is not queue
            C: ReplicaLoad(kv_usage=0.0),
        },
    )
    pol = WeightedScorersGIEPolicy()
    # prefix a=1, b=.5, c=0; queue (max 4, min 0) a=0, b=.5, c=1; kv a=.5, b=.75, c=1
    assert pol.scores(r, view) == pytest.approx({A: 1.5, B: 1.75, C: 2.0})
    d = pol.choose(r, view)
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (C, "score", 0)
    heavy = WeightedScorersGIEPolicy(prefix_weight=3.0)
    assert heavy.scores(r, view) == pytest.approx({A: 3.5, B: 2.75, C: 2.0})
    d = heavy.choose(r, view)
    assert (d.replica_id, d.expected_cached_tokens) == (A, 63)


def test_gie_equal_queues_score_one_and_ties_break_by_seed():
    r = req(prompt(1, 2), [A, B, C])
    view = FakeView(loads={A: q(2), B: q(2), C: q(2, kv_usage=0.5)})
    assert WeightedScorersGIEPolicy().scores(r, view) == pytest.approx({A: 2.0, B: 2.0, C: 1.5})

    def run(seed: int) -> list[ReplicaId]:
        pol = WeightedScorersGIEPolicy(seed=seed)
        return [pol.choose(r, view).replica_id for _ in range(10)]

    runs = {seed: run(seed) for seed in range(8)}
    assert runs == {seed: run(seed) for seed in range(8)}  # same seed, same picks
    assert {x for v in runs.values() for x in v} == {A, B}  # only the tied pair, both used


# --- consistent hash ----------------------------------------------------------------------


def test_consistent_hash_same_first_block_same_replica():
    pol = ConsistentHashPolicy()
    view = FakeView()
    cands = [A, B, C, D]
    owner = {g: pol.choose(req(prompt(g, 3), cands), view).replica_id for g in range(20)}
    assert len(set(owner.values())) > 1
    for g in range(20):
        for s in range(1, 4):  # different tails, same first block
            d = pol.choose(req(prompt(g, 3, suffix=s), cands), view)
            assert (d.replica_id, d.reason) == (owner[g], "hash")


def test_consistent_hash_adding_a_replica_moves_a_fraction_of_keys():
    four = [ReplicaId(f"r{i}") for i in range(4)]
    five = four + [ReplicaId("r4")]
    pol = ConsistentHashPolicy()
    keys = [pol.key(BlockHash(k * 0x9E3779B97F4A7C15 + 1)) for k in range(1000)]
    before = [pol.lookup(k, four) for k in keys]
    after = [pol.lookup(k, five) for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if a != b]
    assert 0 < len(moved) < 400
    assert all(a == "r4" for _, a in moved)  # keys only ever move to the newcomer
    pol.on_replica_removed(ReplicaId("r4"))
    assert [pol.lookup(k, four) for k in keys] == before


def test_consistent_hash_without_a_full_block_takes_the_shortest_queue():
    d = ConsistentHashPolicy().choose(
        RouteRequest([], 5, [A, B, C]), FakeView(loads={A: q(2), B: q(1), C: q(1)})
    )
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (B, "no_block", 0)


# --- oracle ---------------------------------------------------------------------------------


def test_oracle_uses_the_true_match_not_the_directory():
    r = req(prompt(1, 4))
    truth = {B: 4}
    calls = []

    def true_match(rid, hashes):
        calls.append(rid)
        return truth.get(rid, 0)

    view = FakeView(held={A: r.block_hashes})  # the directory is wrong on purpose
    d = OraclePolicy(true_match).choose(r, view)
    assert (d.replica_id, d.reason, d.expected_cached_tokens) == (B, "oracle", 63)
    assert set(calls) == {A, B, C}


def test_oracle_weighs_queued_prefill_against_the_cached_prefix():
    r = req(prompt(1, 4))  # 64 tokens
    pol = OraclePolicy(lambda rid, hashes: 4 if rid == B else 0)
    # B: (100 + 1) / 1000; A: (0 + 64) / 1000 -> A
    view = FakeView(loads={B: ReplicaLoad(queued_prefill_tokens=100, prefill_tokens_per_s=1000.0),
                           A: ReplicaLoad(prefill_tokens_per_s=1000.0),
                           C: ReplicaLoad(queued_prefill_tokens=10, prefill_tokens_per_s=1000.0)})
    assert pol.choose(r, view).replica_id == A
    # unmeasured rates use the default; B: (100 + 1) / 10000 vs A: 64 / 1000 -> B
    view.loads[B] = ReplicaLoad(queued_prefill_tokens=100)
    assert pol.choose(r, view).replica_id == B
    # equal TTFT: the longer true prefix wins, then the shorter queue, then candidate order
    tie = OraclePolicy(lambda rid, hashes: 0)
    assert tie.choose(r, FakeView(loads={A: q(3), B: q(1), C: q(1)})).replica_id == B


# --- registry ---------------------------------------------------------------------------------


def test_registry_builds_each_baseline_and_rejects_unknown_names():
    assert policy_names() == list(POLICIES)
    assert POLICIES["kvroute"] == "kvroute.router.policies.kvroute:KVRoutePolicy"
    for name in policy_names():
        if name == "kvroute":
            continue  # written alongside; its own tests build it
        kwargs = {"true_match": lambda rid, hashes: 0} if name == "oracle" else {}
        p = make_policy(name, seed=1, **kwargs)
        assert p.name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'.*round_robin.*oracle"):
        make_policy("nope")
