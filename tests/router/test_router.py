"""Router: API errors, optimistic insert, load view increments, stats, snapshot."""

import json

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.policies.kvroute import KVRoutePolicy
from kvroute.router.policy import Policy
from kvroute.router.router import Router
from kvroute.router.types import RouteDecision

SPEC = HashSpec(16)


def prompt(group: int, system_blocks: int, question: int) -> tuple[list, int]:
    tokens = [group * 100_000 + i for i in range(system_blocks * 16)] + [7 + question * 31 + i for i in range(10)]
    return hash_blocks(SPEC, tokens), len(tokens)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class First(Policy):
    name = "first"

    def __init__(self) -> None:
        self.routed = []
        self.removed = []

    def choose(self, request, view):
        return RouteDecision(request.candidates[0], 0, "first")

    def on_routed(self, request, decision):
        self.routed.append(decision.replica_id)

    def on_replica_removed(self, replica_id):
        self.removed.append(replica_id)


def cluster(n=4, policy=None, capacity=1000):
    clock = Clock()
    r = Router(policy or KVRoutePolicy(), 16, clock=clock)
    for i in range(n):
        r.add_replica(f"r{i}", capacity)
    return r, clock


def test_route_errors():
    r = Router(KVRoutePolicy())
    h, n = prompt(0, 2, 0)
    with pytest.raises(ValueError, match="no replicas"):
        r.route(h, n)
    r.add_replica("a", 10)
    with pytest.raises(ValueError, match="unknown candidate"):
        r.route(h, n, ["a", "nope"])
    with pytest.raises(ValueError, match="empty"):
        r.route(h, n, [])
    with pytest.raises(ValueError, match="num_tokens"):
        r.route(h, 3)
    with pytest.raises(ValueError, match="need a policy name"):
        Router(KVRoutePolicy(), slack_rel=2.0)
    assert r.route(h, n).replica_id == "a"


def test_policy_by_name_is_kvroute():
    r = Router("kvroute", slack_rel=1.5)
    assert isinstance(r.policy, KVRoutePolicy) and r.policy.slack_rel == 1.5


def test_burst_with_one_new_prefix_goes_to_one_replica():
    r, _ = cluster(4)
    h, n = prompt(1, 64, 0)
    first = r.route(h, n)
    assert first.reason == "cold"
    for q in range(1, 8):
        hq, nq = prompt(1, 64, q)
        d = r.route(hq, nq)
        assert d.replica_id == first.replica_id and d.reason == "prefix"
        assert d.expected_cached_tokens == 64 * 16
    # another new prefix goes elsewhere (the first replica has a queue now)
    h2, n2 = prompt(2, 64, 0)
    assert r.route(h2, n2).replica_id != first.replica_id


def test_decisions_record_the_longest_prefix_any_candidate_held():
    """``available_tokens`` is the best candidate's match (device, then host tier), even
    when the policy chose another replica; the last prompt token never counts."""
    r, _ = cluster(3, First())
    h, n = prompt(0, 4, 0)  # 4 full blocks + 10 tokens
    assert r.apply(KVEvents("r2", 1, stored=list(h[:3])))
    d = r.route(h, n)
    assert (d.replica_id, d.expected_cached_tokens, d.available_tokens) == ("r0", 0, 3 * 16)
    assert r.route(h, n, ["r0", "r1"]).available_tokens == 16 * 4  # r0's pending run now holds all 4
    r.add_replica("r3", 100, host_capacity_blocks=100)
    assert r.apply(KVEvents("r3", 1, stored=list(h[:1]), host_stored=list(h[1:])))
    assert r.route(h, n, ["r1", "r2", "r3"]).available_tokens == 4 * 16
    whole, m = prompt(1, 2, 0)
    assert r.apply(KVEvents("r2", 2, stored=list(whole)))
    assert r.route(whole, 32, ["r1", "r2"]).available_tokens == 31  # all blocks held: the last token is computed


def test_policy_hooks_and_candidates_subset():
    p = First()
    r, _ = cluster(3, p)
    h, n = prompt(0, 4, 0)
    assert r.route(h, n, ["r2", "r1"]).replica_id == "r2"
    assert p.routed == ["r2"]
    assert r.prefix_match(h, ["r0", "r1", "r2"]) == {"r0": 0, "r1": 0, "r2": 4}
    r.remove_replica("r2")
    assert p.removed == ["r2"] and r.replicas() == ["r0", "r1"]
    assert r.prefix_match(h, ["r0", "r1"]) == {"r0": 0, "r1": 0}


