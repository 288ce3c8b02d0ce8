"""benchmarks/kv_event_decode: every scenario is a clean vLLM stream (no orphans, no
unknown removals, nothing unsupported: ``one_pass`` checks) and the figures add up."""

from __future__ import annotations

import argparse

from kvroute.benchmarks import kv_event_decode as bench


def test_every_scenario_is_a_clean_stream_and_is_measured():
    args = argparse.Namespace(block_size=16, batches=60, reps=1, scenarios=",".join(bench.SCENARIOS), routers=2, seed=0,
                              fixture=bench.FIXTURE)
    out = bench.measure(args)
    assert set(out) == set(bench.SCENARIOS)
    for name, r in out.items():
        assert r["blocks"] >= r["events"] > 0 and r["batches"] > 0, name
        assert r["total_us_per_block"] > 0 and r["feed_us_per_block"] > 0, name
    mixed = bench.build("mixed", 60, 16, 0)
    assert mixed["warm"] and mixed["events"] > 60  # filled first, then a removal and stores per batch
    assert bench.build("stored", 5, 16, 1)["timed"] != bench.build("stored", 5, 16, 0)["timed"]
