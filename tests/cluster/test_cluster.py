"""The cluster on a real local Ray cluster: Serve replicas with tiny engines, the router
actor, the kvroute request router, the failover client. Tests run in file order and
share one two-replica application; the scaling test comes last because it changes it."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from tests.cluster.conftest import tiny_engine, wait_until

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from kvroute.cluster.client import KVRouteClient  # noqa: E402
from kvroute.cluster.config import ClusterConfig  # noqa: E402
from kvroute.cluster.messages import ROUTER_NAMESPACE, OverloadedError, ReplicaCall, ReplicaUnavailableError  # noqa: E402
from kvroute.cluster.replica_deployment import build_engine_deployment  # noqa: E402
from kvroute.cluster.router_lookup import kill_router_actor  # noqa: E402
from kvroute.replica.block_hash import hash_blocks  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402

APP = "kvtest"
PREFIX = list(range(1000, 1256))  # 256 tokens = 32 blocks of 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _config(model, **overrides) -> ClusterConfig:
    kwargs = dict(
        engine=tiny_engine(model),
        app_name=APP,
        num_replicas=2,
        num_cpus_per_replica=1,
        heartbeat_s=0.2,
        replica_timeout_s=3.0,
        graceful_shutdown_timeout_s=10.0,
    )
    kwargs.update(overrides)
    return ClusterConfig(**kwargs)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path):
    config = _config(tiny_llama_path).with_random_hash_seed()
    serve.run(build_engine_deployment(config), name=APP, route_prefix=None)
    router = ray.get_actor(config.router_actor_name, namespace=ROUTER_NAMESPACE)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 30, "both replicas registered")
    yield config, router
    serve.delete(APP, _blocking=False)  # no wait for the replicas' graceful shutdown (see end_serve_app)
    kill_router_actor(config.router_actor_name)


def _client(config: ClusterConfig) -> KVRouteClient:
    return KVRouteClient.for_app(config, retry_backoff_s=0.2)


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _settle(router, config, timeout_s: float = 30.0) -> dict[str, dict]:
    """Wait until every replica is idle and the directory equals the union of their caches."""
    why = ["nothing checked yet"]

    def check():
        client = _client(config)
        try:  # a replica that just started may not be routable from this handle yet
            states = {rid: asyncio.run(client.debug_state(rid, 5.0)) for rid in ray.get(router.replicas.remote())}
        except ReplicaUnavailableError as exc:
            why[0] = repr(exc)
            return None
        busy = {rid: (s["num_running"], s["num_waiting"]) for rid, s in states.items() if s["num_running"] or s["num_waiting"]}
        if busy:
            why[0] = f"busy replicas {busy}"
            return None
        for rid, s in states.items():
            held = set(ray.get(router.directory.remote(rid)))
            cached = set(s["cached_block_hashes"])
            if held != cached:
                why[0] = f"{rid}: directory has {len(held - cached)} extra, misses {len(cached - held)}"
                return None
        return states

    try:
        return wait_until(check, timeout_s, "the directory to match the replicas' caches", interval_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last: {why[0]}") from None


def test_shared_prefix_lands_on_its_holder_and_unrelated_requests_spread(app):
    config, router = app
    client = _client(config)
    before = ray.get(router.stats.remote())["decisions_by_replica"]

    async def go():
        first = await client.complete(PREFIX + [7], GREEDY)
        rest = [await client.complete(PREFIX + [8 + i, 9], GREEDY) for i in range(5)]
        return first, rest

    first, rest = asyncio.run(go())
    assert first[-1].num_cached_tokens == 0
    # Every follow-up is served where the 256-token prefix lives: all of it is cached.
    assert [r[-1].num_cached_tokens for r in rest] == [len(PREFIX)] * 5
    states = _settle(router, config)
    holders = [rid for rid, s in states.items() if set(hash_blocks(config.hash_spec, PREFIX)) <= set(s["cached_block_hashes"])]
    # one holder, unless the router moved the prefix instead of waiting at a busy holder (a
    # pull: its KV copied, not recomputed, as every follow-up's full cache hit says)
    pulls = ray.get(router.stats.remote())["decisions_by_reason"].get("pull", 0)
    assert len(holders) == 1 + min(pulls, 1), (holders, pulls)
    # The holder got the router's tickets with its requests and reports them back, so the
    # router drops its optimistic increments with the next report, not at their TTL
    assert states[holders[0]]["route_ticket"] > 0
    wait_until(
        lambda: not any(ray.get(router.stats.remote())["in_flight_by_replica"].values()),
        min(2.0, config.heartbeat_s * 3),
        "the replicas' reports to count every request routed to them",
    )

    async def unrelated():
        return await asyncio.gather(
            *(client.complete([3000 + 100 * i + j for j in range(64)], GREEDY) for i in range(8))
        )

    outs = asyncio.run(unrelated())
    assert all(o[-1].finish_reason == "length" for o in outs)
    after = ray.get(router.stats.remote())["decisions_by_replica"]
    spread = {rid: after.get(rid, 0) - before.get(rid, 0) for rid in after}
    assert sum(spread.values()) == 14
    assert min(spread.values()) >= 3, spread  # new prefixes go to both replicas


def test_directory_equals_union_of_replica_caches(app):
    config, router = app
    client = _client(config)

    async def load():
        prompts = [PREFIX[: 64 + 16 * (i % 5)] + [5000 + i] * (i % 7 + 1) for i in range(24)]
        return await asyncio.gather(*(client.complete(p, GREEDY) for p in prompts))

    asyncio.run(load())
    states = _settle(router, config)
    assert len(states) == 2
    union = set().union(*(set(s["cached_block_hashes"]) for s in states.values()))
    directory = set().union(*(set(ray.get(router.directory.remote(rid))) for rid in states))
    assert directory == union and union


def test_cancelled_stream_frees_its_blocks(app):
    config, router = app
    client = _client(config)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def go():
        got = 0
        stream = client.generate(list(range(9000, 9040)), params)
        async for delta in stream:
            got += len(delta.token_ids)
            if got >= 3:
                break
        await stream.aclose()
        return got

    assert asyncio.run(go()) >= 3
    states = _settle(router, config)
    for s in states.values():
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0, s


def test_a_replica_pulls_a_prefix_from_the_replica_holding_it(app):
    """``EngineReplica.pull_kv`` fetches the holder's ``export_kv`` through the
    application's handle: the destination then caches the prefix and the routers hear of
    it; a source that is no replica is a fallback."""
    config, router = app
    client = _client(config)
    prompt = list(range(20000, 20160))  # 20 blocks of 8
    asyncio.run(client.complete(prompt, GREEDY))
    states = _settle(router, config)
    hashes = set(hash_blocks(config.hash_spec, prompt))
    (src,) = [rid for rid, s in states.items() if hashes <= set(s["cached_block_hashes"])]
    (dst,) = [rid for rid in states if rid != src]
    handle = serve.get_deployment_handle(config.deployment_name, app_name=config.app_name)
    result = handle.pull_kv.remote(ReplicaCall(dst), src, prompt).result(timeout_s=60)
    assert result.ok and (result.blocks, result.tokens) == (20, 160) and result.nbytes > 0, result
    missing = handle.pull_kv.remote(ReplicaCall(dst), "no-such-replica", prompt).result(timeout_s=60)
    assert missing.fallback == "source_failed", missing
    states = _settle(router, config)  # the directory holds the pulled blocks at dst too
    assert hashes <= set(states[dst]["cached_block_hashes"]) and states[dst]["blocks_in_use"] == 0
    assert states[src]["blocks_in_use"] == 0


def test_bad_request_is_a_value_error_and_harms_nothing(app):
    config, router = app
    client = _client(config)
    with pytest.raises(ValueError, match="max_model_len=512"):
        asyncio.run(client.complete(list(range(100, 600)), SamplingParams(max_tokens=50)))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        asyncio.run(client.complete([], GREEDY))
    assert asyncio.run(client.complete([1, 2, 3], GREEDY))[-1].finish_reason is not None


def _leading_hits(config: ClusterConfig, prompt: list[int], cached) -> int:
    """How many of ``prompt``'s leading blocks ``cached`` holds."""
    cached, n = set(cached), 0
    for h in hash_blocks(config.hash_spec, prompt):
        if h not in cached:
            break
        n += 1
    return n


