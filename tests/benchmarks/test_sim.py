"""The policy simulator and the workload generators (CPU, fast)."""

import dataclasses
import json
import statistics

import pytest

from kvroute.benchmarks.cli import main as bench
from kvroute.benchmarks import workloads as W

pytest.importorskip("kvroute.router.router", reason="router not built yet")

from kvroute.replica.profiles import cpu_measured, gpu_h100_llama3_8b  # noqa: E402
from kvroute.benchmarks.sim.capacity import estimate_capacity  # noqa: E402
from kvroute.benchmarks.sim.simulator import SimConfig, Simulation  # noqa: E402

CFG = SimConfig(num_replicas=3, kv_blocks=256, block_size=16, max_num_batched_tokens=512, max_num_seqs=32)


def small_gsp(seed=0):
    wl = W.generated_shared_prefix(4, 8, 128, 16, 8, seed=seed)
    return W.with_poisson_arrivals(wl, rate=40.0, seed=seed)


def run(policy, wl=None, cfg=CFG):
    return Simulation(wl or small_gsp(), policy, gpu_h100_llama3_8b(), cfg).run()


@pytest.mark.parametrize("policy", ["kvroute", "round_robin", "power_of_two", "oracle"])
def test_deterministic_for_fixed_seed(policy):
    a, b = run(policy), run(policy)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("policy", ["kvroute", "round_robin", "oracle", "cache_aware_vllm"])
def test_counts_add_up_and_no_block_leaks(policy):
    wl = small_gsp()
    m = run(policy, wl)
    assert m["completed"] == m["num_requests"] == len(wl) == 32
    assert m["output_tokens"] == wl.output_tokens
    assert m["prompt_tokens"] == wl.prompt_tokens
    assert m["leaked_blocks"] == 0
    assert sum(m["requests_per_replica"].values()) == 32
    assert 0 <= m["hit_rate"] <= 1 and m["ttft_p50_s"] > 0