def test_load_view_increments_superseded_by_the_reports_that_count_them():
    r, clock = cluster(2, First())
    h, n = prompt(0, 4, 0)  # 4 blocks + 10 tokens = 74 tokens
    d1 = r.route(h, n)
    assert r.load("r0").in_flight == 1 and r.load("r0").queued_prefill_tokens == n
    d2 = r.route(h, n)  # now 4 blocks pending there: 74 - 64 uncached
    assert 0 < d1.ticket < d2.ticket
    L = r.load("r0")
    assert L.in_flight == 2 and L.queued_prefill_tokens == n + (n - 64) and L.queue_len == 2
    assert L.capacity_blocks == 1000
    fig = dict(num_waiting=1, num_running=1, queued_prefill_tokens=50, kv_usage=0.25,
               prefill_tokens_per_s=5000.0, decode_step_s=0.01)
    # a report taken before either request arrived (a heartbeat repeating the last
    # step's figures, say) keeps both increments on top of its figures
    assert r.apply(KVEvents("r0", 1, stored=list(h), load=LoadFigures(**fig, route_ticket=d1.ticket - 1)))
    L = r.load("r0")
    assert (L.in_flight, L.queued_prefill_tokens, L.num_waiting, L.num_running) == (2, 50 + n + (n - 64), 1, 1)
    assert (L.kv_usage, L.prefill_tokens_per_s, L.decode_step_s) == (0.25, 5000.0, 0.01)
    # one that counts the first: only the second's increment stays
    assert r.apply(KVEvents("r0", 2, load=LoadFigures(**fig, route_ticket=d1.ticket)))
    L = r.load("r0")
    assert (L.in_flight, L.queued_prefill_tokens, L.queue_len) == (1, 50 + n - 64, 3)
    # one that counts both (or later tickets): the figures alone
    assert r.apply(KVEvents("r0", 3, load=LoadFigures(**fig, route_ticket=d2.ticket + 5)))
    L = r.load("r0")
    assert (L.in_flight, L.queued_prefill_tokens, L.queue_len) == (0, 50, 2)
    assert r.load("r1") == r.load("r1").__class__(capacity_blocks=1000)


def test_other_routers_late_decisions_are_not_counted_twice():
    """Peers' decisions (``note_routed``) arrive late and out of ticket order: one the
    replica's last report already counts adds nothing, and a report drops every
    increment it counts, wherever it sits in the queue of increments."""
    r, clock = cluster(2, First())
    h, n = prompt(0, 4, 0)
    fig = dict(num_waiting=1, queued_prefill_tokens=50, prefill_tokens_per_s=5000.0, decode_step_s=0.01)
    own = r.route(h, n)  # our decision, ticket t
    peer_old = own.ticket - 10  # a peer decided before us; its note reaches us only now
    assert r.note_routed("r0", h, n, peer_old)
    assert r.load("r0").in_flight == 2
    # the replica's report counts the peer's request but not ours: only ours stays on top
    assert r.apply(KVEvents("r0", 1, load=LoadFigures(**fig, route_ticket=peer_old)))
    assert (r.load("r0").in_flight, r.load("r0").queued_prefill_tokens) == (1, 50 + n)
    # another peer's decision that this report already counts arrives after it: nothing added
    assert r.note_routed("r0", h, n, peer_old - 1)
    assert r.load("r0").in_flight == 1
    assert r.apply(KVEvents("r0", 2, load=LoadFigures(**fig, route_ticket=own.ticket)))
    assert r.load("r0").in_flight == 0


def test_tickets_move_past_any_seen_when_clocks_disagree():
    """A router whose node's clock runs behind a peer's still issues a later decision a
    higher ticket than the peer's and than any a replica reported (a Lamport clock), so
    a replica's report never counts a decision it has not seen."""
    r, _ = cluster(2, First())
    h, n = prompt(0, 4, 0)
    ahead = r.route(h, n).ticket + 60_000_000  # a peer on a node one minute ahead
    assert r.note_routed("r1", h, n, ahead)
    assert r.route(h, n).ticket > ahead
    later = ahead + 120_000_000  # a replica that accepted a ticket of a router further ahead
    assert r.apply(KVEvents("r0", 1, load=LoadFigures(num_waiting=0, route_ticket=later)))
    mine = r.route(h, n)
    assert mine.ticket > later and r.load(mine.replica_id).in_flight >= 1  # not taken as counted


