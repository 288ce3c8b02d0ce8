"""Loading a checkpoint's tensors into our modules (``load_weights_into``): exact
Hugging Face names, cast to the engine's dtype, every tensor accounted for."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from kvroute.replica.checkpoint import load_hf_config, weight_files

# Checkpoint tensors that carry no weights our models need (recomputed buffers).
_IGNORABLE_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face parameter name, CPU tensor)`` for every tensor of the checkpoint.

    The files are those named in model.safetensors.index.json when it exists, else every
    ``*.safetensors`` in the folder, in sorted order. Tensors are read one at a time, so
    at most one tensor is held beyond what the caller keeps. Raises ValueError when there
    is no weight file or an indexed shard is missing.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        files = weight_files(path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
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
