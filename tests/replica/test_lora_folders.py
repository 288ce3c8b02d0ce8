"""Bad adapter folders and LoRA config fields: a ValueError naming the file and the field
(or tensor), and nothing half-loaded left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvroute.benchmarks.lora_adapters import save_random_adapter
from kvroute.replica.config import EngineConfig
from kvroute.replica.llm import LLM
from kvroute.replica.lora.peft import CONFIG_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=32, max_model_len=64, dtype="float32",
               enable_lora=True, max_loras=1, max_lora_rank=8)  # fmt: skip


def _edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    cfg.update(fields)
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))


def _edit_weights(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS_FILE))
    fn(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


KEY = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
CASES = {
    "no_config": (lambda f: (f / CONFIG_FILE).unlink(), rf"{CONFIG_FILE}: missing"),
    "bad_json": (lambda f: (f / CONFIG_FILE).write_text("{"), rf"{CONFIG_FILE}: not valid JSON"),
    "rank_zero": (lambda f: _edit_config(f, r=0), r"field 'r' must be a positive integer"),
    "rank_too_big": (lambda f: _edit_config(f, r=16), r"field 'r' is 16, above the engine's max_lora_rank=8"),
    "alpha": (lambda f: _edit_config(f, lora_alpha="x"), r"field 'lora_alpha' must be a finite number"),
    "target": (lambda f: _edit_config(f, target_modules=["q_proj", "lm_head"]), r"field 'target_modules'"),
    "bias": (lambda f: _edit_config(f, bias="all"), r"field 'bias' = 'all' is not supported"),
    "dora": (lambda f: _edit_config(f, use_dora=True), r"field 'use_dora'"),
    "no_weights": (lambda f: (f / WEIGHTS_FILE).unlink(), rf"{WEIGHTS_FILE}: missing"),
    "not_safetensors": (lambda f: (f / WEIGHTS_FILE).write_bytes(b"garbage"), r"not a readable safetensors file"),
    "missing_tensor": (lambda f: _edit_weights(f, lambda t: t.pop(KEY)), rf"tensor '{KEY}' is missing"),
    "shape": (lambda f: _edit_weights(f, lambda t: t.update({KEY: torch.zeros(3, 3)})), rf"tensor '{KEY}' has shape \(3, 3\)"),
    "nan": (lambda f: _edit_weights(f, lambda t: t[KEY].fill_(float("nan"))), rf"tensor '{KEY}' must hold finite"),
    "extra": (lambda f: _edit_weights(f, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(1)})),
              r"tensor 'base_model.model.lm_head.weight' is not a LoRA weight"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_folder_is_refused_naming_file_and_field(llm: LLM, tmp_path: Path, case: str):
    folder = save_random_adapter(tmp_path / "ad", llm.engine.arch, rank=4, seed=3, targets=("q_proj", "k_proj"))
    breaker, message = CASES[case]
    breaker(folder)
    with pytest.raises(ValueError, match=message):
        llm.load_lora("bad", folder)
    assert list(llm.engine.list_loras()) == [] and not llm.engine.lora.resident


def test_not_a_directory(llm: LLM, tmp_path: Path):
    with pytest.raises(ValueError, match="is not a directory"):
        llm.load_lora("x", tmp_path / "nope")


def test_max_cpu_loras(tiny_llama_path: Path, tmp_path: Path):
    llm = LLM(str(tiny_llama_path), block_size=8, num_kv_blocks=32, max_model_len=64, dtype="float32",
              enable_lora=True, max_loras=1, max_cpu_loras=1)  # fmt: skip
    folder = save_random_adapter(tmp_path / "ad", llm.engine.arch, rank=2, seed=4)
    llm.load_lora("one", folder)
    with pytest.raises(ValueError, match="max_cpu_loras=1"):
        llm.load_lora("two", folder)
    assert list(llm.engine.list_loras()) == ["one"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(enable_lora=True, max_loras=0), "max_loras and max_lora_rank must be >= 1"),
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 must be >= max_loras=4"),
        (dict(lora_modules={"a": "/x"}), "lora_modules needs enable_lora"),
        (dict(enable_lora=True, lora_modules={"": "/x"}), "adapter name must be a non-empty string"),
        (dict(enable_lora=True, lora_modules={"a": 3}), r"lora_modules\['a'\] must be a folder path"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
