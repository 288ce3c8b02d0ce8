"""The host tier of the KV cache: offload on eviction, restore on a host hit, exact
block and event state, no leak in either tier, and outputs identical with it on and off."""

from __future__ import annotations

import pytest

from kvroute.replica.block_hash import HashSpec
from kvroute.replica.host_tier import HostTier
from kvroute.replica.kv_cache_manager import HostHit, KVCacheManager
from kvroute.replica.outputs import RequestId
from kvroute.replica.request import Request
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.scheduler import Scheduler, SchedulerConfig

BS = 4
SPEC = HashSpec(BS, 0, "test")


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=4), SPEC)


# ---------------------------------------------------------------------- HostTier
def test_host_tier_lru_pins_and_net_events():
    t = HostTier(2)
    assert t.offload(1, (1,)) == 0 and t.offload(2, (2,)) == 1
    assert t.offload(1, (1,)) is None  # already held: touched, no copy
    assert t.offload(3, (3,)) == 1  # evicts 2, the least recently used
    assert t.cached_block_hashes() == [1, 3]
    assert t.lookup(3, (3,)) == 1 and t.lookup(3, (9,)) is None and t.lookup(2, (2,)) is None
    stored, removed, cleared = t.take_events()
    assert sorted(stored) == [1, 3] and removed == [] and not cleared  # 2 came and went: cancels out
    t.pin(1)
    t.pin(3)
    assert t.offload(4, (4,)) is None  # every block pinned: nothing to give
    t.unpin_all()
    assert t.offload(4, (4,)) == 0  # 1 was pinned (touched) before 3, so it is the older
    assert t.take_events() == ([4], [1], False)
    t.reset()
    assert len(t) == 0 and t.take_events() == ([], [], True)
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(0)


# ---------------------------------------------------------------------- KV cache manager
def _admit(kv: KVCacheManager, req: Request) -> list:
    hits, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits) is not None
    return hits


def test_evict_offload_hit_restore_sequence_is_exact():
    kv = KVCacheManager(4, BS, host_blocks=8)
    a = _req("a", list(range(13)))  # 3 full blocks + 1 token: 4 blocks
    _admit(kv, a)
    assert kv.take_copies().offloads == [] and len(kv.cached_block_hashes()) == 3
    assert len(kv.take_events()[0]) == 3 and kv.take_host_events() == ([], [], False)
    kv.free(a)
    b = _req("b", list(range(100, 113)))  # needs all 4 blocks: evicts a's 3 cached ones
    _admit(kv, b)
    plan = kv.take_copies()
    a_hashes = a.update_block_hashes()[:3]
    assert sorted(h for h in kv.host_block_hashes()) == sorted(a_hashes)
    assert len(plan.offloads) == 3 and plan.restores == []
    stored, removed, _ = kv.take_events()
    assert sorted(removed) == sorted(a_hashes) and len(stored) == 3  # a's left the device, b's came
    assert sorted(kv.take_host_events()[0]) == sorted(a_hashes)  # ...stored on the host
    kv.free(b)
    a2 = _req("a2", list(range(13)))
    hits = _admit(kv, a2)
    assert [type(h) for h in hits] == [HostHit] * 3
    plan = kv.take_copies()
    assert len(plan.restores) == 3 and len(plan.offloads) == 3  # b's blocks went out to make room
    # the restored blocks are on the device again, under their hashes, in the request's table
    assert [kv.pool.blocks[d].block_hash for _, d in plan.restores] == a_hashes
    assert kv.block_ids(RequestId("a2"))[:3] == [d for _, d in plan.restores]
    host_ids = {kv.host.lookup(h, a.token_ids[i * BS : (i + 1) * BS]) for i, h in enumerate(a_hashes)}
    assert {h for h, _ in plan.restores} == host_ids  # read from where they were offloaded
    assert set(kv.host_block_hashes()) >= set(a_hashes)  # inclusive: they stay in the host tier
    kv.free(a2)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks) and kv.pool.num_free_blocks == 4
    assert kv.reset_prefix_cache() and kv.host_block_hashes() == [] and kv.take_host_events()[2]


def test_a_pinned_restore_source_survives_offloads_of_the_same_step():
    kv = KVCacheManager(4, BS, host_blocks=3)
    a = _req("a", list(range(13)))
    _admit(kv, a)
    kv.free(a)
    b = _req("b", list(range(100, 113)))
    _admit(kv, b)  # a's 3 blocks -> host (full)
    kv.take_copies()
    kv.free(b)
    a2 = _req("a2", list(range(13)))
    _admit(kv, a2)  # restores a's 3 blocks while b's 3 are evicted: the host is full of pinned blocks
    plan = kv.take_copies()
    assert len(plan.restores) == 3 and plan.offloads == []  # nothing could be offloaded over them
    assert len(kv.host_block_hashes()) == 3


