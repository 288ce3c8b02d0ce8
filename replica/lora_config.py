"""A PEFT adapter's ``adapter_config.json``, read and validated (stdlib only: the
emulated engine reads adapters' configs without torch; ``replica/lora.py`` reads the
weights), and where an adapter's folder is on this node (``adapter_folder``: a local
path, or an ``s3://`` URI fetched into the node's cache by ``replica/model_store.py``).
Every mistake is a ValueError naming the file and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvroute.replica.model_store import fetch, is_uri, not_found

CONFIG_FILE = "adapter_config.json"
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTN_MODULES + MLP_MODULES
# Config fields that change what the weights mean; refused unless they hold the neutral value.
_NEUTRAL = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip


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