def _replica_actor(config: ClusterConfig, unique_id: str):
    return ray.get_actor(f"SERVE_REPLICA::{config.app_name}#{config.deployment_name}#{unique_id}", namespace="serve")


def test_killing_a_replica_mid_stream_loses_no_request(app):
    config, router = app
    client = _client(config)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=120, ignore_eos=True)
    prompts = [[4000 + 37 * i + j for j in range(24 + i)] for i in range(20)]
    plist = [params if i % 2 else seeded for i in range(20)]

    async def run_all(on_progress=None):
        progress = [0] * 20

        async def one(i):
            deltas = []
            async for d in client.generate(prompts[i], plist[i]):
                deltas.append(d)
                progress[i] += len(d.token_ids)
                if on_progress is not None:
                    await on_progress(progress)
            return deltas

        return await asyncio.gather(*(one(i) for i in range(20)))

    reference = [(_tokens(o), "".join(d.text for d in o)) for o in asyncio.run(run_all())]
    victims = ray.get(router.replicas.remote())
    victim = victims[0]
    killed_at: list[float] = []
    left_at: list[float] = []

    def watch_the_directory():  # timed apart from the streams, whose pace a loaded box sets
        while victim in ray.get(router.replicas.remote()) and time.monotonic() - killed_at[0] < 120:
            time.sleep(0.1)
        left_at.append(time.monotonic())

    async def kill_when_all_streaming(progress):
        if not killed_at and min(progress) >= 1:
            ray.kill(_replica_actor(config, victim), no_restart=True)
            killed_at.append(time.monotonic())
            threading.Thread(target=watch_the_directory, daemon=True).start()

    outs = asyncio.run(run_all(kill_when_all_streaming))
    assert killed_at, "the replica was never killed"
    assert [(_tokens(o), "".join(d.text for d in o)) for o in outs] == reference
    assert all(o[-1].finish_reason == "length" for o in outs)
    assert client.stats["resumes"] >= 1
    wait_until(lambda: bool(left_at), 130, "the directory watch to end")
    # it leaves on Serve's death notice or, at the latest, after replica_timeout_s without a heartbeat
    assert left_at[0] - killed_at[0] < config.replica_timeout_s + 10
    # Serve replaces the replica, and the new one registers with the router.
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 2, 60, "Serve to bring the replica count back")
    _settle(router, config)


