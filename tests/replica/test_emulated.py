"""The emulated engine (``EngineConfig(emulate=PROFILE)``): the real scheduler and KV
cache, no model, steps timed by a profile, deterministic tokens, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvroute.replica.config import EngineConfig
from kvroute.replica.emulated import EmulatedModel, step_seconds
from kvroute.replica.engine import Engine
from kvroute.replica.profiles import PROFILES, STEP_PROFILES, StepProfile, get_profile
from kvroute.replica.step_cost import attention_pairs
from kvroute.replica.sampling_params import SamplingParams

PROFILE = "gpu_h100_llama3_8b"


def emulated(tiny_llama_path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model=str(tiny_llama_path), block_size=8, emulate=PROFILE, **kw))


def run(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step().deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


def test_an_emulated_engine_imports_no_torch(tiny_llama_path):
    code = (
        "import sys\n"
        "from kvroute.replica.config import EngineConfig\n"
        "from kvroute.replica.engine import Engine\n"
        "from kvroute.replica.sampling_params import SamplingParams\n"
        f"e = Engine(EngineConfig(model={str(tiny_llama_path)!r}, block_size=8, num_kv_blocks=32, emulate={PROFILE!r}))\n"
        "e.add_request('a', [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))\n"
        "while e.has_unfinished(): e.step()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_real_scheduler_and_cache_with_deterministic_tokens(tiny_llama_path):
    engine = emulated(tiny_llama_path)
    prompt = list(range(100, 140))  # 5 full blocks of 8
    engine.add_request("a", prompt, SamplingParams(max_tokens=12))
    first = run(engine)["a"]
    assert len(first) == 12  # never an EOS: runs to max_tokens
    assert not set(first) & engine.eos_token_ids and min(first) >= 1000
    assert engine.kv.num_blocks == 64
    engine.add_request("b", prompt, SamplingParams(max_tokens=12))
    out = run(engine)
    assert out["b"] == first  # the same tokens for the same sequence
    stats = engine.stats()
    assert stats.prefix_cache_hits == 5 * 8 - 8 or stats.prefix_cache_hits >= 4 * 8  # the prompt's blocks came from the cache
    assert stats.num_running == 0 and all(c == 0 for c in stats.block_ref_counts)  # nothing leaked
    other = emulated(tiny_llama_path)
    other.add_request("c", prompt, SamplingParams(max_tokens=12))
    assert run(other)["c"] == first  # and on another engine (a replica the request resumes on)


def test_a_resumed_request_continues_as_if_uninterrupted(tiny_llama_path):
    engine = emulated(tiny_llama_path)
    prompt = list(range(200, 230))
    engine.add_request("whole", prompt, SamplingParams(max_tokens=10))
    whole = run(engine)["whole"]
    engine.add_request("rest", prompt, SamplingParams(max_tokens=10), resume_output=whole[:4])
    assert run(engine)["rest"] == whole[4:]


def test_step_time_follows_the_profile_and_the_time_scale(tiny_llama_path):
    profile = get_profile(PROFILE)
    slept: list[float] = []
    t = [0.0]
    model = EmulatedModel(profile, 50_000, time_scale=4.0, clock=lambda: t[0], sleep=slept.append)
    engine = emulated(tiny_llama_path)
    engine.runner = engine.sampler = model
    engine.add_request("a", list(range(300, 364)), SamplingParams(max_tokens=3))  # 64 prompt tokens
    engine.step()  # the prefill: 64 tokens
    assert slept == [pytest.approx(4.0 * profile.step_time(64, 0, 0))]
    engine.step()  # a decode step: one row reading 65 tokens of context
    assert slept[-1] == pytest.approx(4.0 * profile.step_time(0, 1, 65))
    sched = engine.scheduler.schedule()
    assert step_seconds(profile, sched) == pytest.approx(profile.step_time(0, 1, 66))
    assert model.emulated_s == pytest.approx(profile.step_time(64, 0, 0) + profile.step_time(0, 1, 65))


def test_a_real_step_takes_the_scaled_time(tiny_llama_path):
    engine = emulated(tiny_llama_path, time_scale=3.0)
    engine.add_request("a", list(range(400, 480)), SamplingParams(max_tokens=2))
    start = time.perf_counter()
    run(engine)
    took = time.perf_counter() - start
    assert took >= 3.0 * engine.runner.emulated_s * 0.95


def test_the_profile_sets_capacity_and_context_and_bad_names_are_refused(tiny_llama_path):
    engine = emulated(tiny_llama_path, num_kv_blocks=None)
    profile = get_profile(PROFILE)
    assert engine.kv.num_blocks == profile.kv_blocks_per_replica * 16 // 8  # the profile's KV, in blocks of 8
    assert engine.max_model_len == profile.max_model_len
    with pytest.raises(ValueError, match="unknown emulation profile 'h100'.*gpu_h100_llama3_8b"):
        EngineConfig(emulate="h100")
    with pytest.raises(ValueError, match="time_scale applies to an emulated engine only"):
        EngineConfig(time_scale=2.0)
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        EngineConfig(emulate=PROFILE, time_scale=0)
    with pytest.raises(ValueError, match="emulated context length=131072"):
        emulated(tiny_llama_path, max_model_len=200_000)
    assert set(PROFILES) >= {PROFILE, "cpu_measured"}
    assert isinstance(profile, StepProfile) and profile.source


def test_the_emulated_engine_reports_the_profiles_restore_rate(tiny_llama_path):
    """Host-tier restores are charged at the profile's bandwidth and reported (scaled,
    as the engine times its steps) in the load figures the router prices them with."""
    profile = get_profile(PROFILE)
    engine = emulated(tiny_llama_path, num_kv_blocks=8, host_kv_blocks=32, time_scale=0.001)
    prompts = [list(range(1000 + 100 * i, 1048 + 100 * i)) for i in range(3)]  # 6 blocks each: one fits at a time
    for rnd in range(2):  # the second round finds each prompt in the host tier
        for i, p in enumerate(prompts):
            engine.add_request(f"{rnd}-{i}", p, SamplingParams(max_tokens=2))
            run(engine)
    assert engine.stats().prefix_cache_host_hits > 0
    want = profile.host_copy_bytes_per_s / profile.kv_bytes_per_token / 0.001
    assert engine.load().host_restore_tokens_per_s == pytest.approx(want)


@pytest.mark.parametrize("name", sorted(p.stem for p in STEP_PROFILES.glob("*.json")))
def test_saved_gpu_profiles_load_by_name_and_drive_the_emulated_engine(name, tiny_llama_path):
    """Each profile ``gpu_engine --cost-model`` saved names its card, date and command,
    loads by name for the emulated engine and the simulator, and prices steps as its fit."""
    from kvroute.benchmarks.sim.__main__ import COST_MODELS

    saved = json.loads((STEP_PROFILES / f"{name}.json").read_text())
    assert saved["card"] and saved["date"] and saved["command"] and saved["name"] == name
    profile = get_profile(name)
    assert COST_MODELS[name]() == profile
    assert profile.step_time(0, 64, 64 * 1024) == pytest.approx(
        saved["overhead_s"] + 64 * saved["decode_s_per_seq"] + 64 * 1024 * saved["attn_s_per_ctx_token"])
    assert profile.restore_time(1024) == pytest.approx(1024 * saved["kv_bytes_per_token"] / saved["host_copy_bytes_per_s"])
    engine = Engine(EngineConfig(model=str(tiny_llama_path), block_size=8, emulate=name, time_scale=0.001, num_kv_blocks=64))
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=3))
    assert len(run(engine)["a"]) == 3


def test_a_cpu_profile_prices_prefill_attention_by_position(tiny_llama_path):
    """``cpu_avx2_slow`` (issue 31's machine): a chunk deep in a long prompt costs
    more than the same chunk at its start, by the attention pairs it computes, and the
    6.5k-token prompt of the issue takes its measured ~49 s."""
    profile = get_profile("cpu_avx2_slow")
    engine = emulated(tiny_llama_path, max_num_batched_tokens=32, step_target_s=None)
    engine.add_request("long", list(range(1000, 1000 + 96)), SamplingParams(max_tokens=1))
    first = engine.scheduler.schedule()
    engine.scheduler.update_after_step(first)
    second = engine.scheduler.schedule()
    assert step_seconds(profile, first) == pytest.approx(profile.step_time(32, 0, 0, attention_pairs(0, 32)))
    assert step_seconds(profile, second) == pytest.approx(profile.step_time(32, 0, 0, attention_pairs(32, 64)))
    deep = profile.step_time(512, 0, 0, attention_pairs(6000, 6512))
    assert deep > 2.5 * profile.step_time(512, 0, 0, attention_pairs(0, 512))
    whole = sum(profile.step_time(512, 0, 0, attention_pairs(s, min(s + 512, 6525))) for s in range(0, 6525, 512))
    assert 45 < whole < 55


def test_the_serving_layers_cap_is_reported_with_the_load(tiny_llama_path):
    """``max_requests`` (Serve's ``max_ongoing_requests``, set by the replica deployment)
    rides every load report, so a router avoids a replica that would pass its request on."""
    assert emulated(tiny_llama_path, max_requests=48).load().max_requests == 48
    assert emulated(tiny_llama_path).load().max_requests == 0
    with pytest.raises(ValueError, match="max_requests must be >= 0"):
        EngineConfig(max_requests=-1)