def test_load_view_increment_expires_when_no_report_counts_it():
    r, clock = cluster(2, First())
    h, n = prompt(0, 2, 0)
    r.route(h, n)
    clock.t += r.directory.pending_ttl_s - 0.1
    d = r.route(h, n)
    assert r.apply(KVEvents("r0", 1, load=LoadFigures(num_waiting=3)))  # no ticket: counts neither
    assert r.load("r0").in_flight == 2
    clock.t += 0.2  # the first is past its deadline (redirected or cancelled on its way)
    assert r.apply(KVEvents("r0", 2, load=LoadFigures(num_waiting=3)))
    L = r.load("r0")
    assert (L.in_flight, L.queue_len, L.queued_prefill_tokens) == (1, 4, n - 32)
    assert r.apply(KVEvents("r0", 3, load=LoadFigures(num_waiting=4, route_ticket=d.ticket)))
    assert r.load("r0").in_flight == 0
    # a restarted router's tickets are above its predecessor's
    restarted = Router(First(), 16)
    restarted.add_replica("r0", 1000)
    assert restarted.route(h, n).ticket > d.ticket


def test_a_repeated_report_changes_nothing_and_increments_still_follow_reports():
    """The same figures again with no increment on top are skipped (one comparison); with
    an increment on top they still drop what they count and keep the rest."""
    r, clock = cluster(2, First())
    h, n = prompt(0, 2, 0)
    fig = LoadFigures(num_waiting=1, num_running=2, queued_prefill_tokens=40, kv_usage=0.5, decode_step_s=0.01)
    assert r.apply(KVEvents("r0", 1, load=fig))
    before = r.load("r0")
    assert r.apply(KVEvents("r0", 2, load=LoadFigures(**{k: getattr(fig, k) for k in fig.__dataclass_fields__})))
    assert r.load("r0") == before and r.loads.has_report("r0")
    d = r.route(h, n)
    assert r.apply(KVEvents("r0", 3, load=fig))  # equal figures, but an increment on top: kept (ticket not counted)
    assert r.load("r0").in_flight == 1 and r.load("r0").queued_prefill_tokens == 40 + n
    counted = LoadFigures(**{**{k: getattr(fig, k) for k in fig.__dataclass_fields__}, "route_ticket": d.ticket})
    assert r.apply(KVEvents("r0", 4, load=counted))
    assert r.apply(KVEvents("r0", 5, load=counted))
    assert r.load("r0").in_flight == 0 and r.load("r0").queued_prefill_tokens == 40


def test_fallbacks_follow_queue_length_like_the_loads_say():
    """``fallbacks``: the candidates but the chosen one, shortest queue first, ties in
    candidate order, for any candidate list (a subset, reordered, with a repeat)."""
    r, clock = cluster(5, First())
    for i, waiting in enumerate((3, 0, 2, 0, 1)):
        assert r.apply(KVEvents(f"r{i}", 1, load=LoadFigures(num_waiting=waiting)))
    h, n = prompt(1, 1, 0)
    r.route(h, n, ["r1", "r2"])  # one in flight on r1
    for cands in (None, ["r4", "r3", "r1", "r0"], ["r2", "r2", "r0", "r3"], ["r3"]):
        ids = cands or r.replicas()
        for chosen in ids:
            expected = sorted((c for c in ids if c != chosen), key=lambda c: r.load(c).queue_len)
            assert r.fallbacks(ids, chosen) == expected
    assert r.fallbacks(r.replicas(), "r0") == ["r3", "r1", "r4", "r2"]
    assert r.directory.known(["r9", "r1", "x", "r0"]) == (["r1", "r0"], ["r9", "x"])


def test_apply_gap_takes_load_and_snapshot_recovers():
    r, _ = cluster(2)
    h, n = prompt(0, 4, 0)
    assert r.apply(KVEvents("r1", 1, stored=h[:2]))
    assert not r.apply(KVEvents("r1", 3, stored=h[2:], load=LoadFigures(num_waiting=5)))
    assert r.stale_replicas() == ["r1"] and r.load("r1").num_waiting == 5
    r.apply_snapshot("r1", h, 3, LoadFigures(num_waiting=2))
    assert r.stale_replicas() == [] and r.load("r1").num_waiting == 2
    assert r.prefix_match(h, ["r0", "r1"]) == {"r0": 0, "r1": 4}
    assert r.apply(KVEvents("gone", 1, stored=h))  # unknown replica: ignored