def test_killing_the_router_actor_fails_no_request_and_it_rebuilds(app):
    config, router = app
    client = _client(config)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    asyncio.run(client.complete(PREFIX + [1], GREEDY))  # the prefix lives somewhere
    registrations = ray.get(router.stats.remote())["registrations"]

    async def load():
        tasks = [asyncio.create_task(client.complete([6000 + i] * 30, params)) for i in range(10)]
        await asyncio.sleep(0.3)
        ray.kill(router, no_restart=False)  # it restarts empty
        more = [asyncio.create_task(client.complete([6100 + i] * 30, params)) for i in range(10)]
        return await asyncio.gather(*tasks, *more)

    outs = asyncio.run(load())
    assert all(o[-1].finish_reason == "length" and len(_tokens(o)) == 60 for o in outs)
    stats = wait_until(
        lambda: (s := ray.get(router.stats.remote()))["replicas"] == 2 and s,
        30,
        "the restarted router to hear from both replicas",
    )
    assert stats["uptime_s"] < 60 and stats["registrations"] >= 2 and registrations >= 2
    states = _settle(router, config)  # the rebuilt directory is exact
    # the load may have evicted part of the prefix where it landed: the longest holder wins
    held = [_leading_hits(config, PREFIX, s["cached_block_hashes"]) for s in states.values()]
    out = asyncio.run(client.complete(PREFIX + [2], GREEDY))
    assert out[-1].num_cached_tokens == max(held) * config.engine.block_size > 0  # prefix routing resumed


