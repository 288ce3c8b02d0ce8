"""Writing a step's new K/V into the paged cache: torch reference and Triton kernel.

One Triton program per token copies its row to the slot ``slot_mapping`` gives; a
negative slot means "padding, write nothing" (CUDA-graph batches are padded that way).

There is no separate whole-page path for page-aligned prefill chunks (a contiguous
``block_size``-row copy per page a chunk covers completely): it was no faster than the
per-token store (benchmarks/RESULTS.md), so the one path stays.
"""

from __future__ import annotations

import torch

from kvroute.kernels.triton_compat import kernel, tl, triton


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    """Scatter each token's K/V into its slot, in place. Negative slots are skipped."""
    assert key.shape == value.shape and key.dim() == 3
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.shape == (key.shape[0],)
    num_blocks, block_size = key_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


@kernel
def _store_slots_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # (the interpreter rejects `vector & scalar` masks, so broadcast the scalar first)
    mask = (offs < ROW) & (offs * 0 + slot >= 0)
    k = tl.load(key_ptr + row * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + row * stride_vt + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
) -> None:
    """Write each token's K/V into its slot of the cache, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value must have the same shape"
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "the cache must be contiguous"
    assert key_cache.dtype == key.dtype == value.dtype, "K/V must already be in the cache dtype"
    for t in (key, value):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "each token's heads must be contiguous"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _store_slots_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), value.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )  # fmt: skip
