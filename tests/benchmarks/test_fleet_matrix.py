"""The fleet-scale scenario matrix, CI-sized: 4 emulated replicas, one small scenario,
kvroute and power of two on one Serve fleet and SGLang's real router in front of
`serve-replica --emulate` processes. Asserts the run's invariants, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("httpx")

from kvroute.benchmarks import fleet_matrix  # noqa: E402


def test_a_small_matrix_runs_every_router_on_emulated_replicas(ray_cluster, tmp_path, capsys):
    routers = ["kvroute", "power_of_two"]
    try:
        import sglang_router  # noqa: F401

        routers.append("sglang_router")
    except ImportError:
        pass
    port = ray_cluster.rsplit(":", 1)[1]
    out = tmp_path / "matrix"
    rc = fleet_matrix.main([
        "--replicas", "4", "--time-scale", "2", "--scenarios", "gsp", "--loads", "0.5", "--routers", ",".join(routers),
        "--scale", "0.05", "--len-scale", "0.1", "--http-port", port, "--app-name", "fleetci", "--out-dir", str(out),
        "--timeout-s", "120",
    ])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"fleet_matrix: 1 scenarios x {len(routers)} routers, {len(routers)} runs, 0 errors" in printed
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
    t = matrix["targets"][0]
    assert t["scenario"] == "gsp" and t["errors"] == 0 and t["p90_over_best_peer"] > 0
    assert (out / "table.md").read_text().startswith("| scenario |")