def test_overload_is_a_prompt_error_and_the_rest_complete(ray_cluster, tiny_llama_path):
    name = "kvtest-overload"
    config = _config(
        tiny_llama_path, app_name=name, num_replicas=1, max_ongoing_requests=2, max_queued_requests=2
    ).with_random_hash_seed()
    serve.run(build_engine_deployment(config), name=name, route_prefix=None)
    client = _client(config)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def go():
        async def one(i):
            t0 = time.monotonic()
            try:
                out = await client.complete([7000 + i] * 20, params)
                return "ok", len(_tokens(out)), time.monotonic() - t0
            except OverloadedError as exc:
                assert exc.retry_after_s > 0
                return "overloaded", 0, time.monotonic() - t0

        return await asyncio.gather(*(one(i) for i in range(10)))

    try:
        results = asyncio.run(go())
    finally:
        serve.delete(name, _blocking=False)
        kill_router_actor(config.router_actor_name)
    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] == "overloaded"]
    assert len(ok) >= 2 and all(r[1] == 200 for r in ok)
    assert len(rejected) >= 4
    slowest_ok = max(r[2] for r in ok)
    assert max(r[2] for r in rejected) < slowest_ok  # rejected before the admitted ones finish


def test_two_active_routers_share_one_view_and_a_dead_one_fails_over(ray_cluster, tiny_llama_path):
    """num_routers=2: both routers hold every replica and the exact directory; a
    decision made by one reaches the other; killing the router this process asks first
    mid-load fails no request and sends none to power of two (the other router ranks
    every later one), and prefix routing goes on there."""
    from kvroute.cluster.router_lookup import kill_router_actors

    name = "kvtest-routers"
    config = _config(tiny_llama_path, app_name=name, num_routers=2).with_random_hash_seed()
    serve.run(build_engine_deployment(config), name=name, route_prefix=None)
    try:
        routers = [ray.get_actor(n, namespace=ROUTER_NAMESPACE) for n in config.router_actor_names]
        for r in routers:
            wait_until(lambda r=r: len(ray.get(r.replicas.remote())) == 2, 30, "both replicas registered with each router")
        client = _client(config)
        asyncio.run(client.complete(PREFIX + [1], GREEDY))  # the prefix lives somewhere
        for r in routers:
            _settle(r, config)  # each router's directory is exact
        decided = [ray.get(r.stats.remote()) for r in routers]
        assert sum(s["decisions"] for s in decided) >= 1 and sum(s["peer_decisions"] for s in decided) >= 1
        mine = next(i for i, s in enumerate(decided) if s["decisions"])  # the router this process asks first
        assert mine == 0 and decided[1]["decisions"] == 0  # every process asks the first router first
        # the second stands by: the replicas fold their changes and heartbeats for it
        # (replica_timeout_s / 4 = 0.75 s) where the first hears every heartbeat (0.2 s)
        pushes = [ray.get(r.stats.remote())["pushes"] for r in routers]
        time.sleep(3.0)
        pushes = [ray.get(r.stats.remote())["pushes"] - p for r, p in zip(routers, pushes)]
        assert pushes[0] >= 2 * pushes[1] > 0, pushes
        other = routers[1 - mine]
        before = ray.get(other.stats.remote())["decisions"]
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

        def dead() -> bool:
            try:
                ray.get(routers[mine].replicas.remote(), timeout=2)
            except ray.exceptions.RayActorError:
                return True
            return False

        async def load():
            tasks = [asyncio.create_task(client.complete([6000 + i] * 30, params)) for i in range(6)]
            await asyncio.sleep(0.2)
            ray.kill(routers[mine], no_restart=True)
            await asyncio.to_thread(wait_until, dead, 10, "the killed router to be dead")
            more = [asyncio.create_task(client.complete([6100 + i] * 30, params)) for i in range(6)]
            return await asyncio.gather(*tasks, *more)

        outs = asyncio.run(load())
        assert all(o[-1].finish_reason == "length" and len(_tokens(o)) == 30 for o in outs)
        # every request sent after the kill was ranked by the other router (none by power of two)
        assert ray.get(other.stats.remote())["decisions"] >= before + 6
        out = asyncio.run(client.complete(PREFIX + [2], GREEDY))
        assert out[-1].num_cached_tokens == len(PREFIX)  # the surviving router routes by prefix
    finally:
        serve.delete(name, _blocking=False)
        kill_router_actors(name)


