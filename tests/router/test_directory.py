"""BlockDirectory: exact state after event sequences, LRU, pending entries, match."""

import json

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.router.directory import BlockDirectory

SPEC = HashSpec(16)
H = hash_blocks(SPEC, list(range(16 * 8)))  # 8 chained blocks: H[0] .. H[7]
G = hash_blocks(SPEC, list(range(1000, 1000 + 16 * 4)))  # an unrelated chain


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(*replicas, capacity=100, ttl=5.0):
    clock = Clock()
    d = BlockDirectory(ttl, clock)
    for r in replicas:
        d.add_replica(r, capacity)
    return d, clock


def test_stored_removed_cleared_exact_state():
    d, _ = make("a", "b")
    assert d.apply("a", 1, H[:4], [], False)
    assert d.apply("b", 1, H[:2], [], False)
    assert d.confirmed("a") == H[:4]
    assert d.owners(H[0]) == ["a", "b"] and d.owners(H[3]) == ["a"]
    assert d.apply("a", 2, [H[4]], [H[2], H[3]], False)
    assert d.confirmed("a") == [H[0], H[1], H[4]]
    assert d.owners(H[2]) == [] and d.num_blocks() == 3
    # cleared applies before removed and stored
    assert d.apply("a", 3, [H[5]], [], True)
    assert d.confirmed("a") == [H[5]]
    assert d.owners(H[0]) == ["b"] and d.owners(H[4]) == []
    assert d.num_blocks() == 3 and d.num_entries() == 3


def test_gap_marks_stale_until_snapshot():
    d, _ = make("a")
    assert d.apply("a", 1, H[:3], [], False)
    assert not d.apply("a", 3, [H[3]], [], False)  # seq 2 lost
    assert d.stale_replicas() == ["a"]
    # stale entries are kept and still matched; later events are not applied
    assert d.match(H, ["a"]) == {"a": 3}
    assert not d.apply("a", 4, [H[4]], [], False)
    assert d.confirmed("a") == H[:3]
    d.apply_snapshot("a", [H[0], H[3], G[0]], seq=4)
    assert d.stale_replicas() == []
    assert d.confirmed("a") == [H[0], H[3], G[0]]
    assert d.owners(H[1]) == [] and d.owners(G[0]) == ["a"]
    # an in-flight batch already folded into the snapshot is dropped, the next applies
    assert d.apply("a", 4, [H[4]], [], False)
    assert d.confirmed("a") == [H[0], H[3], G[0]]
    assert d.apply("a", 5, [H[1]], [], False)
    assert d.confirmed("a") == [H[0], H[3], G[0], H[1]]
    # outside that window an old seq (e.g. a restarted replica) is a gap again
    assert not d.apply("a", 1, [], [], False)
    assert d.is_stale("a")


def test_capacity_lru_evicts_least_recently_stored_or_touched():
    d, _ = make("a", capacity=3)
    d.apply("a", 1, H[:3], [], False)
    d.apply("a", 2, [H[0]], [], False)  # re-stored: touched, now newest
    d.apply("a", 3, [H[3]], [], False)
    assert d.confirmed("a") == [H[2], H[0], H[3]]  # H[1] evicted first
    assert d.add_pending("a", [H[2]]) == 0  # confirmed there already: no pending entry
    d.apply("a", 4, [H[4], H[5]], [], False)
    assert d.confirmed("a") == [H[3], H[4], H[5]]
    assert d.owners(H[0]) == [] and d.owners(H[2]) == [] and d.pending("a") == []


def test_pending_confirmed_by_stored_and_expired_after_ttl():
    d, clock = make("a", "b", ttl=5.0)
    assert d.add_pending("a", H[:3]) == 3
    assert d.pending("a") == H[:3] and d.confirmed("a") == []
    assert d.match(H, ["a", "b"]) == {"a": 3, "b": 0}
    clock.t += 2.0
    d.apply("a", 1, [H[0]], [], False)  # confirms H[0]
    assert d.pending("a") == H[1:3] and d.confirmed("a") == [H[0]]
    d.add_pending("a", [H[2]])  # refreshed: deadline now t0 + 7
    clock.t += 3.0  # t0 + 5: H[1] expires
    assert d.match(H, ["a"]) == {"a": 1}
    assert d.pending("a") == [H[2]] and d.owners(H[1]) == []
    assert d.owners(H[2]) == ["a"]
    clock.t += 2.0
    assert d.purge_expired() == 1
    assert d.pending("a") == [] and d.owners(H[2]) == [] and d.confirmed("a") == [H[0]]
    assert d.num_blocks() == 1


