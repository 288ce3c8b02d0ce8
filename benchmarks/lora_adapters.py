"""Random LoRA adapters in the PEFT format, and the merged checkpoints they equal, for
the LoRA tests and ``offline --loras N``.

``save_random_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors``
exactly as PEFT saves them (keys ``base_model.model.model.layers.{i}.{part}.{module}.
lora_{A,B}.weight``); B is nonzero (PEFT initialises it to zero, which would make the
adapter invisible). ``save_merged_model`` copies a Hugging Face folder with every
targeted weight replaced by ``W + scale · B · A``: the model the adapter must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from kvroute.replica.lora.peft import ATTN_MODULES, CONFIG_FILE, MODULES, WEIGHTS_FILE, module_shapes
from kvroute.replica.models.arch import ModelArch


def _key(layer: int, module: str, ab: str) -> str:
    part = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{ab}.weight"


def save_random_adapter(
    folder: Path,
    arch: ModelArch,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = MODULES,
    seed: int = 0,
    std: float = 0.3,
) -> Path:
    """A random adapter for a model of ``arch`` (A and B ~ N(0, std²), fp32)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            tensors[_key(layer, module, "A")] = torch.randn(rank, fan_in, generator=g) * std
            tensors[_key(layer, module, "B")] = torch.randn(fan_out, rank, generator=g) * std
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": ""}  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
    return folder


def save_merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` (a Hugging Face folder with one ``model.safetensors``) with the adapter
    merged into its weights, in fp32, saved as a new folder ``out``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    weights = load_file(str(Path(base) / "model.safetensors"))
    config = json.loads((Path(adapter) / CONFIG_FILE).read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(Path(adapter) / WEIGHTS_FILE))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = (weights[name].double() + scale * (b.double() @ a.double())).float()
    save_file(weights, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    return Path(out)
