"""A follower replays a router service's changes and decides like it (no Ray: the
follower's ``follow`` calls go straight to the service object)."""

from __future__ import annotations

import random

import pytest

from kvroute.cluster import router_follow
from kvroute.cluster.router_actor import RouterService
from kvroute.cluster.router_follow import ChangeLog, RouterFollower
from kvroute.replica.block_hash import BlockHash, HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures

SPEC = HashSpec(4, 7, "m")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sync(service: RouterService, follower: RouterFollower) -> None:
    follower.apply(service.follow(*follower.request()))


def _view(service_or_follower) -> list[tuple]:
    router = service_or_follower.router
    return sorted(router.registrations())


def _prompt(prefix: int, n_blocks: int = 4) -> tuple[list[BlockHash], int]:
    tokens = [prefix * 1000 + i for i in range(n_blocks * SPEC.block_size)]
    return hash_blocks(SPEC, tokens), len(tokens)


class Fleet:
    """Replicas that register and then push random event batches and load figures."""

    def __init__(self, service: RouterService, rng: random.Random, n: int = 3) -> None:
        self.service, self.rng = service, rng
        self.held: dict[str, list[int]] = {}
        self.seq: dict[str, int] = {}
        for i in range(n):
            self.register(f"r{i}")

    def register(self, rid: str) -> None:
        hashes = [self.rng.randrange(1, 500) for _ in range(self.rng.randint(0, 6))]
        self.held[rid], self.seq[rid] = list(dict.fromkeys(hashes)), 1
        self.service.register(rid, SPEC, 64, [BlockHash(h) for h in self.held[rid]], 1, LoadFigures(num_running=1))

    def step(self) -> None:
        rid = self.rng.choice(sorted(self.held))
        held = self.held[rid]
        removed = self.rng.sample(held, k=min(len(held), self.rng.randint(0, 2)))
        stored = [h for h in {self.rng.randrange(1, 500) for _ in range(self.rng.randint(0, 4))} if h not in held]
        self.held[rid] = [h for h in held if h not in removed] + stored
        self.seq[rid] += 1
        load = LoadFigures(num_running=self.rng.randint(0, 8), num_waiting=self.rng.randint(0, 3))
        batch = KVEvents(rid, self.seq[rid], [BlockHash(h) for h in stored], [BlockHash(h) for h in removed], False, load)
        assert self.service.push(batch) is True

    def leave_and_join(self) -> None:
        gone = self.rng.choice(sorted(self.held))
        self.service.remove_replica(gone)
        del self.held[gone]
        self.register(f"r{len(self.seq)}")


@pytest.mark.parametrize("seed", range(8))
def test_a_follower_holds_the_services_directory_and_loads_through_any_changes(seed):
    rng = random.Random(seed)
    service = RouterService(SPEC)
    fleet = Fleet(service, rng)
    follower = RouterFollower()
    _sync(service, follower)  # (starts from the registrations: nothing was logged before)
    assert follower.stats["starts"] == 1 and _view(follower) == _view(service)
    for _ in range(60):
        for _ in range(rng.randint(0, 5)):
            fleet.step()
        if rng.random() < 0.1:
            fleet.leave_and_join()
        _sync(service, follower)
        assert _view(follower) == _view(service)
    assert follower.stats["starts"] == 1  # every later sync replayed the log
    assert follower.stats["changes"] > 100


def test_decisions_taken_by_one_follower_reach_the_service_and_the_other_follower():
    service = RouterService(SPEC)
    Fleet(service, random.Random(0), n=4)
    a, b = RouterFollower("a"), RouterFollower("b")
    _sync(service, a)
    _sync(service, b)
    hashes, n = _prompt(1)
    candidates = sorted(service.replicas())
    first = a.rank(hashes, n, candidates)
    assert first is not None and first.reason != "prefix"
    assert sorted([first.replica_id, *first.fallbacks]) == candidates
    _sync(service, a)  # hands the decision over
    stats = service.stats()
    assert stats["decisions"] == 1 and stats["decisions_by_replica"] == {first.replica_id: 1}
    # the service and b (after its sync) now expect the prefix where a sent it
    assert service.router.directory.match(hashes, candidates)[first.replica_id] == len(hashes)
    assert b.router.directory.match(hashes, candidates)[first.replica_id] == 0
    _sync(service, b)
    assert b.router.directory.match(hashes, candidates)[first.replica_id] == len(hashes)
    again = b.rank(hashes, n, candidates)
    assert again.replica_id == first.replica_id and again.expected_cached_tokens > 0
    # a does not apply its own decision twice (it came back through the log)
    pending_a = a.router.directory.pending(first.replica_id)
    _sync(service, a)
    assert a.router.directory.pending(first.replica_id) == pending_a


def test_a_decision_the_service_takes_itself_reaches_the_followers():
    """A process without a follower (or one whose follower is not ready) asks ``rank``:
    the followers learn that decision's pending run too."""
    service = RouterService(SPEC)
    Fleet(service, random.Random(1), n=3)
    follower = RouterFollower("f")
    _sync(service, follower)
    hashes, n = _prompt(2)
    candidates = sorted(service.replicas())
    decision = service.rank(hashes, n, candidates)
    assert follower.router.directory.match(hashes, candidates)[decision.replica_id] == 0
    _sync(service, follower)
    assert follower.router.directory.match(hashes, candidates)[decision.replica_id] == len(hashes)
    assert follower.rank(hashes, n, candidates).replica_id == decision.replica_id


def test_a_follower_starts_over_on_reset_policy_change_log_overflow_and_absence(monkeypatch):
    clock = Clock()
    service = RouterService(SPEC, clock=clock)
    fleet = Fleet(service, random.Random(1))
    follower = RouterFollower(clock=clock)
    _sync(service, follower)
    service.reset()  # empty: the replicas register again
    for rid in sorted(fleet.held):
        fleet.register(rid)
    _sync(service, follower)
    assert follower.stats["starts"] == 2 and _view(follower) == _view(service)
    service.adopt("round_robin")
    _sync(service, follower)
    assert follower.stats["starts"] == 3 and follower.router.policy.name == "round_robin"
    service.changes = ChangeLog(clock, max_ops=4)  # a short log
    _sync(service, follower)
    for _ in range(10):
        fleet.step()
    _sync(service, follower)
    assert follower.stats["starts"] == 5 and _view(follower) == _view(service)
    clock.t += router_follow.FOLLOWER_TTL_S + 1  # nobody follows: nothing is logged
    fleet.step()
    _sync(service, follower)
    assert follower.stats["starts"] == 6 and _view(follower) == _view(service)


def test_a_follower_decides_only_while_fresh_and_only_among_known_replicas():
    clock = Clock()
    service = RouterService(SPEC, clock=clock)
    Fleet(service, random.Random(2), n=2)
    follower = RouterFollower(clock=clock)
    hashes, n = _prompt(3)
    assert follower.rank(hashes, n, ["r0", "r1"]) is None  # never synced
    _sync(service, follower)
    assert follower.rank(hashes, n, ["new"]) is None  # the service answers "unregistered"
    decided = follower.rank(hashes, n, ["r0", "new", "r1"])
    assert decided.replica_id in ("r0", "r1") and decided.fallbacks[-1] == "new"
    assert follower.period() == router_follow.FOLLOW_S  # it decides
    clock.t += max(router_follow.STALE_S, router_follow.BUSY_FOR_S)
    assert not follower.ready() and follower.rank(hashes, n, ["r0", "r1"]) is None
    assert follower.period() == router_follow.IDLE_FOLLOW_S
