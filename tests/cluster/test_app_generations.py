"""An application's detached actors across redeploys (ARCHITECTURE.md §5.1): named by
generation, a changed policy adopted in place, an unused generation ending itself,
every generation ended by ``kill_router_actors``; and the ingress counters every
router keeps for ``/metrics``, with the replicas' freshest reports."""

from __future__ import annotations

import dataclasses

import pytest

from tests.cluster.conftest import tiny_engine, wait_until

ray = pytest.importorskip("ray")

from kvroute.cluster.config import ClusterConfig  # noqa: E402
from kvroute.cluster.messages import ROUTER_NAMESPACE  # noqa: E402
from kvroute.cluster.router_actor import RouterService, get_or_create_router_actors  # noqa: E402
from kvroute.cluster.router_lookup import app_router, app_router_names, kill_router_actors  # noqa: E402
from kvroute.replica.block_hash import BlockHash, HashSpec  # noqa: E402


def test_a_policy_change_is_adopted_with_the_directory_kept():
    spec = HashSpec(8, 11, "m")
    svc = RouterService(spec, "kvroute")
    hashes = [BlockHash(1), BlockHash(2)]
    svc.register("r1", spec, 16, hashes, 0)
    svc.register("r2", spec, 16, [], 0)
    assert svc.rank(hashes, 16, ["r1", "r2"]).replica_id == "r1"  # kvroute: the holder
    assert svc.adopt("round_robin", {}) is True
    assert svc.adopt("round_robin", {}) is False  # the same again: nothing to do
    assert sorted(svc.replicas()) == ["r1", "r2"] and svc.directory("r1") == hashes
    firsts = {svc.rank(hashes, 16, ["r1", "r2"]).replica_id for _ in range(4)}
    assert firsts == {"r1", "r2"}  # round robin ignores the cache
    assert svc.health()["policy"] == "round_robin"


def test_a_router_refuses_another_hash_spec_and_says_which():
    svc = RouterService(HashSpec(8, 11, "m"))
    with pytest.raises(ValueError, match="hash_seed"):
        svc.register("r9", HashSpec(8, 12, "m"), 16, [], 0)
    assert "r9" in svc.health()["refused"]
    svc.register("r9", HashSpec(8, 11, "m"), 16, [], 0)  # fixed: no longer listed
    assert svc.health()["refused"] == {} and svc.health()["replicas"] == 1


def test_ingress_reports_are_kept_until_the_ingress_goes_silent():
    import time

    svc = RouterService(HashSpec(8, 1, "m"), replica_timeout_s=0.2)
    svc.report_ingress("i1", {"fallbacks": 3})
    svc.report_ingress("i2", {"fallbacks": 1})
    assert svc.metrics()["ingresses"] == {"i1": {"fallbacks": 3}, "i2": {"fallbacks": 1}}
    time.sleep(0.3)
    svc.report_ingress("i2", {"fallbacks": 2})
    assert svc.metrics()["ingresses"] == {"i2": {"fallbacks": 2}}  # i1 went silent


def _config(model, app: str, **overrides) -> ClusterConfig:
    return ClusterConfig(engine=tiny_engine(model, hash_seed=5), app_name=app, heartbeat_s=0.2, replica_timeout_s=1.0,
                         idle_exit_s=2.0, router_num_cpus=0.1, **overrides)  # fmt: skip


def test_an_ingress_renders_each_replicas_freshest_report_over_every_router():
    """Each router keeps every registered replica's latest metrics report with its age;
    an ingress that asks several routers shows, per replica, the freshest one (not the
    first router's, which may be a round behind or lack the replica)."""
    import time

    from kvroute.deploy.metrics import freshest_reports

    spec = HashSpec(8, 11, "m")
    first, second = RouterService(spec), RouterService(spec)
    for svc in (first, second):
        svc.register("r1", spec, 16, [], 0)
    first.register("r2", spec, 16, [], 0)
    assert first.report_metrics("r1", {"running": 1}) and first.report_metrics("r2", {"running": 2})
    time.sleep(0.01)
    assert second.report_metrics("r1", {"running": 4})
    assert second.report_metrics("r9", {"running": 9}) is False  # not registered there: not kept
    views = [first.metrics()["replicas"], second.metrics()["replicas"]]
    assert views[0]["r1"]["age_s"] > views[1]["r1"]["age_s"] >= 0
    merged = freshest_reports(views)
    assert {rid: rep["running"] for rid, rep in merged.items()} == {"r1": 4, "r2": 2}
    assert freshest_reports(views[::-1]) == merged


def test_generations_are_named_apart_and_an_unused_one_ends_itself(ray_cluster, tiny_llama_path):
    app = "kvgen"
    old = _config(tiny_llama_path, app)
    policy_only = dataclasses.replace(old, router_policy="round_robin", num_replicas=4)
    new = dataclasses.replace(old, engine=dataclasses.replace(old.engine, max_num_seqs=32), num_routers=2)
    assert policy_only.generation == old.generation and new.generation != old.generation
    try:
        get_or_create_router_actors(old)
        assert app_router_names(app) == [old.router_actor_name]
        handles = get_or_create_router_actors(new)
        assert app_router_names(app) == sorted([old.router_actor_name, *new.router_actor_names])
        with pytest.raises(ValueError, match="2 router generations"):
            app_router(app)
        # the new generation stays while called; the old one, called by nobody, ends itself
        names = wait_until(lambda: (ray.get([h.health.remote() for h in handles]), app_router_names(app))[1]
                           == sorted(new.router_actor_names) and app_router_names(app), 30,
                           "the unused generation's router to end itself", interval_s=0.5)  # fmt: skip
        assert names == sorted(new.router_actor_names)
        with pytest.raises(ValueError):
            ray.get_actor(old.router_actor_name, namespace=ROUTER_NAMESPACE)
    finally:
        assert kill_router_actors(app) >= 0
    assert app_router_names(app) == []
