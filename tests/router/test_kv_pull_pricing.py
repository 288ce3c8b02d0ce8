"""Pull against recompute against wait (``router/policies/kv_pull_pricing.py``) through
the ``Router``: replicas report their caches and load figures as KV events, and the
frozen decision names where the request runs and where its prefix comes from."""

import dataclasses

import pytest

from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.policies.kv_pull_pricing import PullPricing, copy_room
from kvroute.router.router import Router
from kvroute.router.types import RouteDecision

SPEC = HashSpec(16)
PREFIX = list(range(1000, 1000 + 16 * 125))  # 2,000 tokens: 125 blocks
PROMPT = PREFIX + list(range(5, 45))  # + 40 tokens of question
H = hash_blocks(SPEC, PROMPT)
RATE = 2_000.0  # prefill tokens/s: a CPU replica, a 2,000-token prefill takes 1 s
KV = 46_080  # SmolLM2-135M's KV bytes per token in fp32 (30 layers × K, V × 3 heads × 64 × 4)
FAST = dict(kv_bytes_per_token=KV, pull_bytes_per_s=1e9, pull_setup_s=0.01)  # 92 MB in 0.1 s


def _router(loads: dict[str, LoadFigures], held: dict[str, int], **policy) -> Router:
    r = Router("kvroute", 16, **policy)
    for rid, load in loads.items():
        r.add_replica(rid, 4096)
        r.apply(KVEvents(rid, 1, stored=H[: held.get(rid, 0)], load=load))
    return r


def _load(queued: int = 0, waiting: int = 0, **pull) -> LoadFigures:
    return LoadFigures(num_waiting=waiting, queued_prefill_tokens=queued, queued_prefill_s=queued / RATE,
                       prefill_tokens_per_s=RATE, decode_step_s=0.02, **pull)  # fmt: skip


def test_a_busy_owner_sends_the_request_to_an_idle_replica_that_pulls_from_the_least_loaded_holder():
    loads = {"a": _load(8_000, 4, **FAST), "b": _load(4_000, 2, **FAST), "c": _load(**FAST)}
    router = _router(loads, {"a": 125, "b": 125})
    d = router.route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from, d.pull_tokens) == ("c", "pull", "b", 2000)
    assert d.expected_cached_tokens == d.available_tokens == 2000
    # the router queued only what c computes after the pull, not the whole prompt
    assert router.load("c").queued_prefill_tokens == len(PROMPT) - 2000
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.pull_from = "a"  # type: ignore[misc]


def test_a_partial_holder_pulls_only_the_blocks_it_lacks_and_the_price_counts_them():
    loads = {"a": _load(8_000, 4, **FAST), "c": _load(**FAST)}
    router = _router(loads, {"a": 125, "c": 100})
    d = router.route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from, d.pull_tokens, d.expected_cached_tokens) == ("c", "pull", "a", 2000, 2000)
    pricing, table = PullPricing(), router.candidate_table(H, ["a", "c"])
    assert table.depth == [125, 127]  # c: its pending run (the pull, then its own blocks)
    table.depth = [125, 100]  # as before the decision
    figures = pricing.possible(table)
    assert figures is not None
    offers = pricing.offers(table, figures, len(PROMPT), 16, [4.0, 0.0], [0.0, 0.0], RATE, 2048, [99.0, 99.0])
    assert list(offers) == [1] and offers[1].blocks == 25
    assert offers[1].seconds == pytest.approx(0.01 + 25 * 16 * KV / 1e9)


def test_a_slow_link_recomputes_instead():
    slow = dict(FAST, pull_bytes_per_s=1e6)  # 92 MB would take 92 s
    router = _router({"a": _load(8_000, 4, **slow), "c": _load(**slow)}, {"a": 125})
    d = router.route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from, d.pull_tokens, d.expected_cached_tokens) == ("c", "hot_prefix_replica", None, 0, 0)


def test_an_owner_whose_queue_is_shorter_than_the_pull_keeps_the_request():
    router = _router({"a": _load(40, 1, **FAST), "c": _load(**FAST)}, {"a": 125})
    d = router.route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("a", "prefix", None)


def test_no_pull_where_a_replica_cannot_act_on_one_or_holds_another_model():
    # no kv_bytes_per_token reported: a host that does not pull (an external worker)
    router = _router({"a": _load(8_000, 4), "c": _load()}, {"a": 125})
    assert router.route(H, len(PROMPT)).pull_from is None
    other = dict(FAST, kv_bytes_per_token=2 * KV)  # another model's KV: never exchanged
    router = _router({"a": _load(8_000, 4, **FAST), "c": _load(**other)}, {"a": 125})
    assert router.route(H, len(PROMPT)).pull_from is None
    router = _router({"a": _load(8_000, 4, **FAST), "c": _load(**FAST)}, {"a": 125}, pulls=False)
    assert router.route(H, len(PROMPT)).reason == "hot_prefix_replica"