def test_stats_and_snapshot_restore():
    r, clock = cluster(3)
    for g in range(3):
        for q in range(2):
            h, n = prompt(g, 8, q)
            chosen = r.route(h, n).replica_id
            home = chosen if g == 0 else home  # noqa: F821 (group 0's replica)
    r.apply(KVEvents(home, 1, stored=prompt(0, 8, 0)[0], load=LoadFigures(num_running=1)))
    s = r.stats()
    assert s["replicas"] == 3 and s["decisions"] == 6
    assert s["decisions_by_reason"] == {"cold": 3, "prefix": 3}
    assert sorted(s["decisions_by_replica"].values()) == [2, 2, 2]
    assert s["directory_entries"] == 8 and s["events_applied"] == 1 and s["block_updates"] == 8
    assert s["directory_blocks"] == 8 and s["pending_entries"] == 16  # confirmed; the r0 run left when stored
    state = json.loads(json.dumps(r.snapshot()))
    r2 = Router.restore(state, KVRoutePolicy(), clock=clock)
    assert r2.replicas() == r.replicas() and r2.stats()["directory_blocks"] == 8 and r2.stats()["pending_entries"] == 16
    assert r2.load(home).num_running == 1
    h, n = prompt(1, 8, 5)
    assert r2.route(h, n).replica_id == r.route(h, n).replica_id


def test_same_candidate_list_each_call_and_membership_changes():
    """The cluster passes a fresh list per request: equal lists reuse one validated
    tuple; a membership change invalidates it."""
    r, _ = cluster(3)
    h, n = prompt(3, 4, 0)
    d1 = r.route(h, n, ["r2", "r1"])
    assert d1.replica_id in ("r2", "r1")
    d2 = r.route(h, n, ["r2", "r1"])
    assert (d2.replica_id, d2.reason) == (d1.replica_id, "prefix")
    r.remove_replica("r1")
    with pytest.raises(ValueError, match="unknown candidate"):
        r.route(h, n, ["r2", "r1"])
    r.add_replica("r1", 1000)
    assert r.route(h, n, ["r1"]).replica_id == "r1"
    assert r.load("r1").in_flight == 1 and r.load("r1").queue_len == 1


def test_load_columns_follow_reports_and_increments():
    r, _ = cluster(2, First())
    cols = r.loads.columns(r.loads.select(("r1", "r0")))
    assert cols == ((0, 0), (0.0, 0.0), (0, 0), (0.0, 0.0), (0.0, 0.0), (0, 0), (0, 0), (1000, 1000), False,
                    (0.0, 0.0), (0, 0))  # fmt: skip
    fig = LoadFigures(num_waiting=2, num_running=3, queued_prefill_tokens=70, queued_prefill_s=2.5, kv_usage=0.5,
                      prefill_tokens_per_s=900.0, decode_step_s=0.04)
    r.apply(KVEvents("r0", 1, load=fig))
    r.loads.on_routed("r0", 30)
    r.loads.on_routed("r0", -5)  # nothing uncached: no queued tokens added
    assert r.loads.columns(r.loads.select(("r1", "r0"))) == (
        (0, 100), (0.0, 900.0), (0, 3), (0.0, 0.04), (0.0, 0.04), (0, 7), (0, 4), (1000, 500), False,
        (0.0, 2.5), (0, 30),  # r0 priced the 70 it reported; the 30 routed since are unpriced
    )  # fmt: skip
    r.apply(KVEvents("r1", 1, load=LoadFigures(queued_prefill_tokens=40, prefill_tokens_per_s=800.0, decode_step_s=0.05)))
    assert r.loads.columns(r.loads.select(("r0",))) == (
        (100,), (900.0,), (3,), (0.04,), (0.04,), (7,), (4,), (500,), True, (2.5,), (30,)
    )
    assert r.loads.columns(r.loads.select(("r1", "r0")))[4:] == (
        (0.0, 0.04), (0, 7), (0, 4), (1000, 500), True, (0.0, 2.5), (40, 30)  # r1: no decodes, no estimate
    )
    L = r.load("r0")
    assert (L.queued_prefill_tokens, L.queued_prefill_s, L.unpriced_tokens, L.in_flight, L.queue_len) == (100, 2.5, 30, 2, 7)
