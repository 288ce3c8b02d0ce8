"""The fleet's changes through the Serve application (``cluster/fleet_moves.py``), with
emulated engines on the tiny Llama's config: a replica that joins pulls the fleet's hot
prefixes before it serves, so its first request on one hits; one that leaves on a
scale-down hands the hot prefixes only it holds to the survivor; a warm-up whose source
dies mid-export falls back, the new replica starts anyway and holds no block. The
source's export sleeps 5 s for a prefix whose first token is ``SLOW``. Tests run in file
order, on one application scaled 1 -> 2 -> 1 -> 2; the kill comes last."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from tests.cluster.conftest import tiny_engine, wait_until

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from kvroute.cluster.config import ClusterConfig  # noqa: E402
from kvroute.cluster.messages import ROUTER_NAMESPACE, FirstDelta, GenerateRequest, ReplicaCall  # noqa: E402
from kvroute.cluster.replica_deployment import build_engine_deployment, replica_version  # noqa: E402
from kvroute.cluster.router_lookup import kill_router_actor  # noqa: E402
from kvroute.replica.block_hash import hash_blocks  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402
from kvroute.router.types import RouteDecision  # noqa: E402

APP = "kvtest-fleet"
SLOW = 31_001
SLOW_EXPORT_S = 5.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


async def slow_export_engine(engine_config):
    from kvroute.cluster.replica_deployment import model_engine

    engine = await model_engine(engine_config)
    xfer = engine.engine.kv_transfer
    real = xfer.copy

    def copy(lease, on_device=False):
        if lease.header.token_ids and lease.header.token_ids[0][0] == SLOW:
            time.sleep(SLOW_EXPORT_S)
        return real(lease, on_device)

    xfer.copy = copy
    return engine


def _deploy(config: ClusterConfig, replicas: int, blocking: bool = True) -> None:
    config = dataclasses.replace(config, num_replicas=replicas)
    app = build_engine_deployment(config, version=replica_version(config), engine_factory=slow_export_engine)
    serve._run(app, name=APP, route_prefix=None, _blocking=blocking)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path):
    engine = tiny_engine(tiny_llama_path, emulate="gpu_h100_llama3_8b")
    config = ClusterConfig(engine=engine, app_name=APP, num_replicas=1, num_cpus_per_replica=0.5, heartbeat_s=0.2,
                           replica_timeout_s=3.0, graceful_shutdown_timeout_s=10.0).with_random_hash_seed()  # fmt: skip
    _deploy(config, 1)
    router = ray.get_actor(config.router_actor_name, namespace=ROUTER_NAMESPACE)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 1, 60, "the replica registered")
    handle = serve.get_deployment_handle(config.deployment_name, app_name=APP)
    yield config, handle, router
    serve.delete(APP, _blocking=False)
    kill_router_actor(config.router_actor_name)


def _prompt(first: int, seed: int, shared: int = 160, own: int = 40) -> list[int]:
    """``shared`` tokens that depend on (first, seed) only, then ``own`` fresh ones."""
    rng = random.Random(seed)
    fresh = random.Random(time.monotonic_ns())
    return [first] + [rng.randrange(100, 30_000) for _ in range(shared - 1)] + [fresh.randrange(100, 30_000) for _ in range(own)]


def _run(config, handle, prompt: list[int], route: RouteDecision | None = None) -> tuple[str, int]:
    """(the replica that served ``prompt``, the prompt tokens it found cached)."""
    request = GenerateRequest(f"r{time.monotonic_ns()}", prompt, PARAMS, hash_blocks(config.hash_spec, prompt))

    async def go():
        served, cached = "", 0
        async for item in handle.options(stream=True).generate.remote(request, route=route):
            if isinstance(item, FirstDelta):
                served, item = item.outcome.served_by, item.delta
            cached = item.num_cached_tokens
        return served, cached

    return asyncio.run(go())


def _hot_on(config, handle, router, rid: str, first: int, seed: int, hits: int = 3) -> list:
    """Make a prefix hot at the router and cached on ``rid`` only: the router decides
    ``hits`` times with ``rid`` the only candidate, and each request runs there."""
    for _ in range(hits):
        prompt = _prompt(first, seed)
        hashes = hash_blocks(config.hash_spec, prompt)
        ray.get(router.rank.remote(hashes, len(prompt), [rid]))
        _run(config, handle, prompt, RouteDecision(rid, 0, "test"))
    return hash_blocks(config.hash_spec, _prompt(first, seed))[:20]  # the 160 shared tokens' blocks


def _state(handle, rid: str) -> dict:
    return handle.debug_state.remote(ReplicaCall(rid)).result(timeout_s=30)


def _running(handle, rid: str) -> bool:
    try:
        return bool(_state(handle, rid))
    except Exception:  # not a running replica yet
        return False


def _replicas(router) -> list[str]:
    return sorted(ray.get(router.replicas.remote()))


def _holds(handle, rid: str, hashes: list) -> bool:
    return set(hashes) <= set(_state(handle, rid)["cached_block_hashes"])


def test_a_joining_replica_warms_up_with_the_hot_prefixes(app):
    config, handle, router = app
    (old,) = _replicas(router)
    for _ in range(3):  # routed by the router: one replica
        assert _run(config, handle, _prompt(500, 1))[0] == old
    hot = hash_blocks(config.hash_spec, _prompt(500, 1))[:20]
    _deploy(config, 2)
    wait_until(lambda: len(_replicas(router)) == 2, 30, "the new replica registered")
    (new,) = set(_replicas(router)) - {old}
    state = _state(handle, new)
    assert set(hot) <= set(state["cached_block_hashes"])  # before any request came
    assert state["kv_transfer"]["warmup_prefixes"] == 1 and state["kv_transfer"]["warmup_blocks"] >= 20
    served, cached = _run(config, handle, _prompt(500, 1), RouteDecision(new, 0, "test"))
    assert (served, cached) == (new, 160)  # its first request on the hot prefix hits
    assert state["blocks_in_use"] == 0


def test_a_leaving_replica_hands_its_hot_prefixes_to_the_survivor(app):
    config, handle, router = app
    a, b = _replicas(router)
    on_a, on_b = _hot_on(config, handle, router, a, 600, 2), _hot_on(config, handle, router, b, 700, 3)
    assert not _holds(handle, a, on_b) and not _holds(handle, b, on_a)
    _deploy(config, 1)
    wait_until(lambda: len(_replicas(router)) == 1, 30, "the leaving replica unregistered")
    (survivor,) = _replicas(router)
    wait_until(lambda: _holds(handle, survivor, on_a + on_b), 10, "the survivor to hold both hot prefixes")
    assert _run(config, handle, _prompt(600, 2))[1] == 160 and _run(config, handle, _prompt(700, 3))[1] == 160
    assert _state(handle, survivor)["blocks_in_use"] == 0
    assert ray.get(router.stats.remote())["handoff_moves"] >= 1


def test_a_warmup_whose_source_dies_falls_back(app):
    config, handle, router = app
    (source,) = _replicas(router)
    slow = _hot_on(config, handle, router, source, SLOW, 4)
    plans = ray.get(router.stats.remote())["warmup_plans"]
    _deploy(config, 2, blocking=False)
    wait_until(lambda: ray.get(router.stats.remote())["warmup_plans"] > plans, 30, "the new replica's warm-up")
    (new,) = set(_replicas(router)) - {source}  # registered before it asked for its plan
    # kill inside the slow prefix's export, once another hot prefix reached the new replica
    # (its KV events show it in the directory)
    wait_until(lambda: ray.get(router.directory.remote(new)), SLOW_EXPORT_S - 1.5, "a hot prefix on the new replica")
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{config.deployment_name}#{source}", namespace="serve")
    ray.kill(actor, no_restart=True)
    wait_until(lambda: _running(handle, new), 30, "the new replica to serve")
    state = _state(handle, new)
    assert state["kv_transfer"]["warmup_skipped"] == 1  # the slow prefix only
    assert state["kv_transfer"]["pull_fallbacks"].get("source_failed", 0) >= 1
    assert state["kv_transfer"]["warmup_prefixes"] >= 1  # the other hot prefixes came
    assert not set(slow) & set(state["cached_block_hashes"]) and state["blocks_in_use"] == 0
