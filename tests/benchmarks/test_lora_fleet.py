"""The LoRA fleet benchmark (benchmarks/lora_fleet.py) at a small size: its workload,
its one summary line and its JSON."""

from __future__ import annotations

import json

import pytest

from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks.workloads import lora_zipf
from kvroute.replica.profiles import get_profile

COST = get_profile("gpu_h100_llama3_8b")


def test_lora_zipf_names_adapters_by_popularity():
    w = lora_zipf(num_adapters=8, num_requests=200, system_prompt_len=32, question_len=8, output_len=4)
    counts = {}
    for r in w.requests:
        assert r.lora_name == f"lora-{r.group_id}" and r.num_prompt_tokens == 40
        counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    assert max(counts, key=counts.get) == "lora-0"


def test_benchmark_prints_a_line_and_writes_json(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert bench(["lora_fleet", "--replicas", "4", "--adapters", "8", "--max-loras", "2", "--requests", "160", "--system-prompt-len",
                 "256", "--question-len", "32", "--output-len", "16", "--out", str(out)]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("lora_fleet (simulated, gpu_h100_llama3_8b): 4 replicas, 8 adapters")
    data = json.loads(out.read_text())
    assert data["simulated"] and set(data["results"]) == {"kvroute", "power_of_two", "prefix_affinity_ray", "cache_aware_vllm"}
    for r in data["results"].values():
        assert r["completed"] == 160 and r["leaked_blocks"] == 0 and r["adapter_loads"] >= 8  # each adapter once at least
    assert data["comparison"]["p90_ratio"] > 0 and data["adapter_load_s"] == pytest.approx(COST.adapter_load_time(16))


def test_emulated_fleet_counts_adapter_loads_for_kvroute_and_vllm_router(ray_cluster, tiny_llama_path, tmp_path, capsys):
    """The emulated mode end to end, small: kvroute's Serve app and the real vllm-router
    in front of serve-replica processes, two emulated replicas each with every adapter;
    both serve the whole trace and the replicas' own counters see the slot loads."""
    pytest.importorskip("vllm_router", reason="pip install -e .[test] installs vllm-router")
    port = ray_cluster.rsplit(":", 1)[1]
    out = tmp_path / "lora.json"
    rc = bench(["lora_fleet", "--emulate", "gpu_h100_llama3_8b", "--time-scale", "10", "--model", str(tiny_llama_path), "--replicas", "2",
               "--adapters", "4", "--max-loras", "1", "--requests", "24", "--system-prompt-len", "64", "--question-len", "16",
               "--output-len", "4", "--load", "0.5", "--routers", "kvroute,vllm_router", "--app-name", "lorabench",
               "--http-port", port, "--num-cpus-per-replica", "0.5", "--timeout-s", "300", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, printed[-5:]
    assert printed[-1].startswith("lora_fleet (emulated x10, gpu_h100_llama3_8b): 2 replicas, 4 adapters")
    data = json.loads(out.read_text())
    assert not data["simulated"] and list(data["results"]) == ["kvroute", "vllm_router"]
    assert data["results"]["kvroute"]["fleet"] == "serve" and data["results"]["vllm_router"]["fleet"] != "serve"
    for r in data["results"].values():
        assert r["completed"] == 24 and r["errors"] == 0
        # one slot per replica, four adapters on two replicas: each is loaded once at least
        assert r["adapter_loads"] >= 4 and r["adapter_loads_per_1k"] == pytest.approx(1000 * r["adapter_loads"] / 24)
    adapters = tmp_path / "lora" / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == [f"lora-{g}" for g in range(4)]
