"""Writing a step's new K/V into the paged cache (torch reference)."""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    """Scatter each token's K/V into its slot, in place."""
    assert key.shape == value.shape and key.dim() == 3
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.shape == (key.shape[0],)
    num_blocks, block_size = key_cache.shape[:2]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )
