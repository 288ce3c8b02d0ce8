"""The routing layer's real-speed added latency in the fleet benchmarks' figures: read
from a hand-made data_path JSON (``conftest.HAND_DATA_PATH``), added to each router's
TTFT by the documented rule, and the kvroute-vs-peer ratios recomputed with it; a router
without a figure is named, never given one. No Ray: the fleet runs with it are in
test_fleet_matrix and test_multi_ingress."""

from __future__ import annotations

import argparse
import json

import pytest

from kvroute.benchmarks import ingress_matrix, lora_emulated, lora_report, real_speed, router_report
from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks.fleets import external_available

from .conftest import HAND_ADDED, HAND_DATA_PATH


def test_added_latency_is_each_system_over_direct_and_a_router_without_one_is_named(hand_data_path):
    o = real_speed.load(hand_data_path)
    assert {s: (a.p50_ms, a.p99_ms) for s, a in o.added.items()} == {"kvroute_direct": (10.0, 20.0), "sglang_router": (2.0, 0.0)}
    assert o.source["direct_p99_ms"] == 17.5 and o.source["same_cpu_model"] is False and o.source["rate"] == 20.0
    row = {"router": "kvroute", "ttft_median_ms": 30.0, "ttft_p90_ms": 50.0, "ttft_p99_ms": 80.0}
    k = o.annotate(row)
    assert k["router_added_system"] == "kvroute_direct"
    # p50 + added p50; p90 and p99 + added p99
    assert (k["ttft_median_ms_plus_router"], k["ttft_p90_ms_plus_router"], k["ttft_p99_ms_plus_router"]) == (40.0, 70.0, 100.0)
    assert "router_added_note" not in k and k["ttft_p90_ms"] == 50.0  # the unscaled figure kept
    p2 = o.annotate({**row, "router": "power_of_two"})
    assert p2["ttft_p90_ms_plus_router"] is None and p2["router_added_p50_ms"] is None
    assert p2["router_added_note"].startswith("no data_path system for power_of_two")
    vllm = o.annotate({**row, "router": "vllm_router"})  # its data_path run failed
    assert vllm["ttft_p90_ms_plus_router"] is None and "vllm_router not measured in data_path.json" in vllm["router_added_note"]
    assert "power_of_two none (no data_path system" in o.note(["kvroute", "power_of_two"])


def test_a_json_without_direct_is_refused_and_real_speed_runs_are_refused(tmp_path, hand_data_path):
    bad = tmp_path / "no_direct.json"
    bad.write_text(json.dumps({**HAND_DATA_PATH, "systems": HAND_DATA_PATH["systems"][:2]}))
    with pytest.raises(ValueError, match="no 'direct'"):
        real_speed.load(bad)
    p = argparse.ArgumentParser()
    real_speed.add_args(p)
    args = p.parse_args(["--overhead-from", str(hand_data_path), "--overhead-map", "power_of_two=kvroute_direct"])
    with pytest.raises(ValueError, match="time-scale > 1"):  # at real speed the TTFTs already hold it
        real_speed.from_args(args, ["kvroute"], tmp_path, time_scale=1.0)
    o = real_speed.from_args(args, ["kvroute"], tmp_path, time_scale=80.0)
    assert o is not None and o.for_router("power_of_two").system == "kvroute_direct"  # the map overrides
    assert real_speed.from_args(p.parse_args([]), ["kvroute"], tmp_path, time_scale=80.0) is None
    # --overhead-measure's data_path run: one system per router that has one, then the baseline
    installed = [r for r in ("sglang_router", "vllm_router") if external_available(r)]
    routers = ["kvroute", "kvroute_1router", "power_of_two", "prefix_affinity_ray", "sglang_router", "vllm_router"]
    assert real_speed.systems_for(routers) == ["kvroute_direct", *installed, "direct"]
    assert real_speed.systems_for(["kvroute"], {"kvroute": ("kvroute_haproxy",)}) == ["kvroute_haproxy", "direct"]


def _result(router: str, p90: float, completed: int = 8) -> dict:
    return {"router": router, "request_rate": 4.0, "completed": completed, "failed": 0, "p90_ttft_ms": p90,
            "prefix_cache_hit_rate": 0.8, "best_prefix_cache_hit_rate": 0.9, "request_throughput": 4.0}  # fmt: skip


def test_compare_routers_ratios_with_each_routers_added_latency(hand_data_path):
    o = real_speed.load(hand_data_path)
    results = {"a": _result("kvroute", 20.0), "b": _result("power_of_two", 30.0), "c": _result("sglang_router", 25.0)}
    t = router_report.target_ratios(results, 4.0, o)
    assert t["kvroute_p90_ttft_over_best_other"] == pytest.approx(20 / 25)  # unscaled, as before
    # kvroute 20 + 20; sglang-router 25 + 0; power of two 30 + nothing known (counted as 30)
    assert t["best_other_router_plus_router"] == "sglang_router"
    assert t["kvroute_p90_ttft_over_best_other_plus_router"] == pytest.approx(40 / 25)
    assert t["kvroute_p90_ttft_over_power_of_two_plus_router"] == pytest.approx(40 / 30)
    assert t["counted_without_added"] == ["power_of_two"]
    assert "kvroute_p90_ttft_over_best_other_plus_router" not in router_report.target_ratios(results, 4.0)


