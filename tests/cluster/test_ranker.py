"""The kvroute request router's logic without Ray or Serve: a ``Ranker`` asking a real
``RouterService`` (the router actor's state), driven the way Serve drives the
``KVRouteRequestRouter``: rank, maybe rank again, then ``routed``."""

import asyncio

from kvroute.cluster.messages import GenerateRequest, RouteTrace
from kvroute.cluster.ranker import Ranker
from kvroute.cluster.router_actor import RouterService
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.sampling_params import SamplingParams

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


def ranker_over(svc: RouterService, fail: list[BaseException] | None = None) -> tuple[Ranker, list[int], list[BaseException]]:
    asked: list[int] = []
    seen: list[BaseException] = []

    async def ask(req: GenerateRequest, candidates: list[str]):
        asked.append(len(candidates))
        if fail:
            raise fail[0]
        return svc.rank(req.block_hashes, req.num_tokens, candidates)

    return Ranker(ask, seen.append), asked, seen


def test_the_decision_is_written_once_and_a_reroute_reuses_it():
    svc = service()
    ranker, asked, _ = ranker_over(svc)
    req = request()
    order = asyncio.run(ranker.order("k1", req, ["a", "b"]))
    assert order == ["b", "a"]
    decision = req.route
    assert (decision.replica_id, decision.expected_cached_tokens, decision.reason) == ("b", 5 * 16, "prefix")
    assert decision.ticket > 0
    # Serve routes the same request again (b was full): the ranking is reused, not asked
    assert asyncio.run(ranker.order("k1", req, ["a", "b"])) == ["b", "a"]
    assert asked == [2] and ranker.stats == {"ranked": 1, "fallbacks": 0, "reused_rankings": 1}
    assert req.route is decision
    # Serve sent it to a: the trace says so, without b's prediction
    ranker.routed("k1", req, "a")
    assert req.served_by == "a"
    assert req.route.served(req.served_by) == RouteTrace("a", None, "next_ranked", decision.ticket)
    # the ranking is forgotten once routed: the same key asks again
    asyncio.run(ranker.order("k1", req, ["a", "b"]))
    assert asked == [2, 2]


def test_served_by_the_choice_keeps_the_prediction_and_a_resume_drops_it():
    ranker, _, _ = ranker_over(service())
    req = request()
    asyncio.run(ranker.order("k", req, ["a", "b"]))
    ranker.routed("k", req, "b")
    assert req.route.served("b") == RouteTrace("b", 80, "prefix", req.route.ticket, available_tokens=80)
    assert req.route.served("a", resumed=True) == RouteTrace("a", None, "resumed", req.route.ticket)


def test_a_failing_router_means_fallback_and_candidates_gone_mean_fallback():
    boom = TimeoutError("router actor too slow")
    ranker, _, seen = ranker_over(service(), fail=[boom])
    req = request()
    assert asyncio.run(ranker.order("k", req, ["a", "b"])) is None
    assert req.route == RouteTrace(reason="fallback") and seen == [boom]
    assert ranker.stats["fallbacks"] == 1
    # a ranking whose replicas all left the candidate list: fall back too
    ranker2, _, _ = ranker_over(service())
    req2 = request("q2")
    asyncio.run(ranker2.order("k2", req2, ["a", "b"]))
    assert asyncio.run(ranker2.order("k2", req2, ["c"])) is None


def test_remembered_rankings_are_bounded():
    svc = service()
    asked: list[str] = []

    async def ask(req, candidates):
        asked.append(req.request_id)
        return svc.rank(req.block_hashes, req.num_tokens, candidates)

    ranker = Ranker(ask, max_remembered=2)
    for i in range(3):
        asyncio.run(ranker.order(f"k{i}", request(f"q{i}"), ["a", "b"]))
    asyncio.run(ranker.order("k0", request("q0"), ["a", "b"]))  # k0 was dropped: asked again
    asyncio.run(ranker.order("k2", request("q2"), ["a", "b"]))  # k2 kept: reused
    assert asked == ["q0", "q1", "q2", "q0"]
