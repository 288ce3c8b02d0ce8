"""LoRA adapters in the PEFT format: read and validate one folder (``load_adapter``).

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
optionally ``use_rslora``) and ``adapter_model.safetensors`` with, per targeted module
and layer, ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. Targets are the per-projection
names PEFT uses (q/k/v/o_proj, gate/up/down_proj); the engine maps them onto its fused
Linears' output slices (``replica/lora_slots.py``). Anything else (bias, DoRA,
``modules_to_save``, per-module ranks, embedding or lm_head targets) is refused.

Every mistake is a ValueError naming the file and the field or tensor; nothing is kept
from a folder that fails (the adapter is built only once every check passed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvroute.replica.config import check_adapter_name
from kvroute.replica.lora_config import ATTN_MODULES, CONFIG_FILE, adapter_folder, read_config
from kvroute.replica.model_store import is_uri
from kvroute.replica.models.arch import ModelArch

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """One validated adapter on the host: ``weights[(layer, module)] = (A [r, in],
    B [out, r])`` in fp32, ``scale`` = ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).
    ``path``: where it was loaded from, as the caller named it (a folder, or an ``s3://``
    URI: the fleet's registry compares it with what it lists, not with a node's cache)."""

    name: str
    path: Path | str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection PEFT may target."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def load_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT folder ``path`` (or ``s3://`` URI, fetched into this
    node's cache) for a model of ``arch``."""
    name = check_adapter_name(name)
    folder = adapter_folder(name, path)
    rank, scale, targets = read_config(folder / CONFIG_FILE, max_rank)
    weights = _read_weights(folder / WEIGHTS_FILE, arch, rank, targets)
    return LoRAAdapter(name, str(path) if is_uri(path) else folder, rank, scale, weights)


def _read_weights(
    file: Path, arch: ModelArch, rank: int, targets: tuple[str, ...]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ValueError(f"{file}: missing (a PEFT adapter folder needs {WEIGHTS_FILE})")
    shapes = module_shapes(arch)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.match(key)
                if m is None or int(m[1]) >= arch.num_layers or m[3] not in targets:
                    raise ValueError(f"{file}: tensor {key!r} is not a LoRA weight of a targeted module of this model")
                layer, module, ab = int(m[1]), m[3], m[4]
                fan_in, fan_out = shapes[module]
                want = (rank, fan_in) if ab == "A" else (fan_out, rank)
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != want:
                    raise ValueError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {want}")
                if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                    raise ValueError(f"{file}: tensor {key!r} must hold finite floating-point values")
                found[(layer, module, ab)] = tensor.float()
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    weights = {}
    for layer in range(arch.num_layers):
        for module in targets:
            part = "self_attn" if module in ATTN_MODULES else "mlp"
            pair = []
            for ab in "AB":
                if (layer, module, ab) not in found:
                    key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{ab}.weight"
                    raise ValueError(f"{file}: tensor {key!r} is missing (target_modules names {module})")
                pair.append(found[(layer, module, ab)])
            weights[(layer, module)] = (pair[0], pair[1])
    return weights
