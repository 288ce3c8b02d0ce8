"""The kvroute request router's logic without Ray or Serve: a ``Ranker`` asking real
``RouterService``s (the router actors' state) in ``RouterChoice``'s order, driven the
way Serve drives the ``KVRouteRequestRouter``: rank a call, maybe rank it again; the
replica then reports where it ran (``RouteOutcome``)."""

import asyncio

from kvroute.cluster.messages import ROUTE_ARG, GenerateRequest
from kvroute.cluster.ranker import Ranker
from kvroute.cluster.router_actor import RouterService
from kvroute.cluster.router_choice import RouterChoice
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.sampling_params import SamplingParams
from kvroute.router.types import RouteOutcome

SPEC = HashSpec(16)
PROMPT = list(range(16 * 8 + 3))  # 8 full blocks
HASHES = hash_blocks(SPEC, PROMPT)


def request(rid: str = "q") -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=4), HASHES)


def service() -> RouterService:
    svc = RouterService(SPEC)
    svc.register("a", SPEC, 100, [], 0)
    svc.register("b", SPEC, 100, HASHES[:5], 0)  # b holds 5 of the 8 blocks
    return svc


def ranker_over(*routers: RouterService | BaseException) -> tuple[Ranker, list[int], list[BaseException]]:
    """A ranker over these routers, in order (an exception: a router that fails with it)."""
    asked: list[int] = []
    seen: list[BaseException] = []

    async def ask(i: int, req: GenerateRequest, candidates: list[str]):
        asked.append(len(candidates))
        if isinstance(routers[i], BaseException):
            raise routers[i]
        return routers[i].rank(req.block_hashes, req.num_tokens, candidates)

    return Ranker(RouterChoice(len(routers)), ask, seen.append), asked, seen


def test_the_decision_goes_with_the_call_and_a_reroute_reuses_it():
    ranker, asked, _ = ranker_over(service())
    call: dict = {}
    order = asyncio.run(ranker.order(call, request(), ["a", "b"]))
    assert order == ["b", "a"]
    decision = call[ROUTE_ARG]  # what the replica receives as its `route` argument
    assert (decision.replica_id, decision.expected_cached_tokens, decision.reason) == ("b", 5 * 16, "prefix")
    assert decision.ticket > 0 and decision.order == ["b", "a"]
    # Serve routes the same call again (b was full): its decision is reused, not asked
    assert asyncio.run(ranker.order(call, request(), ["a", "b"])) == ["b", "a"]
    assert asked == [2] and ranker.stats == {"ranked": 1, "fallbacks": 0, "reused_rankings": 1, "decided_here": 0}
    assert call[ROUTE_ARG] is decision
    # Serve sent it to a: the outcome says so, without b's prediction
    outcome = RouteOutcome("a", decision)
    assert (outcome.reason, outcome.expected_cached_tokens, outcome.ticket) == ("next_ranked", None, decision.ticket)
    assert not outcome.predicted
    # another call (a resume, the next request) is decided afresh
    asyncio.run(ranker.order({}, request(), ["a", "b"]))
    assert asked == [2, 2]


def test_served_by_the_choice_keeps_the_prediction_and_a_resume_drops_it():
    ranker, _, _ = ranker_over(service())
    call: dict = {}
    asyncio.run(ranker.order(call, request(), ["a", "b"]))
    decision = call[ROUTE_ARG]
    there = RouteOutcome("b", decision)
    assert there.predicted and (there.reason, there.expected_cached_tokens, there.available_tokens) == ("prefix", 80, 80)
    resumed = RouteOutcome("a", decision, resumed=True)
    assert (resumed.reason, resumed.expected_cached_tokens, resumed.ticket) == ("resumed", None, decision.ticket)
    assert RouteOutcome("b", None).reason is None and RouteOutcome().expected_cached_tokens is None


def test_a_failing_router_means_fallback_and_candidates_gone_mean_fallback():
    boom = TimeoutError("router actor too slow")
    ranker, asked, seen = ranker_over(boom)
    call: dict = {}
    assert asyncio.run(ranker.order(call, request(), ["a", "b"])) is None
    fallback = call[ROUTE_ARG]
    assert (fallback.replica_id, fallback.reason, fallback.ticket) == (None, "fallback", 0) and seen == [boom]
    assert ranker.stats["fallbacks"] == 1
    outcome = RouteOutcome("a", fallback)
    assert (outcome.reason, outcome.expected_cached_tokens) == ("fallback", None)
    # routed again, a call that holds a fallback asks again
    assert asyncio.run(ranker.order(call, request(), ["a", "b"])) is None and asked == [2, 2]
    # a decision whose replicas all left the candidate list: fall back too
    ranker2, _, _ = ranker_over(service())
    call2: dict = {}
    asyncio.run(ranker2.order(call2, request("q2"), ["a", "b"]))
    assert asyncio.run(ranker2.order(call2, request("q2"), ["c"])) is None


def test_a_decision_says_which_routers_it_went_past():
    """The caller counts failovers and fallbacks from its decisions: a router that
    failed before another answered is one failover, every router failing a fallback."""
    ranker, _, _ = ranker_over(TimeoutError("router 0 down"), service())
    call: dict = {}
    assert asyncio.run(ranker.order(call, request(), ["a", "b"])) == ["b", "a"]
    assert (call[ROUTE_ARG].failovers, call[ROUTE_ARG].spills, call[ROUTE_ARG].reason) == (1, 0, "prefix")
    # router 0 is now skipped (down): the next call asks router 1 at once, no failover
    again: dict = {}
    asyncio.run(ranker.order(again, request(), ["a", "b"]))
    assert again[ROUTE_ARG].failovers == 0
    none, _, _ = ranker_over(TimeoutError("0"), TimeoutError("1"))
    lost: dict = {}
    assert asyncio.run(none.order(lost, request(), ["a", "b"])) is None
    assert (lost[ROUTE_ARG].reason, lost[ROUTE_ARG].failovers) == ("fallback", 1)


def test_a_router_in_this_process_decides_first_and_the_actors_only_when_it_cannot():
    from kvroute.cluster.router_follow import RouterFollower

    actor = service()
    ranker, asked, _ = ranker_over(actor)
    follower = RouterFollower()
    call: dict = {}
    # not synced yet: the router actor answers
    assert asyncio.run(ranker.order(call, request(), ["a", "b"], follower.rank)) == ["b", "a"]
    assert asked == [2] and ranker.stats["decided_here"] == 0
    follower.apply(actor.follow(*follower.request()))
    call = {}
    assert asyncio.run(ranker.order(call, request(), ["a", "b"], follower.rank)) == ["b", "a"]
    assert asked == [2] and ranker.stats == {"ranked": 1, "fallbacks": 0, "reused_rankings": 0, "decided_here": 1}
    assert (call[ROUTE_ARG].replica_id, call[ROUTE_ARG].expected_cached_tokens) == ("b", 5 * 16)
