"""The fleet-scale scenario matrix, CI-sized: 4 emulated replicas, one small scenario,
kvroute and power of two on one Serve fleet (the module's tests share it) and SGLang's
real router in front of `serve-replica --emulate` processes. Asserts the run's
invariants, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

from kvroute.benchmarks.cli import main as bench  # noqa: E402
from kvroute.benchmarks import fleet_matrix  # noqa: E402
from kvroute.benchmarks.fleets import external_available  # noqa: E402

from .conftest import HAND_ADDED  # noqa: E402


def _run_matrix(ray_cluster: str, out, scenario: str, routers: list[str], len_scale: str, *extra: str) -> int:
    """One load (0.5) of one scenario on 4 emulated replicas at scale 0.05 and time scale
    4: the same engines in every test, so the module's kept fleet serves them all."""
    return bench([
        "fleet_matrix", "--replicas", "4", "--time-scale", "4", "--scenarios", scenario, "--loads", "0.5",
        "--routers", ",".join(routers), "--scale", "0.05", "--len-scale", len_scale,
        "--http-port", ray_cluster.rsplit(":", 1)[1], "--app-name", "fleetmatrix", "--out-dir", str(out),
        "--timeout-s", "120", *extra,
    ])  # fmt: skip


def test_a_small_matrix_runs_every_router_on_emulated_replicas(ray_cluster, kept_fleet, tmp_path, capsys, hand_data_path):
    routers = ["kvroute", "power_of_two"] + [r for r in ["sglang_router"] if external_available(r)]
    out = tmp_path / "matrix"
    assert _run_matrix(ray_cluster, out, "gsp", routers, "0.1", "--overhead-from", str(hand_data_path)) == 0
    printed = capsys.readouterr().out
    assert f"fleet_matrix: 1 scenarios x {len(routers)} routers, {len(routers)} runs, 0 errors (0 kvroute's)" in printed
    matrix = json.loads((out / "matrix.json").read_text())
    workload = fleet_matrix.workload_of("gsp", 0.05, 0.1, 0)
    assert [r["router"] for r in matrix["rows"]] == routers
    for row in matrix["rows"]:
        assert row["completed"] == len(workload) and row["failed"] == 0
        for key in ("ttft_p90_ms", "ttft_p99_ms", "tpot_median_ms", "out_tok_s", "hit_rate", "sim_ttft_p90_ms",
                    "sim_hit_rate", "capacity_rps", "kv_blocks_per_replica"):  # fmt: skip
            assert row[key] is not None, key
        assert row["load"] == 0.5 and row["rate"] == pytest.approx(0.5 * row["capacity_rps"], rel=1e-3)
        run = json.loads((out / "gsp" / f"{row['run']}.json").read_text())
        # the emulated replicas produced exactly the planned output tokens, never an early EOS
        assert run["total_output_tokens"] == workload.output_tokens
        assert sorted(run["output_lens"]) == sorted(r.output_len for r in workload.requests)
    serve_runs = [json.loads((out / "gsp" / f"{r['run']}.json").read_text()) for r in matrix["rows"] if r["router"] != "sglang_router"]
    for run in serve_runs:  # the replicas' own counters account for every request
        assert sum(c["requests"] for c in run["per_replica"].values()) == len(workload)
        assert len(run["per_replica"]) == 4
        if run["router"] == "kvroute":  # and the router's: one decision per request, none by fallback
            assert sum(v for k, v in run["routing"].items() if k.startswith("decisions:")) == len(workload)
            assert run["routing"].get("fallbacks", 0) == 0
    k = next(r for r in matrix["rows"] if r["router"] == "kvroute")
    assert 0 <= k["pred_cached_err"] < 0.2 and k["fallbacks"] == 0
    # decision quality from kvroute's /metrics: the reuse available, captured, delivered (hit)
    assert k["available_rate"] >= k["captured_rate"] > 0 and abs(k["captured_rate"] - k["hit_rate"]) < 0.2
    assert all(r["available_rate"] is None for r in matrix["rows"] if r["router"] != "kvroute")
    t = matrix["targets"][0]
    assert t["scenario"] == "gsp" and t["errors"] == 0 and t["p90_over_best_peer"] > 0
    assert (out / "table.md").read_text().startswith("| scenario |")
    # the routers' real-speed added latency (the hand-made data_path JSON) beside the unscaled TTFTs
    assert "with each router's real-speed added latency" in printed
    rows = {r["router"]: r for r in matrix["rows"]}
    for name, (p50, p99) in HAND_ADDED.items():
        if name in rows:
            r = rows[name]
            assert (r["router_added_p50_ms"], r["router_added_p99_ms"]) == (p50, p99)
            assert r["ttft_median_ms_plus_router"] == pytest.approx(r["ttft_median_ms"] + p50)
            assert r["ttft_p90_ms_plus_router"] == pytest.approx(r["ttft_p90_ms"] + p99)
            assert r["ttft_p99_ms_plus_router"] == pytest.approx(r["ttft_p99_ms"] + p99)
    assert rows["power_of_two"]["ttft_p90_ms_plus_router"] is None and "power_of_two" in t["counted_without_added"]
    peers = {n: r["ttft_p90_ms_plus_router"] or r["ttft_p90_ms"] for n, r in rows.items() if n != "kvroute"}
    assert t["p90_over_best_peer_plus_router"] == pytest.approx(rows["kvroute"]["ttft_p90_ms_plus_router"] / min(peers.values()))


def _event_scenario_runs(ray_cluster, tmp_path, capsys, scenario):
    """Run one mid-run-event scenario on 4 replicas (kvroute, and sglang-router when
    installed); the workload and each router's (matrix row, run JSON)."""
    routers = ["kvroute"] + [r for r in ["sglang_router"] if external_available(r)]
    out = tmp_path / scenario
    assert _run_matrix(ray_cluster, out, scenario, routers, "0.2") == 0, capsys.readouterr().out[-3000:]
    matrix = json.loads((out / "matrix.json").read_text())
    runs = [(row, json.loads((out / scenario / f"{row['run']}.json").read_text())) for row in matrix["rows"]]
    return fleet_matrix.workload_of(scenario, 0.05, 0.2, 0), runs


def test_the_failure_scenario_kills_a_replica_mid_run_and_loses_no_request(ray_cluster, kept_fleet, tmp_path, capsys):
    workload, runs = _event_scenario_runs(ray_cluster, tmp_path, capsys, "failure")
    for row, run in runs:
        assert len(run["killed_replicas"]) == 1, run["killed_replicas"]  # 1 of 8, at least one
        assert run["completed"] + run["failed"] == len(workload)
        if row["router"] == "kvroute":  # a stream cut by the kill resumes on another replica: none lost
            assert run["failed"] == 0 and run["total_output_tokens"] == workload.output_tokens


def test_the_scale_out_scenario_grows_the_fleet_mid_run(ray_cluster, kept_fleet, tmp_path, capsys):
    workload, runs = _event_scenario_runs(ray_cluster, tmp_path, capsys, "scale-out")
    for row, run in runs:
        assert len(run["added_replicas"]) == 1, run  # a quarter of 4 joins at mid-run
        assert run["failed"] == 0 and run["total_output_tokens"] == workload.output_tokens
        if row["router"] == "kvroute":  # 3 replicas at the start, the 4th registered and counted
            assert len(run["replica_ids"]) == 3 and len(run["per_replica"]) == 4
            assert run["added_replicas"][0] in run["per_replica"]
        else:
            assert len(run["worker_urls"]) == 3 and run["added_replicas"][0] not in run["worker_urls"]
