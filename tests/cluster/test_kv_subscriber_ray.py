"""``KVEventSubscriber`` feeding real router actors on a local Ray cluster (the handles
the external-worker ingress passes): every router gets the worker registered with its
blocks, keeps it through quiet spells by heartbeats, re-registers it after a router
restart, and loses it when the subscriber stops."""

import time

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.router_actor import get_or_create_router_actors
from kvroute.cluster.router_lookup import kill_router_actors
from kvroute.replica.block_hash import hash_blocks
from kvroute.router import vllm_events as wire
from tests.cluster.conftest import ray, tiny_engine, wait_until

TOKENS = list(range(50, 82))  # 4 blocks of 8


def _holds(router):
    """The router's directory for the worker; None while it restarts or does not know it."""
    try:
        return ray.get(router.directory.remote("w0")) if "w0" in ray.get(router.replicas.remote()) else None
    except ray.exceptions.RayError:
        return None


def test_subscriber_feeds_every_router_actor(ray_cluster, tiny_llama_path):
    config = ClusterConfig(engine=tiny_engine(tiny_llama_path), app_name="kvsub", num_routers=2,
                           replica_timeout_s=1.5).with_random_hash_seed()  # fmt: skip
    spec = config.hash_spec
    routers = get_or_create_router_actors(config)
    sub = KVEventSubscriber("w0", "tcp://127.0.0.1:1", spec, routers, 64, heartbeat_s=0.3)
    try:
        stored = wire.block_stored([1, 2, 3, 4], None, TOKENS, 8)
        sub.ingest([b"", wire.encode_seq(0), wire.encode_batch(0.0, [stored])])
        expect = hash_blocks(spec, TOKENS)
        for r in routers:
            assert ray.get(r.directory.remote("w0")) == expect
        sub.ingest([b"", wire.encode_seq(1), wire.encode_batch(0.0, [wire.block_removed([4])])])
        for r in routers:
            assert ray.get(r.directory.remote("w0")) == expect[:3]
        sub.start()  # its heartbeats keep the worker past replica_timeout_s while nothing happens
        time.sleep(2.5)
        ray.get(routers[0].metrics.remote())  # expires silent replicas
        assert ray.get(routers[0].replicas.remote()) == ["w0"]
        for r in routers:  # a crash: the actor comes back empty; the next heartbeat registers again
            ray.kill(r, no_restart=False)
        for r in routers:
            wait_until(lambda: _holds(r) == expect[:3], 30, "re-registration")
    finally:
        sub.stop()
    for r in routers:
        assert ray.get(r.replicas.remote()) == []
    kill_router_actors("kvsub")
