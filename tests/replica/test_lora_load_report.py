"""The engine's load report names the LoRA adapters resident in its device slots (LRU),
the measured seconds of a slot load (what the router prices a cold adapter at), and the
adapters its running requests hold out of its ``max_loras`` slots."""

from __future__ import annotations

from kvroute.benchmarks.lora_adapters import save_random_adapter
from kvroute.replica.checkpoint import load_hf_config
from kvroute.replica.llm import LLM
from kvroute.replica.models.arch import ModelArch
from kvroute.replica.sampling_params import SamplingParams


def test_load_report_names_resident_adapters_and_the_slot_load_time(tiny_llama_path, tmp_path):
    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    modules = {n: str(save_random_adapter(tmp_path / n, arch, rank=4, seed=s)) for n, s in (("a", 1), ("b", 2))}
    llm = LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32",
              enable_lora=True, max_loras=1, lora_modules=modules)  # fmt: skip
    engine = llm.engine
    assert engine.load().resident_loras == () and engine.load().adapter_load_s == 0.0
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False, lora_name="a")
    first = engine.load()
    assert first.resident_loras == ("a",) and first.adapter_load_s > 0 and first.max_loras == 1
    assert first.running_loras == ()  # finished: no slot is held
    engine.add_request("run", [5, 6, 7, 8], params, lora_name="a")
    engine.step()  # admitted and prefilled, one token left
    assert engine.load().running_loras == ("a",)
    engine.abort("run")
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False, lora_name="b")  # one slot: b evicts a
    assert engine.load().resident_loras == ("b",) and engine.stats().lora_slot_loads == 2
    assert engine.events().load.resident_loras == ("b",)  # what the router receives
