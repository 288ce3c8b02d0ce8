"""compare_routers' multi-ingress mode, CI-sized: 2 emulated replicas behind 2 Serve
ingresses (the application's own and an ingress-only application sharing its engines
and routers), kvroute with a router per ingress and with one router, then one of two
routers killed mid-run, the module's comparisons on one kept fleet. Asserts that the
clients really reached both ingress processes, that nothing failed and that the prefix
cache was hit."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

from kvroute.benchmarks.cli import main as bench  # noqa: E402

GROUPS, PER_GROUP = 2, 6  # 12 requests, 6 per ingress


def _argv(ray_cluster: str, out, routers: str, *extra: str) -> list[str]:
    return [
        "--replicas", "2", "--ingresses", "2", "--routers", routers, "--emulate", "gpu_h100_llama3_8b",
        "--time-scale", "4", "--engine-kwargs", json.dumps({"block_size": 16, "num_kv_blocks": 512}),
        "--num-cpus-per-replica", "0.1", "--app-name", "ingressbench", "--http-port", ray_cluster.rsplit(":", 1)[1],
        "--out-dir", str(out), "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(GROUPS),
        "--gsp-prompts-per-group", str(PER_GROUP), "--gsp-system-prompt-len", "256", "--gsp-question-len", "16",
        "--gsp-output-len", "8", "--request-rate", "40", "--disable-tqdm", "--timeout-s", "120", *extra,
    ]  # fmt: skip


def test_clients_spread_over_two_ingresses_with_one_or_two_routers(ray_cluster, kept_fleet, tmp_path, capsys, hand_data_path):
    out = tmp_path / "multi"
    # one router first: the fleet ends with a router per ingress, as the next test starts it
    argv = _argv(ray_cluster, out, "kvroute_1router,kvroute", "--overhead-from", str(hand_data_path))
    assert bench(["compare_routers", *argv]) == 0
    printed = capsys.readouterr().out
    assert "2 runs, 0 errors" in printed
    combined = json.loads((out / "combined.json").read_text())
    # both stand for kvroute serve's default path: its real-speed added latency (hand-made, 10 / 20 ms) on each TTFT
    assert combined["router_overhead"]["added_ms"]["kvroute_direct"] == {"p50": 10.0, "p99": 20.0}
    for row in combined["rows"]:
        assert row["router_added_system"] == "kvroute_direct"
        assert row["ttft_median_ms_plus_router"] == pytest.approx(row["ttft_median_ms"] + 10.0)
        assert row["ttft_p90_ms_plus_router"] == pytest.approx(row["ttft_p90_ms"] + 20.0)
        assert f"{row['router']} {row['ttft_median_ms']:.0f}/" in printed
    assert "with kvroute_direct +10.0/+20.0" in printed and "p90 +added" in (out / "table.md").read_text()
    n = GROUPS * PER_GROUP
    runs = {r["router"]: json.loads((out / f"{r['run']}.json").read_text()) for r in combined["rows"]}
    assert sorted(runs) == ["kvroute", "kvroute_1router"]
    assert runs["kvroute"]["num_routers"] == 2 and runs["kvroute_1router"]["num_routers"] == 1
    # two routers heard each other's decisions (the lag is recorded); one router has no peers
    lag = runs["kvroute"]["peer_staleness_ms"]
    assert 0 <= lag["p50"] <= lag["p99"] < 60_000 and runs["kvroute_1router"]["peer_staleness_ms"] == {}
    for run in runs.values():
        assert run["completed"] == n and run["failed"] == 0
        assert len(run["base_urls"]) == 2 and run["base_urls"][1].endswith("/ingressbench-ingress1")
        assert run["requests_per_ingress"] == [n // 2, n // 2]
        # each ingress process routed (and saw finish) its own half: two ingresses, not one
        routing = run["routing"]
        assert routing["ingress0:routed_requests"] == routing["ingress1:routed_requests"] == n // 2
        assert sum(v for k, v in routing.items() if k.startswith("decisions:")) == n
        assert routing.get("fallbacks", 0) == 0
        assert sum(c["requests"] for c in run["per_replica"].values()) == n
        assert 0 < run["prefix_cache_hit_rate"] <= run["best_prefix_cache_hit_rate"]


def test_a_router_killed_under_two_ingresses_loses_no_request(ray_cluster, kept_fleet, tmp_path, capsys):
    out = tmp_path / "kill"
    argv = _argv(ray_cluster, out, "kvroute", "--kill-router", "--event-at", "0.3")
    assert bench(["compare_routers", *argv]) == 0
    assert "1 runs, 0 errors" in capsys.readouterr().out
    row = json.loads((out / "combined.json").read_text())["rows"][0]
    run = json.loads((out / f"{row['run']}.json").read_text())
    assert run["failed"] == 0 and run["completed"] == GROUPS * PER_GROUP
    assert run["killed_routers"] and run["killed_routers"][0].startswith("kvroute-router:ingressbench")
    # the ingress that asked the dead router asked the other one (a failover), never power of two
    assert run["routing"]["failovers"] >= 1 and run["routing"].get("fallbacks", 0) == 0
    assert run["after_event_request_ids"] and run["after_event_hit_rate"] > 0