def test_fleet_matrix_simulated_carries_the_added_latency_and_its_ratios(hand_data_path, tmp_path, capsys):
    out = tmp_path / "fm"
    assert bench(["fleet_matrix", "--sim-only", "--replicas", "4", "--scenarios", "gsp", "--loads", "0.5", "--scale", "0.05",
                  "--len-scale", "0.1", "--routers", "kvroute,power_of_two,sglang_router", "--out-dir", str(out),
                  "--overhead-from", str(hand_data_path)]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "with each router's real-speed added latency" in line and "kvroute +10.0/+20.0 ms (kvroute_direct)" in line
    m = json.loads((out / "matrix.json").read_text())
    assert m["router_overhead"]["added_ms"]["kvroute_direct"] == {"p50": 10.0, "p99": 20.0}
    rows = {r["router"]: r for r in m["rows"]}
    for name, (p50, p99) in HAND_ADDED.items():
        if name in rows:
            r = rows[name]
            assert r["ttft_median_ms_plus_router"] == pytest.approx(r["ttft_median_ms"] + p50)
            assert r["ttft_p90_ms_plus_router"] == pytest.approx(r["ttft_p90_ms"] + p99)
            assert r["ttft_p99_ms_plus_router"] == pytest.approx(r["ttft_p99_ms"] + p99)
    assert rows["power_of_two"]["ttft_p90_ms_plus_router"] is None
    t = m["targets"][0]
    counted = {n: r["ttft_p90_ms_plus_router"] or r["ttft_p90_ms"] for n, r in rows.items() if n != "kvroute"}
    best = min(counted, key=counted.get)
    assert t["best_peer_plus_router"] == best and t["counted_without_added"] == ["power_of_two"]
    assert t["p90_over_best_peer_plus_router"] == pytest.approx(rows["kvroute"]["ttft_p90_ms_plus_router"] / counted[best])
    assert "p90 +added" in (out / "table.md").read_text()


def test_ingress_and_lora_ratios_with_the_added_latency(hand_data_path, tmp_path):
    o = real_speed.load(hand_data_path)

    def row(router: str, i: int, p90: float) -> dict:
        return o.annotate({"scenario": "zipf", "ingresses": i, "router": router, "completed": 8, "ttft_median_ms": p90 / 2,
                           "ttft_p90_ms": p90, "ttft_p99_ms": 2 * p90, "hit_rate": 0.5, "out_tok_s": 100.0,
                           "sim_ttft_p90_ms": p90})  # fmt: skip

    rows = [row("kvroute", 1, 10.0), row("kvroute", 2, 30.0), row("sglang_router", 2, 35.0), row("prefix_affinity_ray", 2, 40.0)]
    t = next(t for t in ingress_matrix.targets(rows) if t["ingresses"] == 2)
    assert t["p90_vs_I1"] == pytest.approx(3.0) and t["p90_vs_I1_plus_router"] == pytest.approx(50 / 30)
    assert t["best_peer"] == "sglang_router" and t["p90_vs_best_peer"] == pytest.approx(30 / 35)
    assert t["best_peer_plus_router"] == "sglang_router" and t["p90_vs_best_peer_plus_router"] == pytest.approx(50 / 35)
    assert t["counted_without_added"] == ["prefix_affinity_ray"]
    ingress_matrix.write(tmp_path, rows, None, argparse.Namespace(load=0.85), 0.0, o)
    written = json.loads((tmp_path / "matrix.json").read_text())
    assert written["router_overhead"]["added_ms"]["sglang_router"] == {"p50": 2.0, "p99": 0.0}
    assert written["targets"][-1]["p90_vs_best_peer_plus_router"] == pytest.approx(50 / 35)
    assert "p90 / best peer +added" in (tmp_path / "table.md").read_text()

    def lora(p90_s: float, plus_s: float | None) -> dict:
        return {"ttft_p50_s": p90_s / 2, "ttft_p90_s": p90_s, "ttft_p90_s_plus_router": plus_s, "ttft_p50_s_plus_router": plus_s,
                "adapter_loads_per_1k": 5.0, "hit_rate": 0.5, "output_tokens_per_s": 100.0}  # fmt: skip

    results = {"kvroute": lora(0.030, 0.050), "vllm_router": lora(0.040, None), "power_of_two": lora(0.045, None)}
    # a measured router's result takes its row's figures, in seconds as lora_fleet reports them
    measured = lora_emulated.router_result({**row("kvroute", 1, 30.0), "failed": 0, "out_tok_s": 100.0}, {"per_replica": {}})
    assert measured["ttft_p90_s"] == pytest.approx(0.030) and measured["ttft_p90_s_plus_router"] == pytest.approx(0.050)
    assert measured["ttft_p50_s_plus_router"] == pytest.approx(0.025) and measured["router_added_system"] == "kvroute_direct"
    c = lora_report.compare(results)
    assert c["p90_ratio"] == pytest.approx(0.75) and c["p90_ratio_plus_router"] == pytest.approx(0.050 / 0.040)
    assert c["counted_without_added"] == ["power_of_two", "vllm_router"]
    line = lora_report.summary_line({"comparison": c, "results": results, "simulated": False, "time_scale": 80, "profile": "p",
                                     "rate_rps": 1.0, "config": {"replicas": 2, "adapters": 4, "zipf": 1.1, "max_loras": 2,
                                                                 "load": 0.5}})  # fmt: skip
    assert "kvroute: loads/1k 5.0 hit 0.500 p50 15 p90 30 ms (+router 50/50 ms)" in line
    assert "vllm_router: loads/1k 5.0 hit 0.500 p50 20 p90 40 ms (+router: no real-speed figure)" in line
    assert line.endswith("with the routers' real-speed added latency: p90 1.25x (vllm_router)")