def test_scheduler_counts_host_hits_as_cached_and_plans_the_copies():
    kv = KVCacheManager(4, BS, host_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    a = _req("a", list(range(13)))
    sched.add(a)
    out = sched.schedule()
    assert out.num_tokens == 13 and not out.copies
    sched.update_after_step(out)
    sched.finish(a, "length")
    b = _req("b", list(range(100, 113)))
    sched.add(b)
    sched.update_after_step(sched.schedule())
    sched.finish(b, "length")
    a2 = _req("a2", list(range(13)))
    sched.add(a2)
    out = sched.schedule()
    assert out.num_tokens == 1 and out.restored_tokens == 12  # the budget pays for 1 token, not 13
    assert a2.num_cached_tokens == 12 and a2.num_host_cached_tokens == 12
    assert kv.host_hits == 12 and kv.prefix_hits == 12
    # the emulated model (and the simulator) charge the copy, not a recompute
    from kvroute.replica.emulated import step_seconds
    from kvroute.replica.profiles import gpu_h100_llama3_8b

    prof = gpu_h100_llama3_8b()
    assert step_seconds(prof, out) == pytest.approx(prof.step_time(1, 0) + prof.restore_time(12))


def test_no_host_tier_without_prefix_caching():
    from kvroute.replica.config import EngineConfig

    with pytest.raises(ValueError, match="host_kv_blocks"):
        EngineConfig(host_kv_blocks=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host_kv_blocks"):
        EngineConfig(host_kv_blocks=-1)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(host_kv_blocks=8, host_kv_gb=1.0)
    # GiB to blocks: the Llama-3-8B profile's 2 MiB blocks of 16 tokens
    assert EngineConfig(host_kv_gb=1.0).host_blocks(16 * 131_072) == 512
    assert EngineConfig(host_kv_blocks=7).host_blocks(0) == 7
    with pytest.raises(ValueError, match="bytes per block"):
        EngineConfig(host_kv_gb=1.0).host_blocks(0)


# ---------------------------------------------------------------------- the copies
def test_host_runs_group_consecutive_ids():
    from kvroute.replica.host_copies import host_runs

    assert host_runs([]) == []
    assert host_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copies_land_exactly_across_steps_and_streams(device):
    """Three steps of copy plans against a plain reference, with a 'forward pass' that
    overwrites each step's evicted and restored blocks after ``join``: an offload reads
    a block before the step writes it; a restore lands in a block the same step evicted;
    a block offloaded in one step is restored in the next and in the same step; a host
    block a restore read is overwritten by a later offload. On CUDA nothing synchronizes
    between steps."""
    import torch

    from kvroute.replica.host_copies import HostCopies
    from kvroute.replica.kv_cache_manager import CopyPlan

    g = torch.Generator().manual_seed(0)
    kv = torch.randn((2, 2, 10, BS, 2, 8), generator=g)  # [layers, 2, blocks, bs, kv_heads, head_dim]
    host = torch.zeros((8, 2, 2, BS, 2, 8))
    want_kv, want_host = kv.clone(), host.clone()
    copies = HostCopies(kv.to(device), host.pin_memory() if device == "cuda" else host)
    steps = [
        CopyPlan([(3, 0), (1, 1), (5, 4), (2, 2)], []),
        CopyPlan([(6, 3), (0, 5)], [(0, 6), (4, 7), (3, 1)]),  # 6 evicted and restored into; host 3 written and read
        CopyPlan([(7, 0), (9, 6)], [(3, 8), (5, 2)]),  # host 0 was read by the last step's restore
    ]
    for plan in steps:
        for d, h in plan.offloads:
            want_host[h] = want_kv[:, :, d]
        for h, d in plan.restores:
            want_kv[:, :, d] = want_host[h]
        copies.start(plan)
        copies.join()
        written = sorted({d for d, _ in plan.offloads} - {d for _, d in plan.restores})
        fresh = torch.randn((2, 2, len(written), BS, 2, 8), generator=g)
        want_kv[:, :, written] = fresh
        copies.kv_cache[:, :, written] = fresh.to(device)  # the step's forward pass
    copies.synchronize()
    assert torch.equal(copies.kv_cache.cpu(), want_kv) and torch.equal(copies.host_kv, want_host)
    timings = copies.take_restore_timings()
    if device == "cuda":
        torch.cuda.synchronize()
        timings += copies.take_restore_timings()
    assert [n for n, _ in timings] == [3, 2] and all(s > 0 for _, s in timings)
    assert copies.take_restore_timings() == []


# ---------------------------------------------------------------------- the engine
def _host_no_leak(llm) -> None:
    host = llm.engine.kv.host
    assert not host._pinned  # noqa: SLF001
    assert len(host) + len(host._free) == host.num_blocks  # noqa: SLF001


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["default", "small_chunks", "preemption"])
def test_outputs_are_identical_with_the_host_tier_on_and_off(mode, device, tiny_llama_path):
    from kvroute.replica.llm import LLM
    from tests.replica.helpers import assert_no_leak, engine_greedy, hf_greedy, prompts_for

    prompts = prompts_for(tiny_llama_path)
    batch = [p + [7 + i] for i, p in enumerate(prompts * 2)]
    longest = max(len(p) for p in batch) + 16
    # step_target_s=None: chunks by token budget only, so the hit counts below do not
    # depend on how fast the device ran the steps (time-bounded steps would)
    kwargs = dict(block_size=8, dtype="float32", device=device, step_target_s=None)
    if mode == "small_chunks":
        kwargs |= dict(max_num_batched_tokens=24, num_kv_blocks=2 * -(-longest // 8))
    elif mode == "preemption":
        kwargs |= dict(num_kv_blocks=-(-longest // 8) + 4)
    else:
        kwargs |= dict(num_kv_blocks=2 * -(-longest // 8))
    off = LLM(str(tiny_llama_path), **kwargs)
    on = LLM(str(tiny_llama_path), host_kv_blocks=256, **kwargs)
    # on CUDA (Triton kernels, CUDA graphs, asynchronous copies) the reference is the
    # same engine without the tier: transformers on the CPU may round differently
    want = list(hf_greedy(str(tiny_llama_path), tuple(map(tuple, batch)), 16)) if device == "cpu" else engine_greedy(off, batch, 16)
    for _ in range(2):  # the second pass finds most prefixes in the host tier only
        assert engine_greedy(off, batch, 16) == want
        assert engine_greedy(on, batch, 16) == want
    s_on, s_off = on.engine.stats(), off.engine.stats()
    assert s_on.prefix_cache_host_hits > 0 and s_on.prefix_cache_hits > s_off.prefix_cache_hits
    assert s_on.num_host_cached_blocks > 0
    if mode == "preemption":
        assert s_on.num_preemptions > 0
    assert_no_leak(on)
    _host_no_leak(on)
    # a block in both tiers holds the same KV in both (to rounding: the device copy may
    # have been recomputed since, in another batch shape)
    import torch

    kv, runner = on.engine.kv, on.engine.runner
    runner.host_copies.synchronize()
    both = [b for b in kv.pool.blocks if b.block_hash is not None and b.block_hash in kv.host]
    assert both
    for b in both:
        host_id = kv.host.lookup(b.block_hash, b.token_ids)
        torch.testing.assert_close(runner.host_kv[host_id], runner.kv_cache[:, :, b.block_id].cpu(), rtol=1e-4, atol=1e-4)
    # the load report carries the measured restore rate
    assert on.engine.load().host_restore_tokens_per_s > 0 and off.engine.load().host_restore_tokens_per_s == 0


def test_an_aborted_request_leaves_nothing_pinned_or_held(tiny_llama_path):
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams as SP
    from tests.replica.helpers import assert_no_leak, prompts_for

    prompts = prompts_for(tiny_llama_path)
    llm = LLM(str(tiny_llama_path), block_size=8, dtype="float32", num_kv_blocks=24, host_kv_blocks=64)
    llm.generate([p + [9] for p in prompts], SP(max_tokens=8), use_tqdm=False)
    llm.generate([p + [10] for p in prompts], SP(max_tokens=8), use_tqdm=False)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"x{i}", p + [9], SP(max_tokens=8))
    eng.step()  # admitted, restores planned and done
    for i in range(len(prompts)):
        eng.abort(f"x{i}")
    assert not eng.has_unfinished()
    assert_no_leak(llm)
    _host_no_leak(llm)


def test_the_emulated_engine_charges_restores_at_the_profiles_bandwidth():
    from kvroute.replica.profiles import gpu_h100_llama3_8b

    p = gpu_h100_llama3_8b()
    assert p.restore_time(6144) == pytest.approx(6144 * 131072 / 50.3e9)  # measured (gpu_engine --restore)
    # a 6k-token prefix restores in well under its prefill time
    assert p.restore_time(6144) < 0.25 * 6144 / p.prefill_tokens_per_s
