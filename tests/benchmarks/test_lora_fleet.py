"""The LoRA fleet benchmark (benchmarks/lora_fleet.py) at a small size: its workload,
its one summary line and its JSON."""

from __future__ import annotations

import json

import pytest

from kvroute.benchmarks.lora_fleet import lora_zipf, main
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
    assert main(["--replicas", "4", "--adapters", "8", "--max-loras", "2", "--requests", "160", "--system-prompt-len",
                 "256", "--question-len", "32", "--output-len", "16", "--out", str(out)]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("lora_fleet (simulated, gpu_h100_llama3_8b): 4 replicas, 8 adapters")
    data = json.loads(out.read_text())
    assert data["simulated"] and set(data["results"]) == {"kvroute", "power_of_two", "prefix_affinity_ray", "cache_aware_vllm"}
    for r in data["results"].values():
        assert r["completed"] == 160 and r["leaked_blocks"] == 0 and r["adapter_loads"] >= 8  # each adapter once at least
    assert data["comparison"]["p90_ratio"] > 0 and data["adapter_load_s"] == pytest.approx(COST.adapter_load_time(16))
