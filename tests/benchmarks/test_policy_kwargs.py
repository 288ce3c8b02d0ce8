"""``--policy-kwargs``: the kvroute policy's options reach both the deployed router and
the simulated prediction of the emulated-fleet benchmarks, so a rule can be switched off
side by side on the same fleet; a bad value is a clear error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvroute.benchmarks import options
from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks.fleets import ServeFleet, fleet_from_args


def _fleet_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    options.add_fleet(p, replicas=4, cpus_per_replica=0.05, app_name="kw")
    return p.parse_args(list(argv))


def test_the_options_reach_the_kvroute_router_actors_config():
    args = _fleet_args("--policy-kwargs", '{"balance_prefixes": false, "slack_rel": 1.5}')
    fleet = fleet_from_args(args)
    assert fleet.policy_kwargs == {"balance_prefixes": False, "slack_rel": 1.5}
    config = ServeFleet(fleet, {"block_size": 16}).app_args("kvroute").cluster_config()
    assert config.router_policy == "kvroute"
    assert config.router_policy_kwargs == {"balance_prefixes": False, "slack_rel": 1.5}
    plain = ServeFleet(fleet_from_args(_fleet_args()), {"block_size": 16}).app_args("kvroute").cluster_config()
    assert plain.router_policy_kwargs == {}


@pytest.mark.parametrize("bad", ["[1, 2]", "{not json", '"text"'])
def test_anything_but_a_json_object_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        _fleet_args("--policy-kwargs", bad)
    assert "--policy-kwargs" in capsys.readouterr().err


def test_the_simulated_prediction_runs_the_policy_with_them(tmp_path, capsys):
    def sim(kwargs: str) -> tuple[int, Path]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        rc = bench(["fleet_matrix", "--sim-only", "--replicas", "4", "--scenarios", "gsp", "--loads", "0.9",
                    "--routers", "kvroute", "--scale", "0.05", "--len-scale", "0.2", "--out-dir", str(out),
                    "--policy-kwargs", kwargs])  # fmt: skip
        return rc, out

    rc, out = sim("{}")
    assert rc == 0 and json.loads((out / "matrix.json").read_text())["rows"][0]["sim_hit_rate"] is not None
    # an option the policy refuses fails the run with the policy's own message: it reached the policy
    capsys.readouterr()
    rc, out = sim('{"slack_rel": 0.5}')
    captured = capsys.readouterr()
    assert rc != 0 and "need slack_rel >= 1" in captured.out + captured.err
    assert not (out / "matrix.json").exists()


def test_the_emulated_lora_benchmark_takes_them_too():
    from kvroute.benchmarks import lora_fleet

    p = argparse.ArgumentParser()
    lora_fleet.add_args(p)
    args = p.parse_args(["--emulate", "gpu_h100_llama3_8b", "--policy-kwargs", '{"adapter_copies": true}'])
    assert fleet_from_args(args, model=args.model).policy_kwargs == {"adapter_copies": True}


def test_a_kvroute_variant_runs_beside_kvroute_and_the_peers_in_one_simulated_matrix(tmp_path, capsys):
    """``--sim-only --routers kvroute,kvroute:nopulls,...``: the variant runs kvroute with
    ``{"pulls": false}`` on the same trace, is kvroute's (never the best peer) in the
    targets, and pays kvroute's routing layer where the added latency is counted."""
    hand = tmp_path / "data_path.json"
    hand.write_text(json.dumps({"systems": [{"system": "kvroute_direct", "open_loop": {"p50_ms": 30.0, "p99_ms": 60.0}},
                                            {"system": "vllm_router", "open_loop": {"p50_ms": 12.0, "p99_ms": 22.0}},
                                            {"system": "direct", "open_loop": {"p50_ms": 10.0, "p99_ms": 20.0}}]}))  # fmt: skip
    out = tmp_path / "m"
    assert bench(["fleet_matrix", "--sim-only", "--replicas", "4", "--scenarios", "fork", "--loads", "0.9",
                  "--routers", "kvroute,kvroute:nopulls,vllm_router", "--scale", "0.1", "--len-scale", "0.1",
                  "--overhead-from", str(hand), "--out-dir", str(out)]) == 0  # fmt: skip
    matrix = json.loads((out / "matrix.json").read_text())
    rows = {r["router"]: r for r in matrix["rows"]}
    assert set(rows) == {"kvroute", "kvroute:nopulls", "vllm_router"}
    assert rows["kvroute:nopulls"]["sim_policy"] == "kvroute:nopulls" and rows["kvroute"]["sim_policy"] == "kvroute"
    assert rows["kvroute"]["pulls"]["pulls"] > 0 and rows["kvroute:nopulls"]["pulls"]["pulls"] == 0
    assert "pull" not in rows["kvroute:nopulls"]["reasons"]
    assert rows["kvroute:nopulls"]["router_added_p99_ms"] == rows["kvroute"]["router_added_p99_ms"] == 40.0
    (t,) = matrix["targets"]
    assert t["best_peer"] == t["best_hit_peer"] == "vllm_router"
    assert t["hit_over_best_peer"] == pytest.approx(rows["kvroute"]["hit_rate"] / rows["vllm_router"]["hit_rate"])
    # a measured run has no such router: refused before anything starts
    capsys.readouterr()
    assert bench(["fleet_matrix", "--replicas", "4", "--scenarios", "gsp", "--routers", "kvroute:nopulls",
                  "--out-dir", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "kvroute:LABEL" in capsys.readouterr().err and not (tmp_path / "x").exists()
