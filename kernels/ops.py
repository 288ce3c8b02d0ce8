"""The one switch between kernel implementations: Triton on CUDA; on CPU the native kernels
of ``cpu_kernels.c`` where they cover the tensors (decode attention in bf16 and fp32;
RMSNorm, RoPE, SiLU-and-mul and the logits' argmax in bf16), torch references elsewhere.

Models call these functions and nothing else, so changing the backend changes nothing
above this file. The backend follows the tensors' device; ``KVROUTE_KERNELS=torch``
forces the references everywhere (e.g. to compare against them on a GPU) and
``KVROUTE_KERNELS=triton`` forces Triton everywhere (on CPU that needs
``TRITON_INTERPRET=1``). :func:`use_backend` does the same for a block of code.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from kvroute.kernels import cpu_kernels
from kvroute.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.kernels.kv_store import store_kv_reference, store_kv_triton
from kvroute.kernels.lora import LoRASegments, lora_add_reference, lora_add_triton
from kvroute.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from kvroute.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference, rms_norm_triton
from kvroute.kernels.rotary import rotary_reference_, rotary_triton_
from kvroute.kernels.triton_compat import HAS_TRITON

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("KVROUTE_KERNELS", "auto") or "auto"
if _backend not in _BACKENDS:
    raise ValueError(f"KVROUTE_KERNELS must be one of {_BACKENDS}, got {_backend!r}")


def backend() -> str:
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``'torch'`` or ``'triton'`` (or ``'auto'``) inside the block."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    old, _backend = _backend, name
    try:
        yield
    finally:
        _backend = old


def _native() -> bool:
    """Native CPU kernels (``cpu_kernels.c``) instead of the torch references, for
    tensors they cover: the ``auto`` backend only (``torch`` forces the references)."""
    return _backend == "auto"


def uses_triton(device: torch.device) -> bool:
    """THE switch: True when kernels on ``device`` run as Triton."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("KVROUTE_KERNELS=triton but the 'triton' package is not installed")
        return True
    return device.type == "cuda" and HAS_TRITON


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if uses_triton(x.device):
        return rms_norm_triton(x.contiguous(), weight, eps)  # type: ignore[return-value]
    native = cpu_kernels.add_rms_norm(x, None, weight, eps) if _native() else None
    return native[0] if native is not None else rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    if uses_triton(x.device):
        return rms_norm_triton(x.contiguous(), weight, eps, residual.contiguous())  # type: ignore[return-value]
    native = cpu_kernels.add_rms_norm(x, residual, weight, eps) if _native() else None
    return native if native is not None else fused_add_rms_norm_reference(x, residual, weight, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place; cos/sin [T, 1, D] in the model dtype."""
    if uses_triton(q.device):
        rotary_triton_(q, k, cos, sin)
    elif not (_native() and cpu_kernels.rotary_(q, k, cos, sin)):
        rotary_reference_(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on the last dimension."""
    if uses_triton(gate_up.device):
        return silu_and_mul_triton(gate_up.contiguous())
    native = cpu_kernels.silu_and_mul(gate_up) if _native() else None
    return native if native is not None else silu_and_mul_reference(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` (the first of equal maxima) of ``[rows, cols]`` logits, in any
    float dtype: native for bf16 on CPU, where torch's own bf16 argmax is slower than
    widening first, so without the native kernel bf16 is widened (exact, order kept)."""
    native = cpu_kernels.argmax_rows(x) if _native() else None
    if native is not None:
        return native
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        x = x.float()
    return x.argmax(dim=1)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoRASegments) -> None:
    """Add each adapter row's ``(x · a[slot]ᵀ) · b[slot]ᵀ`` onto ``y`` in place
    (``kernels/lora.py``): the SGMV kernels on CUDA, grouped torch products on CPU."""
    if uses_triton(y.device):
        lora_add_triton(y, x.contiguous(), a, b, seg)
    else:
        lora_add_reference(y, x, a, b, seg)


def store_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Write this step's K/V into the cache, each token to its slot (negative = padding)."""
    if uses_triton(key.device):
        store_kv_triton(key, value, key_cache, value_cache, meta.slot_mapping)
    else:
        store_kv_reference(key, value, key_cache, value_cache, meta.slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and
    themselves; the step's K/V must already be stored (``key``/``value`` are an optional
    shortcut the reference may use)."""
    if not uses_triton(query.device):
        return paged_attention_reference(query, key_cache, value_cache, meta, scale, key, value, native=_native())
    splits = 1
    if meta.max_query_len == 1 and query.shape[0] == meta.seq_lens.shape[0]:
        splits = decode_splits(query.shape[0], key_cache.shape[2], query.device)
    return paged_attention_triton(query, key_cache, value_cache, meta, scale, num_splits=splits)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-K slices for a decode batch: when ``num_seqs x num_kv_heads`` programs fill at
    most one wave of SMs, enough slices for about four programs per SM. Depends on shapes
    only, so a CUDA graph captured for a batch size stays valid. ``KVROUTE_DECODE_SPLITS``
    overrides it.

    Tuned with ``kvroute bench kernels`` (figures: benchmarks/RESULTS.md): a batch that
    fills less than one wave splits, one of several waves does not.
    """
    forced = os.environ.get("KVROUTE_DECODE_SPLITS")
    if forced:
        return max(1, int(forced))
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs > sms:
        return 1
    return min(16, 1 << ((4 * sms) // programs).bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
