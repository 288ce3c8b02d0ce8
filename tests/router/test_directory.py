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


def _random_closed_states(rng, d, names, chains):
    """Drive ``d`` the way replicas do: store a chain's leading blocks (parent first),
    evict chain tails, record pending tails from the held depth on. Returns the exact
    sets each replica holds (confirmed or pending)."""
    held = {r: set() for r in names}
    seq = dict.fromkeys(names, 0)
    for _ in range(rng.randint(1, 12)):
        r = rng.choice(names)
        chain = rng.choice(chains)
        k = 0
        while k < len(chain) and chain[k] in held[r]:
            k += 1
        op = rng.random()
        if op < 0.45:  # prefill: the next blocks of this chain past those it has stored
            confirmed = set(d.confirmed(r))
            kc = 0
            while kc < len(chain) and chain[kc] in confirmed:
                kc += 1
            new = chain[kc : rng.randint(kc, len(chain))]
            seq[r] += 1
            d.apply(r, seq[r], new, [], False)
            held[r].update(new)
        elif op < 0.7:  # routed here: pending from the held depth on
            end = rng.randint(k, len(chain))
            d.add_pending(r, chain[:end], start=k)
            held[r].update(chain[k:end])
        else:  # evict from this chain's held run, leaves first (as the block pool does)
            confirmed = set(d.confirmed(r))
            gone = []
            for h in reversed(chain[rng.randint(0, k) : k]):
                has_child = any(c[i - 1] == h and c[i] in held[r] for c in chains for i in range(1, len(c)))
                if h not in confirmed or has_child:
                    break
                gone.append(h)
                held[r].discard(h)
            seq[r] += 1
            d.apply(r, seq[r], [], gone, False)
    return held


def test_match_agrees_with_brute_force_on_prefix_closed_states():
    """Random states reached the way replicas reach them (chains sharing prefixes,
    stored parent first from the stored depth, evicted tail first, pending runs from
    the held depth): the
    bisecting match equals a block-by-block walk."""
    import random

    rng = random.Random(7)
    trunk = list(range(16 * 6))
    chains = [hash_blocks(SPEC, trunk + list(range(100 * j, 100 * j + 16 * rng.randint(0, 18)))) for j in range(1, 5)]
    chains.append(hash_blocks(SPEC, list(range(5000, 5000 + 16 * 20))))
    names = [f"r{i}" for i in range(6)]
    for trial in range(300):
        d, _ = make(*names, capacity=1000)
        held = _random_closed_states(rng, d, names, chains)
        for r in names:  # the driver kept closure, and tracked the state exactly
            assert set(d.confirmed(r)) | set(d.pending(r)) == held[r]
        for req in rng.sample(chains, 3):
            req = req[: rng.randint(0, len(req))]
            cands = rng.sample(names, rng.randint(1, 6))
            want = {}
            for c in cands:
                k = 0
                while k < len(req) and req[k] in held[c]:
                    k += 1
                want[c] = k
            assert d.match(req, cands) == want
            assert d.match(req, tuple(cands)) == want


def test_match_bisects_instead_of_walking_every_block():
    """2 lookups for a full hit, about log2(blocks) per distinct depth; the depths of
    several owners that drop out at different blocks come out right."""

    class Counting(dict):
        gets = 0

        def get(self, k, default=None):
            Counting.gets += 1
            return super().get(k, default)

    chain = hash_blocks(SPEC, list(range(16 * 256)))
    d, _ = make("a", "b", "c", "d", capacity=1000)
    d.apply("a", 1, chain, [], False)
    d.apply("b", 1, chain[:100], [], False)
    d.apply("c", 1, chain[:3], [], False)
    d.add_pending("d", chain[:255])
    d._confirmed._owners = Counting(d._confirmed._owners)
    assert d.match(chain, ["a"]) == {"a": 256}
    assert Counting.gets == 2
    Counting.gets = 0
    assert d.match(chain, ["a", "b", "c", "d"]) == {"a": 256, "b": 100, "c": 3, "d": 255}
    assert Counting.gets <= 2 + 3 * 8
    assert d.match_depths(chain, d.select(("d", "c", "b", "a"))) == [255, 3, 100, 256]
    assert d.match_depths(chain, d.select(["a", "a"])) == [256, 256]  # a candidate listed twice
    assert d.match_depths(G, d.select(["a", "b"])) == [0, 0]


def test_add_pending_counts_and_state_with_blocks_held_elsewhere():
    d, clock = make("a", "b")
    d.apply("b", 1, H[:4], [], False)  # b holds H[0..3]
    # all new for a, some held by b: every block pending on a, b keeps its entries
    assert d.add_pending("a", H[:6]) == 6
    assert d.pending("a") == H[:6] and d.owners(H[1]) == ["a", "b"] and d.owners(H[5]) == ["a"]
    # H[0..1] confirmed on a; a second run skips that confirmed lead: H[2..7]
    d.apply("a", 1, H[:2], [], False)
    clock.t += 3.0
    assert d.add_pending("a", H) == 6
    assert d.confirmed("a") == H[:2] and d.pending("a") == H[2:8]
    clock.t += 3.0  # the first run's deadline passed; the second keeps H[2..7]
    assert d.match(H, ["a", "b"]) == {"a": 8, "b": 4}
    clock.t += 2.0  # past the second: only the confirmed entries remain on a
    assert d.match(H, ["a", "b"]) == {"a": 2, "b": 4}
    assert d.owners(H[3]) == ["b"] and d.owners(H[6]) == [] and d.pending("a") == []
    # a request a holds entirely records nothing
    assert d.add_pending("a", H[:2]) == 0 and d.add_pending("a", H, start=8) == 0


