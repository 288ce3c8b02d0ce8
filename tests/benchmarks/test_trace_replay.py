"""Replaying a Mooncake-format trace through the fleet benchmarks: the ``trace`` arrival
mode (the trace's own gaps, scaled to a mean rate), the ``mooncake`` workload by name,
and fleet_matrix's ``mooncake`` scenario from the simulator alone (``--sim-only``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.benchmarks import fleet_matrix, serving
from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks.serving_config import LoadConfig
from kvroute.benchmarks.serving_report import best_prefix_cache_hit_rate
from kvroute.benchmarks.traces import ideal_hit_rate, read_jsonl
from kvroute.benchmarks.workload_types import RequestSpec, Workload

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mooncake_small.jsonl"


def test_trace_arrivals_keep_the_relative_gaps_and_hit_the_mean_rate():
    w = wl.make_workload("mooncake")
    assert w.params["arrival"] == "trace" and fleet_matrix.arrival_of(w) == "trace"
    before = [r.arrival_s for r in w.requests]
    for rate in (5.0, 80.0):
        after = [r.arrival_s for r in serving.with_arrivals(w, rate, "trace").requests]
        assert after[0] == 0.0 and len(after) / (after[-1] - after[0]) == pytest.approx(rate)
        factor = after[-1] / before[-1]  # one factor for every gap: the bursts stay bursts
        assert after == pytest.approx([t * factor for t in before])
    poisson = serving.with_arrivals(w, 5.0, "poisson")  # (a trace stamped otherwise says so)
    assert poisson.params["arrival"] == "poisson" and fleet_matrix.arrival_of(poisson) == "poisson"
    assert LoadConfig(arrival="trace").arrival == "trace"
    with pytest.raises(ValueError, match="poisson, fixed or trace"):
        LoadConfig(arrival="bursty")


def test_trace_arrivals_leave_dependent_turns_waiting_and_refuse_a_workload_without_times():
    reqs = [RequestSpec("a", (1, 2), 1, arrival_s=1.0), RequestSpec("b", (1, 2, 3), 1, arrival_s=9.0, after="a"),
            RequestSpec("c", (4, 5), 1, arrival_s=3.0)]  # fmt: skip
    out = {r.request_id: r for r in serving.with_arrivals(Workload("t", reqs), 2.0, "trace").requests}
    # a and c, 2 s apart in the trace, at 2 req/s (count / span): 1 s apart; b still waits for a (its start)
    assert (out["a"].arrival_s, out["c"].arrival_s, out["b"].arrival_s) == (0.0, 1.0, 0.0) and out["b"].after == "a"
    gsp = wl.generated_shared_prefix(num_groups=2, prompts_per_group=2, system_prompt_len=16, question_len=4, output_len=1)
    with pytest.raises(ValueError, match="every request of workload 'generated-shared-prefix' arrives at 0"):
        serving.with_arrivals(gsp, 1.0, "trace")
    assert fleet_matrix.arrival_of(gsp) == "poisson"  # the generated workloads keep Poisson arrivals


def test_the_mooncake_workload_by_name_honours_scale_and_len_scale(tmp_path):
    records = read_jsonl(FIXTURE)
    full = wl.make_workload("mooncake")
    assert len(full) == 200 and max(r.output_len for r in full.requests) <= 128
    assert full.params["tokens_per_id"] == 64 and full.params["ideal_hit_rate"] == ideal_hit_rate(records, 64)
    quarter = wl.make_workload("mooncake", scale=0.25)  # the first 50 requests, as they were
    assert [r.prompt_token_ids for r in quarter.requests] == [r.prompt_token_ids for r in full.requests[:50]]
    assert quarter.params["ideal_hit_rate"] == ideal_hit_rate(records[:50], 64)
    half = wl.make_workload("mooncake", len_scale=0.5)  # 32 tokens per id: every prompt halved
    assert half.params["tokens_per_id"] == 32 and half.params["ideal_hit_rate"] == ideal_hit_rate(records, 32)
    assert [r.num_prompt_tokens for r in half.requests] == [max(1, round(x["input_length"] / 16)) for x in records]
    assert wl.make_workload("mooncake", len_scale=0.001).params["tokens_per_id"] == 1
    own = tmp_path / "trace.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    mine = wl.make_workload("mooncake", path=str(own), max_output_len=None)
    assert [r.output_len for r in mine.requests] == [x["output_length"] for x in records[:3]]


def test_fleet_matrix_replays_the_trace_in_the_simulator(tmp_path, capsys):
    out = tmp_path / "matrix"
    assert bench(["fleet_matrix", "--sim-only", "--scenarios", "mooncake", "--replicas", "4", "--loads", "0.85",
                  "--routers", "kvroute,prefix_affinity_ray", "--out-dir", str(out)]) == 0  # fmt: skip
    print(capsys.readouterr().out)  # the table: each router's hit beside the trace's ideal
    matrix = json.loads((out / "matrix.json").read_text())
    workload = fleet_matrix.workload_of("mooncake", 1.0, 1.0, 0)
    ideal = ideal_hit_rate(read_jsonl(FIXTURE), 64)
    assert [r["router"] for r in matrix["rows"]] == ["kvroute", "prefix_affinity_ray"]
    for row in matrix["rows"]:
        assert row["arrival"] == "trace" and row["ideal_hit_rate"] == ideal
        assert row["trace_kv_pressure"] >= 1.3 and row["kv_blocks_per_replica"] == fleet_matrix.kv_blocks_of(
            "mooncake", workload, 4, 0)
        assert row["rate"] == pytest.approx(0.85 * row["capacity_rps"], rel=1e-3)
        assert row["completed"] == 200 and row["failed"] == 0
        assert 0.5 < row["hit_rate"] <= best_prefix_cache_hit_rate(workload, 16) + 1e-9
    table = (out / "table.md").read_text()
    assert "| ideal |" in table and f"| {ideal:.3f} |" in table
