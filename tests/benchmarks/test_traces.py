"""Mooncake-format traces (benchmarks/traces.py): ids become shared token blocks, time
compression keeps the bursts, the infinite-cache hit rate, and a replay in the simulator."""

import json
from pathlib import Path

import pytest

from kvroute.benchmarks.sim.capacity import ideal_cache
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.benchmarks.traces import ideal_hit_rate, load_mooncake, read_jsonl, synthetic_mooncake
from kvroute.replica.profiles import get_profile

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mooncake_small.jsonl"
TRACE = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 1010, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 9]},
    {"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [7, 2]},
]


def test_equal_ids_are_equal_blocks_and_lengths_scale_with_tokens_per_id():
    w = load_mooncake(TRACE, tokens_per_id=64)
    a, b, c = (r.prompt_token_ids for r in w.requests)
    assert [len(x) for x in (a, b, c)] == [188, 138, 75]  # input_length x 64 / 512, rounded
    assert a[:128] == b[:128] and a[128:138] != b[128:138]  # ids 1, 2 shared; 3 and 9 differ
    assert c[64:75] == a[64:75] and c[:64] != a[:64]  # id 2 is one content wherever it sits
    assert len(load_mooncake(TRACE).requests[0].prompt_token_ids) == 1500


def test_compression_divides_the_timestamps_and_keeps_the_bursts():
    one, four = load_mooncake(TRACE), load_mooncake(TRACE, compression=4.0)
    assert [r.arrival_s for r in one.requests] == pytest.approx([0.0, 0.010, 2.0])
    assert [r.arrival_s for r in four.requests] == pytest.approx([0.0, 0.0025, 0.5])
    with pytest.raises(ValueError, match="compression > 0"):
        load_mooncake(TRACE, compression=0)


def test_ideal_hit_rate_counts_leading_ids_seen_whole():
    # request 2 reuses ids 1, 2 (1024 tokens); request 3 starts with id 7: nothing
    assert ideal_hit_rate(TRACE) == pytest.approx(1024 / (1500 + 1100 + 600))
    partial = [{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]},
               {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}]  # fmt: skip
    assert ideal_hit_rate(partial) == pytest.approx(512 / 1800)  # id 2 was seen only in part


def test_the_fixture_is_the_generators_output_and_bursty():
    assert read_jsonl(FIXTURE) == json.loads(json.dumps(synthetic_mooncake(200, seed=0)))
    gaps = sorted(b["timestamp"] - a["timestamp"] for a, b in zip(read_jsonl(FIXTURE), read_jsonl(FIXTURE)[1:]))
    assert gaps[len(gaps) // 2] <= 5 and gaps[-1] >= 400  # most within a burst, some long pauses
    assert 0.5 < ideal_hit_rate(read_jsonl(FIXTURE)) < 0.9


@pytest.mark.parametrize("policy", ["kvroute", "prefix_affinity_ray"])
def test_a_trace_replays_in_the_simulator(policy):
    w = load_mooncake(FIXTURE, tokens_per_id=32, max_output_len=16, compression=4.0)
    uncached, _ = ideal_cache(w, 16)
    ideal = 1 - sum(uncached) / w.prompt_tokens
    assert ideal == pytest.approx(ideal_hit_rate(read_jsonl(FIXTURE), 32), abs=0.02)
    m = Simulation(w, policy, get_profile("gpu_h100_llama3_8b"), SimConfig(num_replicas=4, kv_blocks=256)).run()
    assert m["completed"] == 200 and m["leaked_blocks"] == 0
    assert 0.2 < m["hit_rate"] <= ideal + 1e-9