def test_pending_on_confirmed_block_is_not_duplicated():
    d, clock = make("a")
    d.apply("a", 1, H[:2], [], False)
    assert d.add_pending("a", H[:3]) == 1
    assert d.pending("a") == [H[2]]
    d.apply("a", 2, [], [H[0]], False)  # evicted by the replica: gone although just routed
    assert d.match(H, ["a"]) == {"a": 0}
    clock.t += 10
    assert d.match(H[1:], ["a"]) == {"a": 1}
    assert d.owners(H[1]) == ["a"] and d.owners(H[2]) == []


def test_removed_confirmed_block_keeps_pending_owner():
    d, clock = make("a")
    d.add_pending("a", [H[0]])
    d.apply("a", 1, [H[1]], [], False)
    d.add_pending("a", [H[1]])
    d.apply("a", 2, [], [H[1]], True)
    assert d.owners(H[0]) == ["a"]  # pending survives the clear
    assert d.confirmed("a") == []


def test_match_longest_leading_run_per_candidate():
    d, _ = make("a", "b", "c", "d")
    d.apply("a", 1, H[:5], [], False)
    d.apply("b", 1, H[:2], [], False)
    d.apply("c", 1, H[1:8], [], False)  # holds later blocks but not the first
    d.apply("d", 1, H[:8], [], False)
    assert d.match(H, ["a", "b", "c", "d"]) == {"a": 5, "b": 2, "c": 0, "d": 8}
    assert d.match(H, ["c"]) == {"c": 0}
    assert d.match(H[:3], ["d", "a"]) == {"d": 3, "a": 3}
    assert d.match([], ["a"]) == {"a": 0}
    assert d.match(G, ["a", "d"]) == {"a": 0, "d": 0}
    with pytest.raises(ValueError, match="unknown replica"):
        d.match(H, ["zz"])


def test_remove_replica_and_reused_bit_has_no_old_entries():
    d, _ = make("a", "b", "c")
    d.apply("b", 1, H[:4], [], False)
    d.add_pending("b", G)
    d.apply("a", 1, H[:2], [], False)
    bit_b = d.bit_of("b")
    d.remove_replica("b")
    assert d.replicas() == ["a", "c"]
    assert d.owners(H[3]) == [] and d.owners(G[0]) == [] and d.owners(H[0]) == ["a"]
    assert d.num_blocks() == 2
    d.add_replica("b2", 10)
    assert d.bit_of("b2") == bit_b
    assert d.match(H, ["a", "b2", "c"]) == {"a": 2, "b2": 0, "c": 0}
    assert d.match(G, ["b2"]) == {"b2": 0}
    assert d.confirmed("b2") == [] and d.pending("b2") == []
    with pytest.raises(ValueError, match="already"):
        d.add_replica("a", 10)


def test_snapshot_restore_round_trip():
    d, clock = make("a", "b", capacity=50)
    d.apply("a", 1, H[:5], [], False)
    d.apply("b", 1, H[:2], [], False)
    d.apply("b", 3, [], [], False)  # stale
    d.add_pending("b", H[2:4])
    state = json.loads(json.dumps(d.snapshot()))
    r = BlockDirectory.restore(state, clock)
    assert r.replicas() == ["a", "b"]
    assert r.confirmed("a") == H[:5] and r.confirmed("b") == H[:2]
    assert r.pending("b") == H[2:4] and r.stale_replicas() == ["b"]
    assert r.last_seq("a") == 1
    assert r.match(H, ["a", "b"]) == {"a": 5, "b": 4}
    assert r.snapshot() == d.snapshot()
    clock.t += 5.0
    assert r.match(H, ["b"]) == {"b": 2}
    assert r.apply("a", 2, [H[5]], [], False) and r.confirmed("a") == H[:6]


def test_match_agrees_with_brute_force_on_random_states():
    import random

    rng = random.Random(7)
    chain = hash_blocks(SPEC, list(range(16 * 24)))
    for trial in range(200):
        d, _ = make(*[f"r{i}" for i in range(6)])
        held = {}
        for i in range(6):
            s = {h for h in chain if rng.random() < 0.85}
            held[f"r{i}"] = s
            if rng.random() < 0.5:
                d.apply(f"r{i}", 1, [h for h in chain if h in s], [], False)
            else:
                d.add_pending(f"r{i}", [h for h in chain if h in s])
        cands = rng.sample(sorted(held), rng.randint(1, 6))
        req = chain[: rng.randint(0, len(chain))]
        want = {}
        for c in cands:
            k = 0
            while k < len(req) and req[k] in held[c]:
                k += 1
            want[c] = k
        assert d.match(req, cands) == want
        assert d.match(req, tuple(cands)) == want
        names = sorted(held)
        assert d.cache_rooms(names, range(6)) == [100 - len(d.confirmed(r)) - len(d.pending(r)) for r in names]