def test_unmeasured_bandwidth_borrows_the_fleets_then_the_default():
    pricing = PullPricing(default_bytes_per_s=1e6, default_setup_s=0.0)
    unmeasured = dict(FAST, pull_bytes_per_s=0.0, pull_setup_s=0.0)
    router = _router({"a": _load(8_000, 4, **unmeasured), "c": _load(**unmeasured)}, {"a": 125},
                     default_pull_bytes_per_s=1e6)  # fmt: skip
    assert router.route(H, len(PROMPT)).pull_from is None  # 92 s at the default: recompute
    table = router.candidate_table(H, ["a", "c"])
    table.depth = [125, 0]  # as before the decision (c now holds the prompt as a pending run)
    sizes, _, _, confirmed = table.pull()  # type: ignore[misc]
    measured_peer = (sizes, [2e9, 0.0], [0.0, 0.0], confirmed)  # the holder measured 2 GB/s: c borrows it
    offers = pricing.offers(table, measured_peer, len(PROMPT), 16, [4.0, 0.0], [0.0, 0.0], RATE, 2048, [99.0, 99.0])
    assert offers[1].seconds == pytest.approx(125 * 16 * KV / 2e9)


def test_the_decision_is_frozen_and_completed_by_copies():
    d = RouteDecision("a", 16, "pull", pull_from="b", pull_tokens=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.ticket = 3  # type: ignore[misc]
    e = dataclasses.replace(d, ticket=3, fallbacks=("c",))
    assert (e.ticket, e.order, e.pull_from, e.pull_tokens) == (3, ["a", "c"], "b", 32) and d.ticket == 0


def test_a_pull_into_a_replica_whose_running_answers_need_its_free_kv_goes_to_a_roomier_one():
    # c has 200 free blocks (3,200 tokens): the 2,040-token request fits them now, but its
    # 10 running answers still decode: the one nearest its end 200 tokens (4 s at 20 ms a
    # step), so all ten about 10 × 5.5 × 200 = 11,000: the copy would take KV they need
    # (preempting one). d is idle, with a short queue: it pulls instead.
    short = dict(num_running=10, kv_usage=1 - 200 / 4096, release_s=4.0)
    loads = {"a": _load(8_000, 4, **FAST), "c": dataclasses.replace(_load(**FAST), **short), "d": _load(400, 1, **FAST)}
    d = _router(loads, {"a": 125}, pull_kv_room=True).route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("d", "pull", "a")
    assert _router(loads, {"a": 125}, pull_kv_room=False).route(H, len(PROMPT)).replica_id == "c"  # off: c pulls
    # the same c without running answers takes the pull (it is the fastest)
    loads["c"] = dataclasses.replace(_load(**FAST), kv_usage=1 - 200 / 4096)
    d = _router(loads, {"a": 125}, pull_kv_room=True).route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("c", "pull", "a")


def test_copy_room_is_free_kv_less_queued_prefills_less_the_running_answers_growth():
    c = dataclasses.replace(_load(**FAST), num_running=4, kv_usage=0.5, release_s=1.0)  # 50 tokens to its first end
    table = _router({"a": _load(800, 1, **FAST), "c": c}, {"a": 125}).candidate_table(H, ["a", "c"])
    assert copy_room(table, 16) == [4096 * 16 - 800, 2048 * 16 - 2 * 4 * 2.5 * 50]  # the growth counted twice


def test_a_replica_too_short_of_kv_for_the_pull_does_not_recompute_the_prompt_instead():
    # c, crowded as above, would recompute the 2,040 tokens in about 1 s against 4 s of
    # queue at the owner a; recomputing takes the same blocks the copy would, so c is
    # passed over for both and the request waits at its owner (with the option off, c pulls)
    short = dict(num_running=10, kv_usage=1 - 200 / 4096, release_s=4.0)
    loads = {"a": _load(8_000, 4, **FAST), "c": dataclasses.replace(_load(**FAST), **short)}
    d = _router(loads, {"a": 125}).route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("a", "prefix", None)
    d = _router(loads, {"a": 125}, pull_kv_room=False).route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("c", "pull", "a")


def test_crowded_marks_only_the_candidates_that_could_pull_and_lack_the_room():
    short = dict(num_running=10, kv_usage=1 - 200 / 4096, release_s=4.0)
    loads = {"a": _load(8_000, 4, **FAST), "c": dataclasses.replace(_load(**FAST), **short), "d": _load(400, 1, **FAST)}
    table = _router(loads, {"a": 125}).candidate_table(H, ["a", "c", "d"])
    figures = PullPricing(kv_room=True).possible(table)
    assert figures is not None
    assert PullPricing(kv_room=True).crowded(table, figures, len(PROMPT), 16) == [False, True, False]
    assert PullPricing(kv_room=False).crowded(table, figures, len(PROMPT), 16) is None
    roomy = {**loads, "c": _load(**FAST)}
    table = _router(roomy, {"a": 125}).candidate_table(H, ["a", "c", "d"])
    assert PullPricing(kv_room=True).crowded(table, PullPricing.possible(table), len(PROMPT), 16) is None


def test_the_running_answers_growth_counts_twice_since_the_nearest_end_reads_it_low(monkeypatch):
    # c: 222 free blocks (3,552 tokens); 4 running answers, the nearest 100 tokens from its
    # end (2 s at 20 ms a step), so 4 × 2.5 × 100 = 1,000 tokens of growth: once, 2,552
    # tokens hold the 2,040-token request (the copy and the rest); twice, 1,552 do not
    from kvroute.router.policies import kv_pull_pricing

    short = dict(num_running=4, kv_usage=1 - 222 / 4096, release_s=2.0)
    loads = {"a": _load(8_000, 4, **FAST), "c": dataclasses.replace(_load(**FAST), **short), "d": _load(400, 1, **FAST)}
    assert _router(loads, {"a": 125}).route(H, len(PROMPT)).replica_id == "d"
    monkeypatch.setattr(kv_pull_pricing, "GROWTH_MARGIN", 1.0)
    d = _router(loads, {"a": 125}).route(H, len(PROMPT))
    assert (d.replica_id, d.reason, d.pull_from) == ("c", "pull", "a")


def test_a_second_pull_into_a_replica_counts_the_first_pulls_blocks_until_its_request_runs():
    # c (250 blocks, idle) took a pull of PREFIX for PROMPT, now waiting there: its pool
    # holds the 125 copied blocks cached, held by no request yet. A second request, of
    # another 2,000-token prefix whose holder b is busy, would pull it into c: its 2,040
    # tokens fit the 250 free blocks the pool counts (less the 40 queued tokens), not the
    # 125 left once the waiting request's hits are counted, as the replica reports them
    from kvroute.replica.kv_cache_manager import KVCacheManager
    from kvroute.replica.request import Request
    from kvroute.replica.sampling_params import SamplingParams
    from kvroute.replica.scheduler import Scheduler, SchedulerConfig
    from kvroute.replica.telemetry import ReplicaTelemetry

    kv = KVCacheManager(250, 16)
    sched = Scheduler(SchedulerConfig(8192, 256), kv)
    tel = ReplicaTelemetry("c", sched, kv)
    tel.pull_state = lambda: (KV, 1e9, 0.01)
    chain = kv.pool.take_new_blocks(125)
    for i, block in enumerate(chain):  # the import: fresh blocks, cached, released tail first
        kv.pool.cache_block(block, H[i], PROMPT[16 * i : 16 * (i + 1)], H[i - 1] if i else None)
    kv.pool.free(reversed(chain))
    sched.add(Request("first", PROMPT, SamplingParams(max_tokens=8), SPEC))
    now = tel.load()
    assert kv.pool.num_free_blocks == 250 and now.kv_usage == pytest.approx(125 / 250) and now.queued_prefill_tokens == 40
    other = list(range(50_000, 50_000 + 16 * 125)) + list(range(5, 45))
    h2 = hash_blocks(SPEC, other)

    def route(c_load: LoadFigures) -> tuple[RouteDecision, list[float], list[bool] | None]:
        r = Router("kvroute", 16)
        r.add_replica("b", 4096)
        r.apply(KVEvents("b", 1, stored=h2[:125], load=_load(8_000, 4, **FAST)))
        r.add_replica("c", 250)
        r.apply(KVEvents("c", 1, stored=H[:125], load=c_load))
        table = r.candidate_table(h2, ["b", "c"])
        pricing = PullPricing(kv_room=True)
        room, crowded = copy_room(table, 16), pricing.crowded(table, pricing.possible(table), len(other), 16)
        return r.route(h2, len(other)), room, crowded  # (after: the decision adds to the table's queue)

    d, room, crowded = route(now)
    assert room[1] == 125 * 16 - 40 < len(other) and crowded == [False, True]
    assert (d.replica_id, d.pull_from) == ("b", None)  # waits at the holder
    d, room, crowded = route(dataclasses.replace(now, kv_usage=kv.usage))  # the pool's free count, as before
    assert room[1] == 250 * 16 - 40 and crowded is None
    assert (d.replica_id, d.reason, d.pull_from) == ("c", "pull", "b")
