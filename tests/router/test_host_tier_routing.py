"""The router and the host tier: the directory records each replica's host-tier blocks
from its events, prices a host hit at its copy time, and equals the union of the
replicas' caches per tier after a simulated run."""

from __future__ import annotations

from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router.directory import BlockDirectory
from kvroute.router.router import Router

H = list(range(1, 21))  # a 20-block prompt's hashes


def test_the_directory_keeps_a_host_index_per_replica():
    d = BlockDirectory()
    d.add_replica("a", 100, host_capacity_blocks=4)
    d.add_replica("b", 100)
    assert d.apply("a", 1, [1, 2], [], False, host_stored=[3, 4, 5], host_removed=[])
    sel = d.select(["a", "b"])
    depths = d.match_depths([1, 2, 3, 4, 5, 6], sel)
    assert depths == [2, 0]
    assert d.host_depths([1, 2, 3, 4, 5, 6], sel, depths) == [3, 0]
    # host-tier LRU bound (4) and removals
    assert d.apply("a", 2, [], [], False, host_stored=[6, 7], host_removed=[3])
    assert d.host_confirmed("a") == [4, 5, 6, 7]
    assert d.apply("a", 3, [], [], False, host_stored=[8], host_removed=[])
    assert d.host_confirmed("a") == [5, 6, 7, 8]  # bounded by the host capacity, oldest out
    # a snapshot replaces both tiers; cleared empties both
    d.apply_snapshot("a", [1], 5, host_hashes=[2, 3])
    assert d.confirmed("a") == [1] and d.host_confirmed("a") == [2, 3]
    assert d.apply("a", 6, [], [], True)
    assert d.confirmed("a") == [] and d.host_confirmed("a") == []
    assert d.host_depths([1, 2], d.select(["a", "b"]), [0, 0]) is None  # nobody has a host entry
    d.remove_replica("a")
    assert "a" not in d


def _router_with(host_rate: float) -> Router:
    r = Router("kvroute", 16)
    load = LoadFigures(prefill_tokens_per_s=10_000.0, decode_step_s=0.02, host_restore_tokens_per_s=host_rate)
    for rid in ("dev", "host", "cold"):
        r.add_replica(rid, 10_000, host_capacity_blocks=10_000)
    r.apply(KVEvents("dev", 1, stored=H, load=load))
    r.apply(KVEvents("host", 1, host_stored=H, load=load))
    r.apply(KVEvents("cold", 1, load=load))
    return r


def test_a_host_hit_is_priced_between_a_device_hit_and_a_recompute():
    r = _router_with(host_rate=100_000.0)
    table = r.candidate_table(H, None)
    assert list(table.depth) == [20, 0, 0] and list(table.host_depth) == [0, 20, 0]
    d = r.route(H, 20 * 16 + 5)
    assert d.replica_id == "dev" and d.reason == "prefix"
    # with the device owner busy, the host owner wins over the cold replica, and the
    # router expects every host-tier token to come back cached
    r2 = _router_with(host_rate=100_000.0)
    busy = LoadFigures(num_waiting=4, queued_prefill_tokens=50_000, prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
    r2.apply(KVEvents("dev", 2, load=busy))
    d2 = r2.route(H, 20 * 16 + 5)
    assert d2.replica_id == "host" and d2.expected_cached_tokens == 20 * 16


def test_a_slow_host_tier_is_not_worth_a_restore():
    r = _router_with(host_rate=1_000.0)  # 10x slower than recomputing
    busy = LoadFigures(num_waiting=4, queued_prefill_tokens=50_000, prefill_tokens_per_s=10_000.0, decode_step_s=0.02)
    r.apply(KVEvents("dev", 2, load=busy))
    assert r.route(H, 20 * 16 + 5).replica_id == "cold"


def test_the_directory_equals_the_replicas_caches_per_tier_after_a_run():
    from kvroute.benchmarks import workloads as W
    from kvroute.benchmarks.sim.simulator import SimConfig, Simulation
    from kvroute.replica.profiles import gpu_h100_llama3_8b

    wl = W.with_poisson_arrivals(W.generated_shared_prefix(12, 6, 256, 32, 8, seed=1), rate=60.0, seed=1)
    cfg = SimConfig(num_replicas=3, kv_blocks=64, block_size=16, max_num_batched_tokens=512, max_num_seqs=16,
                    host_kv_blocks=256)  # fmt: skip
    sim = Simulation(wl, "kvroute", gpu_h100_llama3_8b(), cfg)
    m = sim.run()
    assert m["completed"] == len(wl) and m["leaked_blocks"] == 0
    assert m["host_hit_rate"] > 0  # the device caches were too small: prefixes came back from the host tier
    for rid, rep in sim.replicas.items():
        assert set(sim.router.directory.confirmed(rid)) == set(rep.kv.cached_block_hashes())
        assert set(sim.router.directory.host_confirmed(rid)) == set(rep.kv.host_block_hashes())
    without = Simulation(wl, "kvroute", gpu_h100_llama3_8b(), SimConfig(**{**cfg.__dict__, "host_kv_blocks": 0})).run()
    assert m["hit_rate"] > without["hit_rate"]
    assert m["pred_cached_err"] < 0.02  # the router expects both tiers' tokens cached
