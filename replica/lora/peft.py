"""LoRA adapters in the PEFT format: where a folder is, its ``adapter_config.json``
(``read_config``) and its weights (``read_adapter``).

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
optionally ``use_rslora``) and ``adapter_model.safetensors`` with, per targeted module
and layer, ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. Targets are the per-projection
names PEFT uses (q/k/v/o_proj, gate/up/down_proj); the engine maps them onto its fused
Linears' output slices (``layers.py``). Anything else (bias, DoRA, ``modules_to_save``,
per-module ranks, embedding or lm_head targets) is refused.

The config is read with the stdlib alone (the emulated engine reads configs without
torch); torch and safetensors are imported only to read weights. ``adapter_folder``
resolves a local path, or an ``s3://`` URI fetched into the node's cache by
``replica/model_store.py``. Every mistake is a ValueError naming the file and the field
or tensor; nothing is kept from a folder that fails (the adapter is built only once
every check passed).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.replica.config import check_adapter_name
from kvroute.replica.model_store import fetch, is_uri, not_found
from kvroute.replica.models.arch import ModelArch

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTN_MODULES + MLP_MODULES
# Config fields that change what the weights mean; refused unless they hold the neutral value.
_NEUTRAL = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip
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


def adapter_folder(name: str, source: str | Path) -> Path:
    """The local folder of adapter ``name`` whose ``source`` is a folder path or an
    ``s3://bucket/prefix`` URI (this node's cached copy, downloaded on first use).

    It is resolved on the node that loads the adapter, so a folder present on one node
    only fails there, as a SourceNotFoundError (a ValueError) naming the adapter, the
    path and the node."""
    if is_uri(source):
        return fetch(str(source), f"LoRA adapter {name!r}: folder")
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise not_found(f"LoRA adapter {name!r}: folder", str(folder),
                        "it is not a directory there; on a cluster an adapter folder must exist on every node "
                        "that loads it, or be an s3:// URI")  # fmt: skip
    return folder


def read_config(file: Path, max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """``(rank, scale, target modules)`` of a PEFT ``adapter_config.json``."""
    if not file.is_file():
        raise ValueError(f"{file}: missing (a PEFT adapter folder needs {CONFIG_FILE})")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: field 'peft_type' must be 'LORA', got {cfg['peft_type']!r}")
    rank = cfg.get("r")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{file}: field 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{file}: field 'r' is {rank}, above the engine's max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{file}: field 'lora_alpha' must be a finite number, got {alpha!r}")
    for field, neutral in _NEUTRAL.items():
        value = cfg.get(field, neutral)
        if value != neutral and not (neutral is None and value in ([], {})):
            raise ValueError(f"{file}: field {field!r} = {value!r} is not supported (only {neutral!r})")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(MODULES)
    if not isinstance(targets, list) or not targets or not all(t in MODULES for t in targets):
        raise ValueError(f"{file}: field 'target_modules' must be a non-empty list of {', '.join(MODULES)} "
                         f"(or 'all-linear'), got {targets!r}")  # fmt: skip
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
    return rank, float(scale), tuple(dict.fromkeys(targets))


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection PEFT may target."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def read_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT folder ``path`` (or ``s3://`` URI, fetched into this
    node's cache) for a model of ``arch``, weights included."""
    name = check_adapter_name(name)
    folder = adapter_folder(name, path)
    rank, scale, targets = read_config(folder / CONFIG_FILE, max_rank)
    weights = _read_weights(folder / WEIGHTS_FILE, arch, rank, targets)
    return LoRAAdapter(name, str(path) if is_uri(path) else folder, rank, scale, weights)


def _read_weights(
    file: Path, arch: ModelArch, rank: int, targets: tuple[str, ...]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    if not file.is_file():
        raise ValueError(f"{file}: missing (a PEFT adapter folder needs {WEIGHTS_FILE})")
    found = _read_tensors(file, arch, rank, targets)
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


def _read_tensors(file: Path, arch: ModelArch, rank: int, targets: tuple[str, ...]) -> dict[tuple[int, str, str], torch.Tensor]:
    """Every tensor of ``file`` by ``(layer, module, "A" | "B")``, each checked (fp32)."""
    import torch
    from safetensors import SafetensorError, safe_open

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
    return found