def test_scaling_up_registers_and_down_drains_and_purges(app, tiny_llama_path):
    config, router = app
    client = _client(config)
    up = _config(tiny_llama_path, num_replicas=3, engine=config.engine)
    serve.run(build_engine_deployment(up), name=APP, route_prefix=None)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 3, 60, "the third replica to register")

    async def traffic():
        return await asyncio.gather(*(client.complete([8000 + 50 * i + j for j in range(40)], GREEDY) for i in range(12)))

    before = ray.get(router.stats.remote())["decisions_by_replica"]
    asyncio.run(traffic())
    after = ray.get(router.stats.remote())["decisions_by_replica"]
    served = {rid for rid in ray.get(router.replicas.remote()) if after.get(rid, 0) > before.get(rid, 0)}
    assert len(served) == 3  # the new replica receives traffic

    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    down = _config(tiny_llama_path, num_replicas=1, engine=config.engine)

    async def drain():
        inflight = [asyncio.create_task(client.complete([8500 + i] * 30, params)) for i in range(6)]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(serve.run, build_engine_deployment(down), name=APP, route_prefix=None)
        return await asyncio.gather(*inflight)

    outs = asyncio.run(drain())
    assert all(len(_tokens(o)) == 80 for o in outs)  # in-flight requests finished
    wait_until(lambda: len(ray.get(router.replicas.remote())) == 1, 30, "removed replicas to leave the directory")
    assert len(_settle(router, config)) == 1


def test_an_injected_engine_factory_builds_the_replicas_engine(ray_cluster, tiny_llama_path):
    """``build_engine_deployment(config, engine_factory=...)``: the replica runs whatever
    engine the factory builds (here the model engine with 48 KV blocks instead of the
    config's) and registers, routes and serves through it as usual."""
    from kvroute.cluster.replica_deployment import model_engine

    async def small_cache_engine(engine_config):  # nested: Ray pickles it by value
        return await model_engine(dataclasses.replace(engine_config, num_kv_blocks=48), torch_threads=1)

    name = "kvtest-factory"
    config = _config(tiny_llama_path, app_name=name, num_replicas=1).with_random_hash_seed()
    assert config.engine.num_kv_blocks != 48
    serve.run(build_engine_deployment(config, engine_factory=small_cache_engine), name=name, route_prefix=None)
    try:
        client = _client(config)
        out = asyncio.run(client.complete(PREFIX[:40], GREEDY))
        assert len(_tokens(out)) == 8
        router = ray.get_actor(config.router_actor_name, namespace=ROUTER_NAMESPACE)
        (rid,) = ray.get(router.replicas.remote())
        state = asyncio.run(client.debug_state(rid))
        assert state["num_kv_blocks"] == 48 and state["blocks_in_use"] == 0
        assert state["cached_block_hashes"] and state["registrations"] >= 1
    finally:
        serve.delete(name, _blocking=False)
        kill_router_actor(config.router_actor_name)
