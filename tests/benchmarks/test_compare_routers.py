"""The router comparison end to end on a tiny model: two routers on one set of Serve
replicas (the same replica ids in both runs, each started cold), a table, JSON per
router and the plots."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

from kvroute.benchmarks.cli import main as bench  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_routers_on_one_fleet_write_a_table(ray_cluster, tiny_llama_path, tmp_path, capsys):
    port = ray_cluster.rsplit(":", 1)[1]
    out = tmp_path / "cmp"
    rc = bench([
        "compare_routers", "--model", str(tiny_llama_path), "--replicas", "2", "--routers", "kvroute,power_of_two",
        "--engine-kwargs", json.dumps({"block_size": 8, "num_kv_blocks": 256, "max_model_len": 512, "dtype": "float32"}),
        "--app-name", "cmpbench", "--http-port", port, "--out-dir", str(out),
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
        "--gsp-system-prompt-len", "48", "--gsp-question-len", "8", "--gsp-output-len", "4",
        "--request-rate", "20", "--max-concurrency", "1", "--disable-tqdm",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "compare_routers[generated-shared-prefix]: 2 runs, 0 errors" in printed
    combined = json.loads((out / "combined.json").read_text())
    assert [r["router"] for r in combined["rows"]] == ["kvroute", "power_of_two"]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in combined["rows"])
    runs = {r["router"]: json.loads((out / f"{r['run']}.json").read_text()) for r in combined["rows"]}
    assert runs["kvroute"]["replica_ids"] == runs["power_of_two"]["replica_ids"] == combined["replica_ids"]
    assert len(combined["replica_ids"]) == 2
    for r in runs.values():  # the replicas' own counters account for every request
        assert sorted(r["per_replica"]) == combined["replica_ids"]
        assert sum(c["requests"] for c in r["per_replica"].values()) == 8
        assert sum(c["cached_tokens"] for c in r["per_replica"].values()) == sum(r["cached_lens"])
    # each run starts cold: its first request of each group finds nothing cached
    for r in runs.values():
        assert 0 < r["prefix_cache_hit_rate"] <= r["best_prefix_cache_hit_rate"]
    # kvroute keeps each group on one replica: one at a time, every later request of a
    # group finds its system prompt
    assert runs["kvroute"]["prefix_cache_hit_rate"] >= 0.95 * runs["kvroute"]["best_prefix_cache_hit_rate"]
    table = (out / "table.md").read_text()
    assert table.startswith("| router |") and "kvroute" in table and "power_of_two" in table
    t = combined["targets"][0]
    assert t["errors"] == 0 and "kvroute_p90_ttft_over_power_of_two" in t
    for name in ("ttft_cdf.png", "hit_rate.png", "ttft_vs_rate.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name


def test_external_routers_front_single_engine_servers(tiny_llama_path, tmp_path, capsys):
    """SGLang's and vLLM's real routers (cache_aware) in front of two `kvroute
    serve-replica` processes each: every request answered, text prompts, a table row per
    router. No Ray: only external routers in the run."""
    pytest.importorskip("sglang_router", reason="pip install -e .[test] installs sglang-router")
    pytest.importorskip("vllm_router", reason="pip install -e .[test] installs vllm-router")
    out = tmp_path / "ext"
    rc = bench([
        "compare_routers", "--model", str(tiny_llama_path), "--replicas", "2", "--routers", "sglang_router,vllm_router",
        "--engine-kwargs", json.dumps({"block_size": 8, "num_kv_blocks": 256, "max_model_len": 512, "dtype": "float32"}),
        "--out-dir", str(out), "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "48", "--gsp-question-len", "8",
        "--gsp-output-len", "4", "--request-rate", "20", "--max-concurrency", "1", "--disable-tqdm",
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "sending text prompts to every router" in printed
    assert "compare_routers[generated-shared-prefix]: 2 runs, 0 errors" in printed
    combined = json.loads((out / "combined.json").read_text())
    assert [r["router"] for r in combined["rows"]] == ["sglang_router", "vllm_router"]
    for row in combined["rows"]:
        assert row["completed"] == 6 and row["failed"] == 0
        # usage's cached tokens came through the router: one at a time, a group's later
        # requests find at least part of its system prompt on whichever replica they reach
        assert 0 < row["hit_rate"] <= row["best_hit_rate"]


def test_router_service_reset_empties_the_directory_and_switches_policy():
    from kvroute.cluster.router_actor import RouterService
    from kvroute.replica.block_hash import BlockHash, HashSpec
    from kvroute.replica.kv_events import KVEvents

    spec = HashSpec(4, 123, "m")
    svc = RouterService(spec, "kvroute", clock=lambda: 0.0)
    svc.register("a", spec, 10, [BlockHash(1)], 0)
    svc.register("b", spec, 10, [], 0)
    svc.reset("round_robin")
    assert svc.replicas() == [] and svc.policy == "round_robin"
    assert svc.push(KVEvents("a", 1, [BlockHash(2)])) is False  # unknown now: register again
    svc.register("a", spec, 10, [], 1)
    svc.register("b", spec, 10, [], 0)
    assert svc.directory("a") == [] and svc.rank([BlockHash(1)], 5, ["a", "b"]).reason == "round_robin"


def test_replica_version_ignores_router_and_scaling_fields_only():
    import dataclasses

    from kvroute.cluster.config import ClusterConfig
    from kvroute.cluster.replica_deployment import replica_version
    from kvroute.replica.config import EngineConfig

    base = ClusterConfig(engine=EngineConfig(model="m", hash_seed=7), num_replicas=2)
    same = [
        dataclasses.replace(base, request_router="power_of_two"),
        dataclasses.replace(base, router_policy="round_robin", router_policy_kwargs={"x": 1}),
        dataclasses.replace(base, num_replicas=4),
    ]
    assert {replica_version(c) for c in same} == {replica_version(base)}
    other = [
        dataclasses.replace(base, engine=EngineConfig(model="m", hash_seed=8)),
        dataclasses.replace(base, engine=EngineConfig(model="m", hash_seed=7, block_size=32)),
        dataclasses.replace(base, max_ongoing_requests=3),
    ]
    assert len({replica_version(c) for c in other} | {replica_version(base)}) == 4


def test_a_kept_fleet_fixes_the_hash_seed_and_serves_the_same_settings_again(monkeypatch):
    """The opt-in that lets a test module's comparisons share one deployment: the same
    fleet and engine settings (``add_replicas`` aside) get the same ``ServeFleet``,
    other settings close it and get a new one, and leaving the block closes the last."""
    from kvroute.benchmarks import compare_routers as cr
    from kvroute.benchmarks.fleets import FleetConfig, ServeFleet
    from kvroute.benchmarks.serving_config import LoadConfig
    from kvroute.benchmarks.workloads import make_workload

    closed = []
    monkeypatch.setattr(ServeFleet, "close", lambda self: closed.append(self))
    cfg = cr.CompareConfig(workload=make_workload("generated-shared-prefix", seed=0, scale=0.05), load=LoadConfig())
    drawn = {cr._settings(cfg, ["kvroute"])[0]["hash_seed"] for _ in range(2)}
    assert cr.kept_fleet() is None and len(drawn) == 2  # without it, a seed drawn per comparison
    with cr.KeptFleet(hash_seed=5) as kept:
        assert cr.kept_fleet() is kept
        kw, _ = cr._settings(cfg, ["kvroute"])
        assert kw == {"block_size": 16, "hash_seed": 5}
        a = kept.serve_fleet(FleetConfig(replicas=4), kw)
        b = kept.serve_fleet(FleetConfig(replicas=4, add_replicas=1), dict(kw))
        assert b is a and (a.initial, a.fleet.add_replicas) == (3, 1) and not closed
        c = kept.serve_fleet(FleetConfig(replicas=4), {**kw, "block_size": 32})
        assert c is not a and closed == [a]
        with pytest.raises(RuntimeError):
            cr.KeptFleet(hash_seed=6).__enter__()
    assert cr.kept_fleet() is None and closed == [a, c]
