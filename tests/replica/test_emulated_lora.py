"""LoRA adapters on the emulated engine: only the adapters' configs are read (no torch),
``max_loras`` slots hold the resident ones (LRU), a step that needs a cold adapter takes
its slot load (the profile's bytes ÷ host → device bandwidth), and the load report and
counters say so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvroute.replica.config import EngineConfig
from kvroute.replica.emulated import step_seconds
from kvroute.replica.engine import Engine
from kvroute.replica.profiles import LLAMA3_8B_LORA_BYTES_PER_RANK, get_profile
from kvroute.replica.sampling_params import SamplingParams

PROFILE = "gpu_h100_llama3_8b"


def _adapter(folder, rank: int) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "target_modules": "all-linear"}))
    return str(folder)


@pytest.fixture
def modules(tmp_path):
    return {name: _adapter(tmp_path / name, rank) for name, rank in (("a", 16), ("b", 8), ("c", 16))}


def _engine(tiny_llama_path, modules, **kw) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=64, emulate=PROFILE,
                               enable_lora=True, max_loras=2, lora_modules=modules, **kw))  # fmt: skip


def test_slot_loads_are_lru_priced_by_the_profile_and_reported(tiny_llama_path, modules):
    engine = _engine(tiny_llama_path, modules)
    profile = get_profile(PROFILE)
    load16 = 16 * LLAMA3_8B_LORA_BYTES_PER_RANK / profile.host_copy_bytes_per_s
    assert profile.adapter_load_time(16) == pytest.approx(load16) and 1e-3 < load16 < 3e-3  # 84 MB at 50.3 GB/s
    for i, name in enumerate(["a", "b", "a", "c", "b"]):  # c evicts b (LRU), so b loads again
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=1), lora_name=name)
        while engine.has_unfinished():
            assert engine.step().deltas
    stats = engine.stats()
    assert stats.lora_slot_loads == 4 and stats.resident_loras == ("c", "b")
    # loads a16, b8, c16, b8 in a moving average of weight 0.2: 0.672 of rank 16's, 0.328 of rank 8's
    assert stats.adapter_load_s == pytest.approx(0.672 * load16 + 0.328 * profile.adapter_load_time(8))


def test_reset_prefix_cache_empties_the_slots_too(tiny_llama_path, modules):
    engine = _engine(tiny_llama_path, modules)
    for i, name in enumerate(["a", "b"]):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=1), lora_name=name)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().resident_loras == ("a", "b") and engine.stats().lora_slot_loads == 2
    assert engine.reset_prefix_cache()
    assert engine.stats().resident_loras == () and list(engine.list_loras()) == ["a", "b", "c"]
    engine.add_request("again", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1), lora_name="a")
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().lora_slot_loads == 3 and engine.stats().resident_loras == ("a",)  # loaded anew


def test_a_step_takes_its_cold_adapters_load(tiny_llama_path, modules):
    engine = _engine(tiny_llama_path, modules)
    engine.add_request("x", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1), lora_name="a")
    sched = engine.scheduler.schedule()
    engine.runner.execute(sched)
    assert engine.runner.emulated_s == pytest.approx(step_seconds(get_profile(PROFILE), sched)
                                                     + get_profile(PROFILE).adapter_load_time(16))  # fmt: skip
    engine.runner.emulated_s = 0.0
    engine.runner.execute(sched)  # resident now: no load
    assert engine.runner.emulated_s == pytest.approx(step_seconds(get_profile(PROFILE), sched))


def test_bad_adapter_config_is_named_and_unknown_adapters_refused(tiny_llama_path, modules, tmp_path):
    engine = _engine(tiny_llama_path, modules)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 64, "target_modules": ["q_proj"]}')
    with pytest.raises(ValueError, match=r"adapter_config.json: field 'r' is 64, above the engine's max_lora_rank=16"):
        engine.load_lora("bad", str(bad))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'zz'"):
        engine.add_request("y", [5, 6], SamplingParams(max_tokens=1), lora_name="zz")
    assert list(engine.list_loras()) == ["a", "b", "c"]


def test_emulated_lora_imports_no_torch(tiny_llama_path, modules):
    code = (
        "import sys\n"
        "from kvroute.replica.config import EngineConfig\n"
        "from kvroute.replica.engine import Engine\n"
        "from kvroute.replica.sampling_params import SamplingParams\n"
        f"e = Engine(EngineConfig(model={str(tiny_llama_path)!r}, block_size=8, num_kv_blocks=32, emulate={PROFILE!r},"
        f" enable_lora=True, lora_modules={modules!r}))\n"
        "e.add_request('a', [5, 6, 7, 8, 9], SamplingParams(max_tokens=2), lora_name='a')\n"
        "while e.has_unfinished(): e.step()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(e.stats().lora_slot_loads)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr[-2000:]
