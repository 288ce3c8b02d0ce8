"""Pulls in the simulator (``benchmarks/sim/pulls.py``): on the fork workload (sub-agents
released together on a long prefix) the replicas the owner's overflow goes to pull the
prefix instead of recomputing it; the requests that follow a pull to its replica wait
for it; every pulled block is registered and released, and the reuse split counts the
pulled tokens as delivered."""

import dataclasses

from kvroute.benchmarks.sim.replica import SimReplica, SimRequest
from kvroute.benchmarks.sim import pulls
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
from kvroute.benchmarks.workloads import RequestSpec, make_workload, with_poisson_arrivals
from kvroute.replica.block_hash import HashSpec, hash_blocks
from kvroute.replica.profiles import get_profile
from kvroute.replica.scheduler import SchedulerConfig

PROFILE = get_profile("gpu_h100_llama3_8b")


def _run(pull: bool, **policy):
    w = with_poisson_arrivals(make_workload("fork", scale=0.25, len_scale=0.25), 0.5, seed=0)  # 2 forks, 10K prefix
    config = SimConfig(num_replicas=8, kv_blocks=4096, pulls=pull)
    return Simulation(w, "kvroute", PROFILE, config, **policy).run()


def test_the_forks_overflow_pulls_the_prefix_and_its_tail_latency_falls():
    recompute, pulled = _run(False), _run(True)
    assert recompute["completed"] == pulled["completed"] == 2 * 44
    assert recompute["pulls"]["pulls"] == 0 and "pull" not in recompute["reasons"]
    p = pulled["pulls"]
    assert p["pulls"] == pulled["reasons"]["pull"] >= 2 and not p["fallbacks"]
    assert p["pulled_tokens"] == pulled["reuse"]["pulled"] > 0  # counted as reuse delivered
    assert p["pulled_bytes"] == p["pulled_tokens"] * PROFILE.kv_bytes_per_token
    assert pulled["hit_rate"] > recompute["hit_rate"]
    assert pulled["ttft_p90_s"] < 0.5 * recompute["ttft_p90_s"]
    assert pulled["leaked_blocks"] == recompute["leaked_blocks"] == 0
    off = _run(True, pulls=False)  # the policy's switch: replicas that could pull are never asked to
    assert off["pulls"]["pulls"] == 0 and off["ttft_p90_s"] == recompute["ttft_p90_s"]


def test_a_commit_registers_what_the_source_held_and_keeps_what_is_already_there():
    spec = HashSpec(16, 0, "sim")
    sched = SchedulerConfig(8192, 256)
    src, dst = (SimReplica(r, 64, spec, PROFILE, sched) for r in ("a", "b"))
    tokens = list(range(100, 100 + 16 * 10))
    hashes = hash_blocks(spec, tokens)
    blocks = src.kv.pool.take_new_blocks(10)
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        src.kv.pool.cache_block(b, h, tokens[16 * i : 16 * (i + 1)], hashes[i - 1] if i else None)
    src.kv.pool.free(reversed(blocks))
    run = pulls.lease(src, hashes, 8)
    assert len(run.blocks) == 8 and pulls.missing(dst, run) == 8
    short = dataclasses.replace(run, blocks=run.blocks[:3])
    assert pulls.commit(dst, short) == 3 and pulls.missing(dst, run) == 5
    assert pulls.commit(dst, run) == 8  # the first three kept, five registered
    assert dst.true_match(hashes) == 8 and all(c == 0 for c in dst.block_ref_counts())
    assert dst.kv.pool.cached_block(hashes[7]).parent_hash == hashes[6]



def test_a_simulated_replica_reports_a_committed_pull_taken_while_its_request_waits():
    """After a commit the pulled blocks are cached and free in the pool, but the
    request queued for them will take them: the replica's load figures count them as
    used from its queueing until it has run (the same telemetry as the engine's)."""
    spec = HashSpec(16, 0, "sim")
    src, dst = (SimReplica(r, 64, spec, PROFILE, SchedulerConfig(8192, 256)) for r in ("a", "b"))
    tokens = list(range(100, 100 + 16 * 10 + 4))  # 10 full blocks + 4 tokens
    hashes = hash_blocks(spec, tokens)
    blocks = src.kv.pool.take_new_blocks(10)
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        src.kv.pool.cache_block(b, h, tokens[16 * i : 16 * (i + 1)], hashes[i - 1] if i else None)
    src.kv.pool.free(reversed(blocks))
    assert pulls.commit(dst, pulls.lease(src, hashes, 10)) == 10

    def free() -> int:
        return round((1 - dst.load().kv_usage) * 64)

    assert free() == dst.kv.pool.num_free_blocks == 64
    spec_ = RequestSpec("q", tuple(tokens), output_len=2)
    for rid in ("q", "r"):  # two requests of the prefix: its blocks are counted once
        spec_ = dataclasses.replace(spec_, request_id=rid)
        dst.add(SimRequest(spec_, dst.make_request(spec_, hashes, 0.0), 0.0, "b", 160, "pull"))
    assert free() == 64 - 10 and dst.load().queued_prefill_tokens == 2 * 4  # each computes its last 4
    now = 0.0
    while dst.has_work():
        now += dst.start_step()
        dst.finish_step(now)
    assert free() == dst.kv.pool.num_free_blocks == 64 and dst.true_match(hashes) == 10


def _scale_out(warmup: int) -> dict:
    w = with_poisson_arrivals(make_workload("generated-shared-prefix", scale=0.25), 8.0, seed=1)  # 16 groups x 16
    config = SimConfig(num_replicas=4, kv_blocks=8192, pulls=True, joining_replicas=1, join_at_s=8.0,
                       warmup_prefixes=warmup)  # fmt: skip
    return Simulation(w, "kvroute", PROFILE, config).run()


def test_a_joining_replica_that_warms_up_takes_its_share_at_the_fleets_hit_rate():
    cold, warm = _scale_out(0), _scale_out(8)
    assert cold["completed"] == warm["completed"] == 256
    j = warm["joined"]
    assert j["share"] > cold["joined"]["share"] + 0.1  # it holds hot prefixes: the router gives it a share at once
    assert j["hit_rate"] >= 0.8 * j["fleet_hit_rate"]
    assert warm["leaked_blocks"] == 0