@pytest.mark.parametrize("policy", ["kvroute", "round_robin", "cache_aware_sglang"])
def test_a_joining_replica_takes_requests_only_after_it_joins(policy):
    wl = small_gsp()
    join_at = sorted(r.arrival_s for r in wl.requests)[len(wl) // 2]
    sim = Simulation(wl, policy, gpu_h100_llama3_8b(), dataclasses.replace(CFG, joining_replicas=1, join_at_s=join_at))
    m = sim.run()
    assert m["completed"] == len(wl) and m["leaked_blocks"] == 0
    assert all(s.replica_id != "r2" for s in sim.done if s.arrival_s < join_at)
    if policy == "round_robin":  # it does get work once it is there
        assert any(s.replica_id == "r2" for s in sim.done)
    with pytest.raises(ValueError, match="joining_replicas"):
        SimConfig(num_replicas=2, joining_replicas=2)


class _Watched(Simulation):
    """Records what the failing replicas held just before they died."""

    def _fail(self, replica_ids):
        self.dead = {rid: (self.replicas[rid], len(self.replicas[rid].requests)) for rid in replica_ids}
        super()._fail(replica_ids)


@pytest.mark.parametrize("policy", ["kvroute", "round_robin", "cache_aware_vllm"])
def test_a_failing_replica_comes_back_empty_and_its_requests_are_routed_again(policy):
    wl = W.with_poisson_arrivals(W.generated_shared_prefix(4, 8, 128, 16, 64, seed=0), rate=200.0, seed=0)
    t = sorted(r.arrival_s for r in wl.requests)
    fail_at = (t[len(t) // 2] + t[len(t) // 2 + 1]) / 2
    sim = _Watched(wl, policy, gpu_h100_llama3_8b(), dataclasses.replace(CFG, failing_replicas=1, fail_at_s=fail_at))
    m = sim.run()
    old, held = sim.dead["r0"]
    assert held > 0 and old.kv.cached_block_hashes(), "the failure must hit a replica with work and a cache"
    assert sim.replicas["r0"] is not old and sorted(sim.router.replicas()) == ["r0", "r1", "r2"]
    assert m["retried"] == held  # every request it held was routed again ...
    assert m["completed"] == len(wl) and m["output_tokens"] == wl.output_tokens  # ... and finished once
    assert m["leaked_blocks"] == 0
    retried = [s for s in sim.done if s.request.arrival_time == fail_at]
    assert len(retried) == held and all(s.arrival_s < fail_at for s in retried)  # TTFT counts the loss
    with pytest.raises(ValueError, match="failing_replicas"):
        SimConfig(num_replicas=3, joining_replicas=1, failing_replicas=3)


def test_oracle_hits_at_least_round_robin():
    assert run("oracle")["hit_rate"] >= run("round_robin")["hit_rate"]


def test_reuse_figures_account_for_every_prompt_token():
    """Decision quality per run: delivered is the hit count; round robin gives up reuse
    the directory offered (routing loss), kvroute almost none; the parts add up."""
    for policy in ("kvroute", "round_robin"):
        m = run(policy)
        r = m["reuse"]
        assert r["requests"] == m["completed"] and r["offered"] == m["prompt_tokens"]
        assert r["delivered"] == m["cached_tokens"] and r["available"] >= r["captured"]
        over = r["delivered"] - (r["captured"] - r["stale"])  # delivered beyond the expectation
        assert r["offered"] == r["delivered"] + r["cold"] + sum(r["routing"].values()) + r["stale"] - over
    assert run("round_robin")["reuse"]["routing_share"] > 0.1 > 0.02 > run("kvroute")["reuse"]["routing_share"]


def test_multi_turn_runs_closed_loop():
    wl = W.with_poisson_arrivals(W.multi_turn(num_conversations=3, len_scale=0.1, seed=1), rate=5.0)
    m = Simulation(wl, "kvroute", gpu_h100_llama3_8b(), CFG).run()
    assert m["completed"] == len(wl) and m["leaked_blocks"] == 0
    assert m["hit_rate"] > 0.5  # each turn's history is cached from the previous turn


def test_capacity_estimate_and_cost_models():
    wl = W.generated_shared_prefix(4, 8, 128, 16, 8)
    cap = estimate_capacity(wl, gpu_h100_llama3_8b(), CFG)
    assert cap["capacity_rps"] > 0
    # 4 groups of 8: every prompt but each group's first hits its 128-token prefix.
    assert cap["ideal_hit_rate"] == pytest.approx(28 * 128 / (32 * 144))
    cpu = cpu_measured()
    assert cpu.prefill_tokens_per_s > 0 and cpu.step_time(0, 1) > 0


def test_capacity_counts_shared_prefixes_once_per_fleet():
    """A KV-bound fleet: the 8 prefixes of 2,048 tokens stay resident (one replica's
    cache each, 2 per replica), and a running request adds only its own 128 + 64
    tokens; counting each whole context instead would fit 4x fewer."""
    from dataclasses import replace

    wl = W.generated_shared_prefix(8, 8, 2048, 128, 128)
    cfg = replace(CFG, num_replicas=4, kv_blocks=1024, max_num_seqs=256)  # 16,384 tokens per replica
    cap = estimate_capacity(wl, gpu_h100_llama3_8b(), cfg)
    # resident: 8 x 2,048 / 4 = 4,096 tokens; own: mean uncached (1/8 of requests compute
    # 2,176, the rest 128) + 64
    own = (2176 + 7 * 128) / 8 + 64
    assert cap["decode_batch"] == int((16384 - 4096) / own) > 16384 // (2176 + 64)
    # prefixes past half the cache: each request counted whole
    tight = estimate_capacity(wl, gpu_h100_llama3_8b(), replace(cfg, kv_blocks=500))  # 4,096 > 8,000 / 2
    assert tight["decode_batch"] == int(500 * 16 / (2176 + 64))


# ---------------------------------------------------------------------- workloads
def test_generated_shared_prefix_shape():
    wl = W.generated_shared_prefix(seed=3)
    assert len(wl) == 64 * 16 and wl.num_groups == 64
    assert {r.num_prompt_tokens for r in wl.requests} == {2048 + 128}
    assert {r.output_len for r in wl.requests} == {256}
    by_group = {}
    for r in wl.requests:
        by_group.setdefault(r.group_id, []).append(r)
    assert len(by_group) == 64 and all(len(v) == 16 for v in by_group.values())
    for v in by_group.values():
        assert len({r.prompt_token_ids[:2048] for r in v}) == 1
        assert len({r.prompt_token_ids[2048:] for r in v}) == 16
    assert [r.group_id for r in wl.requests] != sorted(r.group_id for r in wl.requests)  # shuffled
    again = W.generated_shared_prefix(seed=3)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]


def test_seed_cases_b2b_and_scaling():
    hi, lo = W.high_hit(scale=0.125), W.low_hit(scale=0.125)
    assert {r.num_prompt_tokens for r in hi.requests} == {3128} and {r.num_prompt_tokens for r in lo.requests} == {3128}
    assert hi.shared_prefix_tokens == 3000 and lo.shared_prefix_tokens == 128
    b = W.b2b()
    assert len(b) == 750 and b.num_groups == 150
    assert {r.num_prompt_tokens for r in b.requests} == {7200} and {r.output_len for r in b.requests} == {1000}
    s = W.b2b(scale=0.1, len_scale=0.5)
    assert len(s) == 15 * 5 and {r.num_prompt_tokens for r in s.requests} == {3600}


def test_zipf_popularity():
    wl = W.zipf_groups(seed=0)
    assert len(wl) == 1024
    counts = [0] * 64
    for r in wl.requests:
        counts[r.group_id] += 1
    p = W.zipf_weights(64, 1.1)
    assert counts[0] == max(counts)
    assert abs(counts[0] / 1024 - p[0]) < 0.05  # the hottest group gets ~21%


def test_poisson_mean_interarrival():
    t = W.poisson_arrivals(4000, rate=20.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert W.rate_sweep(100.0) == pytest.approx([50.0, 70.0, 85.0, 95.0])
    with pytest.raises(ValueError):
        W.poisson_arrivals(3, 0.0)


def test_multi_turn_history_is_a_prefix():
    wl = W.multi_turn(seed=2)
    assert len({r.session_id for r in wl.requests}) == 24
    convs = {}
    for r in wl.requests:
        convs.setdefault(r.session_id, []).append(r)
    common = wl.requests[0].prompt_token_ids[:500]
    for turns in convs.values():
        assert 6 <= len(turns) <= 9
        assert turns[0].after is None
        for prev, cur in zip(turns, turns[1:]):
            assert cur.after == prev.request_id
            history = prev.prompt_token_ids + prev.output_token_ids
            assert cur.prompt_token_ids[: len(history)] == history
            assert 120 <= cur.num_prompt_tokens - len(history) <= 160
            assert 80 <= cur.output_len <= 120 and len(cur.output_token_ids) == cur.output_len
        assert turns[0].prompt_token_ids[:500] == common
    timed = W.with_poisson_arrivals(wl, rate=2.0)
    firsts = [r.arrival_s for r in timed.requests if r.after is None]
    assert len(firsts) == 24 and firsts == sorted(firsts)


def test_decode_aware_kvroute_spreads_a_hot_prefix():
    """One very hot prefix (Zipf s=3: 136 of 160 requests): without the batch rule its
    owner's decode batch takes everything; with it the prefix replicates, one replica
    at a time, and the run finishes sooner (1.25x the output throughput with the H100
    constants measured for the cost model, whose decode cost per sequence is small next
    to the step's weight read); the TTFT tail pays at most the replicated prefix's
    prefill on a new replica."""
    cfg = SimConfig(num_replicas=4, kv_blocks=2048, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)
    wl = W.zipf_groups(num_groups=4, num_requests=160, system_prompt_len=512, question_len=16, output_len=128, s=3.0)
    wl = W.with_poisson_arrivals(wl, rate=300.0)
    assert sum(r.group_id == 0 for r in wl.requests) == 136

    def hot_replicas(**kw):
        sim = Simulation(wl, "kvroute", gpu_h100_llama3_8b(), cfg, **kw)
        m = sim.run()
        per = {}
        for s in sim.done:
            if s.spec.group_id == 0:
                per[s.replica_id] = per.get(s.replica_id, 0) + 1
        return m, per

    m, per = hot_replicas()
    unbounded, per_unbounded = hot_replicas(batch_slack_abs=10**6)
    assert list(per_unbounded.values()) == [136] and unbounded["reasons"] == {"cold": 3, "prefix": 157}
    # the hot prefix spills to other replicas (the batch limit is relative to the mean
    # queue, so once it runs on three the spread is within it); each then serves as an owner
    assert len(per) >= 3 and sum(per.values()) == 136
    assert m["reasons"]["cold"] == 3 and m["reasons"]["hot_prefix_replica"] == len(per) - 1
    assert m["output_tokens_per_s"] > 1.2 * unbounded["output_tokens_per_s"]
    cost = gpu_h100_llama3_8b()
    assert m["ttft_p99_s"] <= unbounded["ttft_p99_s"] + 512 / cost.prefill_tokens_per_s
    assert m["leaked_blocks"] == 0 and m["completed"] == 160


def test_fleet_matrix_sim_only_fills_every_cell_without_a_cluster(tmp_path, capsys):
    from kvroute.benchmarks import fleet_matrix

    scenarios, routers, loads = ["gsp", "failure", "scale-out"], ["kvroute", "power_of_two", "vllm_router"], [0.6, 1.2]
    argv = ["--sim-only", "--replicas", "4", "--scenarios", ",".join(scenarios), "--loads", ",".join(map(str, loads)),
            "--routers", ",".join(routers), "--scale", "0.05", "--len-scale", "0.2", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench(["fleet_matrix", *argv]) == 0
    assert "fleet_matrix (simulated): 3 scenarios x 3 routers, 18 runs, 0 errors (0 kvroute's)" in capsys.readouterr().out
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert matrix["sim_only"] is True
    cells = {(r["scenario"], r["load"], r["router"]) for r in matrix["rows"]}
    assert cells == {(s, x, r) for s in scenarios for x in loads for r in routers}
    for row in matrix["rows"]:
        n = len(fleet_matrix.workload_of(row["scenario"], 0.05, 0.2, 0))
        assert row["completed"] == n and row["failed"] == 0 and 0 < row["hit_rate"] < 1
        assert row["ttft_median_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert row["rate"] == pytest.approx(row["load"] * row["capacity_rps"], rel=1e-3)
    assert len(matrix["targets"]) == len(scenarios) * len(loads)


def test_routers_that_share_decisions_place_like_one_and_independent_ones_do_not():
    """Four routers taking the arrivals in turn: sharing their decisions at once, they
    keep one router's hit rate; never sharing (how the peers' routers scale), each sends
    a new group's burst wherever its own view says, and hits fall. (At 200 requests/s
    even independent routers keep it: ties between idle replicas go by the first block
    hash, so they agree on where a new group goes.)"""
    from dataclasses import replace

    wl = W.with_poisson_arrivals(W.generated_shared_prefix(8, 8, 256, 16, 8, seed=1), rate=1000.0, seed=1)
    one = run("kvroute", wl)
    shared = run("kvroute", wl, replace(CFG, num_routers=4))
    lagged = run("kvroute", wl, replace(CFG, num_routers=4, peer_delay_s=0.002))
    alone = run("kvroute", wl, replace(CFG, num_routers=4, peer_delay_s=-1))
    for m in (shared, lagged, alone):
        assert m["completed"] == len(wl) and m["leaked_blocks"] == 0
    assert shared["hit_rate"] >= 0.98 * one["hit_rate"] and lagged["hit_rate"] >= 0.98 * one["hit_rate"]
    assert alone["reuse"]["routing_share"] + alone["reuse"]["stale_share"] > shared["reuse"]["routing_share"] + shared["reuse"]["stale_share"]


def test_every_ingress_asks_the_first_router_and_spills_only_when_it_falls_behind():
    """``router_choice="first"`` (kvroute's ingresses): below one router's capacity every
    decision is the first router's, so four routers place exactly like one; past it
    (2 ms a decision, 1,000 requests/s) the ingress passes over a router with 2 of its
    decisions waiting, the four share the work, and the wait for a decision stays short
    where one router's queue grows with the run."""
    from dataclasses import replace

    base = W.generated_shared_prefix(8, 8, 256, 16, 8, seed=1)
    slow = W.with_poisson_arrivals(base, rate=100.0, seed=1)
    one = run("kvroute", slow, replace(CFG, router_decision_s=0.001))
    first = run("kvroute", slow, replace(CFG, num_routers=4, router_choice="first", router_decision_s=0.001))
    assert first["decisions_per_router"] == [len(slow), 0, 0, 0] and first["router_spills"] == 0
    assert first["hit_rate"] == one["hit_rate"] and first["ttft_p90_s"] == one["ttft_p90_s"]

    fast = W.with_poisson_arrivals(base, rate=1000.0, seed=1)
    cfg = replace(CFG, router_decision_s=0.002, num_ingresses=1, spill_at=2)
    alone = run("kvroute", fast, cfg)
    shared = run("kvroute", fast, replace(cfg, num_routers=4, router_choice="first"))
    assert shared["router_spills"] > 0 and all(n > 0 for n in shared["decisions_per_router"])
    assert shared["completed"] == len(fast) and shared["leaked_blocks"] == 0
    assert shared["ttft_p90_s"] < 0.5 * alone["ttft_p90_s"]


def test_a_bad_router_choice_is_refused():
    from dataclasses import replace

    with pytest.raises(ValueError, match="router_choice"):
        replace(CFG, router_choice="random")


def test_many_ingresses_pass_over_a_router_that_reports_itself_busy():
    """16 ingresses, 4 calls in flight each before they pass a router over: the first
    router would queue 64 decisions (128 ms at 2 ms each) before any ingress saw it
    behind. Its load report (its share of the last 0.1 s spent deciding) turns them to
    the next router once it passes 0.8."""
    from dataclasses import replace

    fast = W.with_poisson_arrivals(W.generated_shared_prefix(16, 16, 256, 16, 8, seed=1), rate=1000.0, seed=1)
    cfg = replace(CFG, router_decision_s=0.002, num_ingresses=16)
    alone = run("kvroute", fast, cfg)
    shared = run("kvroute", fast, replace(cfg, num_routers=4, router_choice="first"))
    assert shared["router_spills"] > 0 and sum(n > 0 for n in shared["decisions_per_router"]) >= 2
    assert shared["ttft_p90_s"] < 0.5 * alone["ttft_p90_s"]