def test_runs_found_from_any_depth_and_chained():
    """A run is found wherever a request stops inside it: at its first stride's own
    positions, or from the stride start of a later position (a run partly confirmed);
    runs that continue each other chain; a request diverging inside a run gets the
    shared part."""
    chain = hash_blocks(SPEC, list(range(16 * 80)))
    other = hash_blocks(SPEC, list(range(16 * 50)) + list(range(90000, 90000 + 16 * 30)))  # shares 50 blocks
    d, clock = make("a", "b", capacity=1000)
    d.apply("a", 1, chain[:5], [], False)
    assert d.add_pending("a", chain[:40], start=5) == 35  # indexed at 5..15, 16, 32
    assert d.match(chain, ["a", "b"]) == {"a": 40, "b": 0}
    d.apply("a", 2, chain[5:9], [], False)  # confirmed to 9: inside the first stride
    assert d.match(chain, ["a"]) == {"a": 40}
    d.apply("a", 3, chain[9:21], [], False)  # to 21: found from position 16
    assert d.match(chain, ["a"]) == {"a": 40}
    assert d.add_pending("a", chain, start=40) == 40  # a second run, chained at 40
    assert d.match(chain, ["a"]) == {"a": 80}
    assert d.match(other, ["a"]) == {"a": 50}  # diverges inside the second run
    assert d.match(chain[:33], ["a"]) == {"a": 33}
    assert d.add_pending("b", chain[:60]) == 60
    assert d.match_depths(chain, d.select(("b", "a"))) == [60, 80]
    d.apply("a", 4, chain[21:40], [], False)  # the first run's last block: it leaves
    assert d.pending("a") == chain[40:80]
    assert d.match(chain, ["a", "b"]) == {"a": 80, "b": 60}
    clock.t += 5.0
    assert d.match(chain, ["a", "b"]) == {"a": 40, "b": 0}
    assert d.pending("a") == [] and d.cache_rooms(d.select(["a", "b"]), [0, 1]) == [960, 1000]


def test_confirming_pending_and_removing_keep_owner_bits_exact():
    d, _ = make("a", "b")
    d.add_pending("a", H[:3])
    d.apply("b", 1, H[:3], [], False)
    d.apply("a", 1, [H[0], H[1]], [], False)  # confirms two of the run's blocks
    assert d.confirmed("a") == H[:2] and d.pending("a") == [H[2]]
    assert d.owners(H[0]) == ["a", "b"] and d.num_pending() == 3  # the run leaves when H[2] is stored
    d.apply("a", 2, [H[1]], [H[0]], False)  # H[1] re-stored: touched; H[0] evicted
    assert d.confirmed("a") == [H[1]] and d.owners(H[0]) == ["a", "b"]  # the routed run still covers it
    d.apply("a", 3, [H[2]], [], False)  # the run's last block: the run leaves
    assert d.pending("a") == [] and d.owners(H[0]) == ["b"]
    d.apply("b", 2, [], [], True)
    assert d.owners(H[0]) == [] and d.owners(H[1]) == ["a"] and d.owners(H[2]) == ["a"]
    assert d.num_blocks() == 2
    assert d.cache_rooms(d.select(("a", "b")), [1, 0]) == [100, 98]
    assert d.cache_fill("a") == 0.02


def test_cache_rooms_follow_every_change():
    d, clock = make("a", "b", capacity=10, ttl=5.0)

    def rooms():
        return d.cache_rooms(d.select(["a", "b"]), [0, 1])

    assert rooms() == [10, 10]
    d.add_pending("a", H[:3])
    assert rooms() == [7, 10]
    d.apply("a", 1, H[:2], [], False)  # confirms 2 of the run's 3: counted twice until it leaves
    assert rooms() == [5, 10]
    d.apply("b", 1, H[:8] + G[:4], [], False)  # past capacity: LRU keeps 10
    assert rooms() == [5, 0] and len(d.confirmed("b")) == 10
    clock.t += 5.0
    assert d.purge_expired() == 3 and rooms() == [8, 0]
    d.set_capacity("b", 4)
    assert rooms() == [8, 0] and d.confirmed("b") == G[:4]
    d.apply_snapshot("a", [G[0]], seq=1)
    assert rooms() == [9, 0]
    d.remove_replica("a")
    d.add_replica("c", 6)
    assert d.cache_rooms(d.select(("c", "b")), [0, 1]) == [6, 0]
