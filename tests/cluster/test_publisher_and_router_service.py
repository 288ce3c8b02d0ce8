"""The plain objects inside the Ray shells: event coalescing and the router service."""

from __future__ import annotations

import random

import pytest

from kvroute.cluster.publisher import EventPublisher
from kvroute.cluster.router_actor import RouterService
from kvroute.replica.block_hash import BlockHash, HashSpec
from kvroute.replica.kv_events import KVEvents, LoadFigures

SPEC = HashSpec(4, 123, "m")


def _replay(state: set[int], ev: KVEvents) -> set[int]:
    if ev.cleared:
        state = set()
    state = state - set(ev.removed)
    return state | set(ev.stored)


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_batches_replay_to_the_same_cache(seed):
    """Folding any run of step batches into one message gives the same cache state as
    applying them one by one, and messages are numbered 1, 2, 3, ..."""
    rng = random.Random(seed)
    pub = EventPublisher("r")
    truth: set[int] = set()
    seen: set[int] = set()
    step_seq = 0
    for _ in range(30):
        for _ in range(rng.randint(1, 5)):
            cleared = rng.random() < 0.05
            base = set() if cleared else truth
            removed = rng.sample(sorted(base), k=min(len(base), rng.randint(0, 3)))
            stored = [h for h in rng.sample(range(40), k=rng.randint(0, 4)) if h not in removed]
            step_seq += 1
            ev = KVEvents("r", step_seq, stored, removed, cleared, LoadFigures(num_running=step_seq))
            truth = _replay(truth, ev)
            pub.add(ev)
        msg = pub.take()
        assert msg.seq == pub.seq and not set(msg.stored) & set(msg.removed)
        assert msg.load == LoadFigures(num_running=step_seq)
        seen = _replay(seen, msg)
        assert seen == truth


def test_heartbeat_and_snapshot_numbering():
    pub = EventPublisher("r")
    assert not pub.has_changes
    beat = pub.take()
    assert (beat.seq, beat.empty) == (1, True)
    pub.add(KVEvents("r", 1, [BlockHash(5)], [], False, None))
    assert pub.has_changes
    assert pub.snapshot_seq() == 1  # the pending change is part of the snapshot
    assert not pub.has_changes and pub.take().seq == 2


def _service(clock=None) -> RouterService:
    t = [0.0]
    svc = RouterService(SPEC, "kvroute", replica_timeout_s=5.0, clock=clock or (lambda: t[0]))
    svc._t = t  # type: ignore[attr-defined]
    return svc


def test_register_refuses_a_different_hash_spec():
    svc = _service()
    with pytest.raises(ValueError, match="must use the same model, block_size and hash_seed"):
        svc.register("a", HashSpec(4, 124, "m"), 10, [], 0)
    assert svc.replicas() == []


def test_push_from_unknown_or_gapped_replica_asks_for_a_snapshot():
    svc = _service()
    assert svc.push(KVEvents("a", 1, [BlockHash(1)])) is False  # unknown: register first
    svc.register("a", SPEC, 10, [BlockHash(9)], 3)
    assert svc.push(KVEvents("a", 4, [BlockHash(1)])) is True
    assert sorted(svc.directory("a")) == [1, 9]
    assert svc.push(KVEvents("a", 6, [BlockHash(2)])) is False  # seq 5 was lost
    svc.register("a", SPEC, 10, [BlockHash(1), BlockHash(2)], 6)  # the snapshot heals it
    assert sorted(svc.directory("a")) == [1, 2]
    assert svc.push(KVEvents("a", 7, [], [BlockHash(1)])) is True
    assert svc.directory("a") == [2]


def test_rank_puts_the_prefix_holder_first_and_unregistered_last():
    svc = _service()
    svc.register("a", SPEC, 100, [], 0)
    svc.register("b", SPEC, 100, [BlockHash(11), BlockHash(12)], 0)
    r = svc.rank([BlockHash(11), BlockHash(12)], 9, ["a", "new", "b"])
    assert r.order == ["b", "a", "new"] and r.expected_cached_tokens == 8 and r.reason == "prefix"
    only_new = svc.rank([BlockHash(11)], 5, ["new"])
    assert only_new.order == ["new"] and only_new.reason == "unregistered"


def test_silent_replicas_expire_and_removal_is_idempotent():
    svc = _service()
    svc.register("a", SPEC, 10, [BlockHash(1)], 0)
    svc.register("b", SPEC, 10, [], 0)
    svc._t[0] = 3.0  # type: ignore[attr-defined]
    svc.push(KVEvents("b", 1))
    svc._t[0] = 6.0  # type: ignore[attr-defined]
    svc.rank([], 1, ["a", "b"])
    assert svc.replicas() == ["b"] and svc.counters["expired_replicas"] == 1
    assert svc.remove_replica("b") is True and svc.remove_replica("b") is False