def test_match_runs_of_owner_sets_that_grow_back():
    """Owner sets along the request that lose a replica and then regain it: the
    replica's depth stops at the first block it lacks, however the set changes later."""
    d, _ = make("a", "b", "c")
    d.apply("a", 1, H[:8], [], False)
    d.apply("b", 1, H[:2] + H[3:8], [], False)  # lacks H[2], holds the rest
    d.add_pending("c", H[:3])
    assert d.match(H, ["a", "b", "c"]) == {"a": 8, "b": 2, "c": 3}
    assert d.match_depths(H, ("c", "b", "a")) == [3, 2, 8]
    assert d.match_depths(H, ["a", "a"]) == [8, 8]  # a candidate listed twice
    assert d.match_depths(G, ["a", "b"]) == [0, 0]


def test_add_pending_counts_and_state_with_blocks_held_elsewhere():
    d, clock = make("a", "b")
    d.apply("b", 1, H[:4], [], False)  # b holds H[0..3]
    # all new for a, some held by b: every block pending on a, b keeps its entries
    assert d.add_pending("a", H[:6]) == 6
    assert d.pending("a") == H[:6] and d.owners(H[1]) == ["a", "b"] and d.owners(H[5]) == ["a"]
    # mixed: H[0..1] confirmed on a, H[2..5] pending (refreshed), H[6..7] new
    d.apply("a", 1, H[:2], [], False)
    clock.t += 3.0
    assert d.add_pending("a", H) == 2
    assert d.confirmed("a") == H[:2] and d.pending("a") == H[2:8]
    clock.t += 3.0  # the first add's deadline passed; the refresh keeps H[2..5]
    assert d.match(H, ["a", "b"]) == {"a": 8, "b": 4}
    clock.t += 2.0  # past the refresh: only the confirmed entries remain on a
    assert d.match(H, ["a", "b"]) == {"a": 2, "b": 4}
    assert d.owners(H[3]) == ["b"] and d.owners(H[6]) == [] and d.pending("a") == []
    # a repeated hash in one request is recorded once
    assert d.add_pending("a", [G[0], G[0], G[1]]) == 2
    assert d.pending("a") == [G[0], G[1]] and d.owners(G[0]) == ["a"]


def test_confirming_pending_and_removing_keep_owner_bits_exact():
    d, _ = make("a", "b")
    d.add_pending("a", H[:3])
    d.apply("b", 1, H[:3], [], False)
    d.apply("a", 1, [H[0], H[1]], [], False)  # confirms two pending entries
    assert d.confirmed("a") == H[:2] and d.pending("a") == [H[2]]
    assert d.owners(H[0]) == ["a", "b"] and d.num_pending() == 1
    d.apply("a", 2, [H[1]], [H[0]], False)  # H[1] re-stored: touched
    assert d.confirmed("a") == [H[1]] and d.owners(H[0]) == ["b"]
    d.apply("b", 2, [], [], True)
    assert d.owners(H[0]) == [] and d.owners(H[1]) == ["a"] and d.owners(H[2]) == ["a"]
    assert d.num_blocks() == 2
    assert d.cache_rooms(("a", "b"), [1, 0]) == [100, 98]
    assert d.cache_fill("a") == 0.02


def test_cache_rooms_follow_every_change():
    d, clock = make("a", "b", capacity=10, ttl=5.0)

    def rooms():
        return d.cache_rooms(["a", "b"], [0, 1])

    assert rooms() == [10, 10]
    d.add_pending("a", H[:3])
    assert rooms() == [7, 10]
    d.apply("a", 1, H[:2], [], False)  # confirms 2 of the 3 pending
    assert rooms() == [7, 10]
    d.apply("b", 1, H[:8] + G[:4], [], False)  # past capacity: LRU keeps 10
    assert rooms() == [7, 0] and len(d.confirmed("b")) == 10
    clock.t += 5.0
    assert d.purge_expired() == 1 and rooms() == [8, 0]
    d.set_capacity("b", 4)
    assert rooms() == [8, 0] and d.confirmed("b") == G[:4]
    d.apply_snapshot("a", [G[0]], seq=1)
    assert rooms() == [9, 0]
    d.remove_replica("a")
    d.add_replica("c", 6)
    assert d.cache_rooms(("c", "b"), [0, 1]) == [6, 0]
