"""A routed pull through the Serve application (``cluster/route_pull.py``): two replicas
of the tiny Llama; a decision naming ``pull_from`` has the chosen replica pull the
prompt's prefix from the other before running it. The output equals an undisturbed
run's, and a payload refused at import or a source killed mid-pull falls back to
recomputing, with the same output and no block left in use. The faults replace one
function of the real source engine (its export's copy), chosen by the prompt's first
token. Tests run in file order; the kill comes last."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest

from tests.cluster.conftest import tiny_engine, wait_until

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from kvroute.cluster.config import ClusterConfig  # noqa: E402
from kvroute.cluster.messages import ROUTER_NAMESPACE, FirstDelta, GenerateRequest, ReplicaCall  # noqa: E402
from kvroute.cluster.replica_deployment import build_engine_deployment  # noqa: E402
from kvroute.cluster.router_lookup import kill_router_actor  # noqa: E402
from kvroute.replica.block_hash import hash_blocks  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402
from kvroute.router.types import RouteDecision  # noqa: E402

APP = "kvtest-pull"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SLOW, TAMPER = 31_001, 31_002  # first prompt tokens whose export the source slows down / falsifies


def _prompt(first: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [first] + [rng.randrange(100, 30_000) for _ in range(399)]  # 50 full blocks of 8


async def faulty_engine(engine_config):
    """The model engine, whose export's copy sleeps 3 s for a prompt starting with
    ``SLOW`` and swaps two tokens of the header's second block for one starting with
    ``TAMPER`` (its hash no longer matches its tokens)."""
    from kvroute.cluster.replica_deployment import model_engine

    engine = await model_engine(engine_config, torch_threads=1)
    xfer = engine.engine.kv_transfer
    real = xfer.copy

    def copy(lease, on_device=False):
        payload = real(lease, on_device)
        first = lease.header.token_ids[0][0] if lease.header.token_ids else None
        if first == SLOW:
            time.sleep(3.0)
        if first == TAMPER:
            tokens = list(lease.header.token_ids)
            b = tokens[1]
            tokens[1] = (b[1], b[0], *b[2:])
            payload = dataclasses.replace(payload, header=dataclasses.replace(payload.header, token_ids=tuple(tokens)))
        return payload

    xfer.copy = copy
    return engine


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path):
    config = ClusterConfig(engine=tiny_engine(tiny_llama_path), app_name=APP, num_replicas=2, num_cpus_per_replica=1,
                           heartbeat_s=0.2, replica_timeout_s=3.0,
                           graceful_shutdown_timeout_s=10.0).with_random_hash_seed()  # fmt: skip
    serve.run(build_engine_deployment(config, engine_factory=faulty_engine), name=APP, route_prefix=None)
    router = ray.get_actor(config.router_actor_name, namespace=ROUTER_NAMESPACE)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 60, "both replicas registered")
    handle = serve.get_deployment_handle(config.deployment_name, app_name=APP)
    yield config, handle, sorted(ray.get(router.replicas.remote()))
    serve.delete(APP, _blocking=False)
    kill_router_actor(config.router_actor_name)


def _run(config, handle, prompt: list[int], route: RouteDecision) -> tuple[list[int], int, int]:
    """(output tokens, prompt tokens the replica found cached, tokens it pulled) of
    ``prompt`` sent with ``route`` (the request router keeps a decision it is given)."""
    request = GenerateRequest(f"r{time.monotonic_ns()}", prompt, GREEDY, hash_blocks(config.hash_spec, prompt))

    async def go():
        tokens, cached, pulled = [], 0, -1
        async for item in handle.options(stream=True).generate.remote(request, route=route):
            if isinstance(item, FirstDelta):
                assert item.outcome.served_by == route.replica_id
                pulled, item = item.outcome.pulled_tokens, item.delta
            tokens += item.token_ids
            cached = item.num_cached_tokens
        return tokens, cached, pulled

    return asyncio.run(go())


def _state(handle, rid: str) -> dict:
    return handle.debug_state.remote(ReplicaCall(rid)).result(timeout_s=30)


def _idle(handle, *rids: str) -> None:
    for rid in rids:
        wait_until(lambda: _state(handle, rid)["blocks_in_use"] == 0, 10, f"{rid} to hold no block")


def _source_and_reference(config, handle, src: str, dst: str, prompt: list[int]) -> list[int]:
    """``prompt``'s output computed (and cached) at ``src``; ``dst``'s cache emptied."""
    reference, cached, _ = _run(config, handle, prompt, RouteDecision(src, 0, "cold"))
    assert cached == 0 and len(reference) == 8
    assert handle.reset_prefix_cache.remote(ReplicaCall(dst)).result(timeout_s=30)["reset"]
    return reference


def _pull_route(dst: str, src: str) -> RouteDecision:
    return RouteDecision(dst, 399, "pull", pull_from=src, pull_tokens=400)


def test_a_routed_pull_serves_the_undisturbed_output(app):
    config, handle, (src, dst) = app
    prompt = _prompt(500, 1)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    tokens, cached, pulled = _run(config, handle, prompt, _pull_route(dst, src))
    assert tokens == reference
    assert pulled == 400 and cached == 392  # the whole prefix came over; the last block is computed again
    hashes = set(hash_blocks(config.hash_spec, prompt))
    assert hashes <= set(_state(handle, dst)["cached_block_hashes"])
    _idle(handle, src, dst)


def test_a_refused_payload_falls_back_to_recomputing(app):
    config, handle, (src, dst) = app
    prompt = _prompt(TAMPER, 2)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    tokens, cached, pulled = _run(config, handle, prompt, _pull_route(dst, src))
    assert (tokens, cached, pulled) == (reference, 0, 0)  # nothing imported: all recomputed, same output
    _idle(handle, src, dst)


def test_a_source_that_is_no_replica_falls_back(app):
    config, handle, (src, dst) = app
    prompt = _prompt(700, 3)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    tokens, cached, pulled = _run(config, handle, prompt, _pull_route(dst, "no-such-replica"))
    assert (tokens, cached, pulled) == (reference, 0, 0)
    _idle(handle, dst)


def test_a_request_that_follows_a_pull_waits_for_it_and_hits(app):
    """The router counts the puller as holding the prefix from its decision on, so the
    next request of that prefix goes there while the pull (3 s here) is still running:
    it waits for the pull and hits instead of recomputing beside it."""
    config, handle, (src, dst) = app
    prompt = _prompt(SLOW, 5)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    follower = threading.Timer(1.0, lambda: results.append(_run(config, handle, prompt, RouteDecision(dst, 392, "prefix"))))
    results: list = []
    follower.start()
    first = _run(config, handle, prompt, _pull_route(dst, src))
    follower.join()
    assert first == (reference, 392, 400)
    assert results == [(reference, 392, 0)]  # it waited: the pull's blocks, not its own prefill
    _idle(handle, src, dst)


def test_a_payload_handed_over_is_cached_and_hit(app):
    """A leaving replica's hand-off (``cluster/fleet_moves.py``): the KV exported by block
    hashes at one replica, passed as an argument to the other's ``import_kv``, is cached
    there whole, and the prompt then hits with the holder's output."""
    config, handle, (src, dst) = app
    prompt = _prompt(900, 6)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    hashes = hash_blocks(config.hash_spec, prompt)
    payload = handle.export_kv.remote(ReplicaCall(src), None, block_hashes=hashes).result(timeout_s=30)
    result = handle.import_kv.remote(ReplicaCall(dst), payload).result(timeout_s=30)
    assert (result.ok, result.blocks, result.nbytes) == (True, 50, payload.nbytes) and payload.nbytes > 0
    assert _run(config, handle, prompt, RouteDecision(dst, 392, "prefix")) == (reference, 392, 0)
    _idle(handle, src, dst)


def test_a_source_killed_mid_pull_falls_back(app):
    config, handle, (src, dst) = app
    prompt = _prompt(SLOW, 4)
    reference = _source_and_reference(config, handle, src, dst, prompt)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{config.deployment_name}#{src}", namespace="serve")
    killer = threading.Timer(1.0, lambda: ray.kill(actor, no_restart=True))  # inside the source's 3 s copy
    killer.start()
    start = time.monotonic()
    tokens, cached, pulled = _run(config, handle, prompt, _pull_route(dst, src))
    killer.join()
    assert (tokens, cached, pulled) == (reference, 0, 0)
    assert time.monotonic() - start < 10.0  # it did not wait out the pull's deadline
    _idle(handle, dst)