def test_routers_share_their_decisions_so_two_place_like_one():
    """Router A's decisions reach router B (batched: at the next flush, forced by any
    push): B then sees A's new prefix pending on A's choice and counts it in flight there,
    so a request sharing the prefix goes to the same replica from either router; the
    age of what arrived is kept."""
    clock = [0.0]
    a = RouterService(SPEC, clock=lambda: clock[0])
    b = RouterService(SPEC, clock=lambda: clock[0])
    a._share = b.note_peer_decisions  # noqa: SLF001  (the actor wires this to Ray handles)
    for svc in (a, b):
        for rid in ("r0", "r1", "r2"):
            svc.register(rid, SPEC, 100, [], 0, LoadFigures())
    prefix = [BlockHash(1000 + i) for i in range(8)]
    first = a.rank(prefix + [BlockHash(1)], 40, ["r0", "r1", "r2"])
    chosen = first.replica_id
    assert b.router.stats()["peer_decisions"] == 0  # not flushed yet (flushed at most every PEER_FLUSH_S)
    assert a.push(KVEvents("r0", 1))  # any call flushes
    assert b.router.stats()["peer_decisions"] == 1
    assert b.router.load(chosen).in_flight == 1
    assert b.router.prefix_match(prefix, [chosen])[chosen] == len(prefix)  # pending there
    second = b.rank(prefix + [BlockHash(2)], 40, ["r0", "r1", "r2"])
    assert second.replica_id == chosen and second.expected_cached_tokens == 8 * SPEC.block_size
    assert set(b.stats()["peer_staleness_ms"]) == {"p50", "p99"}
    assert b.note_peer_decisions([("gone", prefix, 40, 1, 0.0, None)]) == 0  # an unknown replica is skipped


def test_the_flusher_sends_the_last_decisions_before_a_lull():
    """With the flusher thread, a decision reaches the peer router without another call."""
    import time

    a, b = RouterService(SPEC), RouterService(SPEC)
    a._share = b.note_peer_decisions  # noqa: SLF001
    for svc in (a, b):
        svc.register("r0", SPEC, 100, [], 0, LoadFigures())
    a.start_flusher(0.005)
    a.rank([BlockHash(7), BlockHash(8)], 12, ["r0"])
    deadline = time.monotonic() + 5
    while b.router.stats()["peer_decisions"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b.router.stats()["peer_decisions"] == 1 and b.router.load("r0").in_flight == 1
    while a._queued.is_set() and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.005)
    assert not a._queued.is_set()  # noqa: SLF001  (the thread now sleeps until the next decision)


def test_a_ranking_reports_the_router_process_cpu_use():
    """The figure the ingresses spill by: the process's CPU over the last interval of at
    least LOAD_SAMPLE_S, near one core while it computes, near none while it sleeps."""
    import time

    from kvroute.cluster.router_choice import LOAD_SAMPLE_S

    svc = _service()
    svc.register("a", SPEC, 100, [], 0)
    cpu0, wall0 = time.process_time(), time.monotonic()
    end = wall0 + 1.5 * LOAD_SAMPLE_S
    while time.monotonic() < end:  # this process busy: one core, or what a loaded box gives it
        svc.rank([BlockHash(11)], 5, ["a"])
    got = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    busy = svc.rank([BlockHash(11)], 5, ["a"]).router_load
    assert busy > 0.6 * got and busy > 0.1, (busy, got)
    # other tests' threads may still run in this process: what they use while this one
    # sleeps is measured beside the figure, which must not exceed it by much. (One sample
    # first to close the interval that still holds the busy loop's tail.)
    time.sleep(1.5 * LOAD_SAMPLE_S)
    svc.rank([BlockHash(11)], 5, ["a"])
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(1.5 * LOAD_SAMPLE_S)
    background = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    idle = svc.rank([BlockHash(11)], 5, ["a"])
    assert idle.router_load < background + 0.3 and svc.stats()["cpu_load"] == pytest.approx(idle.router_load, abs=1e-3)


def test_a_router_that_does_not_rank_lets_its_feeds_wait():
    """A standby (no rank for ACTIVE_S) answers a push with standby_push_s; a router
    that ranks, or one without a standby interval, with True; a gap is still False."""
    from kvroute.cluster.router_actor import ACTIVE_S

    t = [0.0]
    svc = RouterService(SPEC, "kvroute", replica_timeout_s=30.0, clock=lambda: t[0], standby_push_s=2.0)
    svc.register("a", SPEC, 100, [], 0)
    assert svc.push(KVEvents("a", 1, [BlockHash(1)])) == 2.0
    svc.rank([BlockHash(1)], 5, ["a"])
    assert svc.push(KVEvents("a", 2)) is True
    t[0] += ACTIVE_S
    assert svc.push(KVEvents("a", 3)) == 2.0 and svc.directory("a") == [1]
    assert svc.push(KVEvents("a", 5)) is False  # seq 4 lost: register again, standby or not
    assert svc.stats()["pushes"] == 4
    plain = _service()  # standby_push_s 0 (a lone router): never asks to wait
    plain.register("a", SPEC, 10, [], 0)
    assert plain.push(KVEvents("a", 1)) is True
