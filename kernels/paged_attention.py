"""Paged attention for a mixed batch (prefill chunks with cached context + decodes):
the pure-torch reference every other implementation must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvroute.kernels.attention_metadata import AttentionMetadata


_DECODE_GROUP = 16


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this step's K
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this step's V
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole prefix.

    The step's K/V must already be stored in the cache. ``key``/``value`` are an
    optional shortcut: a sequence with no cached context reads them directly instead
    of gathering from the cache (same values, less copying).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    decodes = [s for s in range(meta.num_seqs) if qsl[s + 1] - qsl[s] == 1]
    if len(decodes) > 1:
        # Batches of similar length, so padding to the longest wastes little.
        decodes.sort(key=lambda s: meta.seq_lens_cpu[s])
        for i in range(0, len(decodes), _DECODE_GROUP):
            _decode_batch(query, key_cache, value_cache, meta, scale, decodes[i : i + _DECODE_GROUP], out)
        decoded = set(decodes)
    else:
        decoded = set()
    for s in range(meta.num_seqs):
        if s in decoded:
            continue
        q0, q1 = qsl[s], qsl[s + 1]
        q_len, ctx, seq_len = q1 - q0, meta.context_lens_cpu[s], meta.seq_lens_cpu[s]
        assert seq_len == ctx + q_len
        if ctx == 0 and key is not None and value is not None:
            k, v = key[q0:q1], value[q0:q1]  # [seq_len, num_kv_heads, head_dim]
        else:
            nb = -(-seq_len // block_size)
            blocks = meta.block_tables[s, :nb].long()
            k = _gather_blocks(key_cache, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
            v = _gather_blocks(value_cache, blocks).flatten(0, 1)[:seq_len]
        # 4-D inputs with K/V repeated per query head take PyTorch's fused CPU kernel;
        # 3-D or enable_gqa fall back to the unfused math path (3.5x slower measured).
        group = num_heads // num_kv_heads
        q = query[q0:q1].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        k = k.transpose(0, 1).to(query.dtype)  # [num_kv_heads, seq_len, head_dim]
        v = v.transpose(0, 1).to(query.dtype)
        if group > 1:
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        k, v = k[None], v[None]  # [1, num_heads, seq_len, head_dim]
        if q_len == 1:
            mask = None  # a single new token sees the whole prefix
            causal = False
        elif ctx == 0:
            mask, causal = None, True
        else:
            pos_q = torch.arange(ctx, seq_len, device=query.device)[:, None]
            pos_k = torch.arange(seq_len, device=query.device)[None, :]
            mask, causal = pos_k <= pos_q, False  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)[0]
        out[q0:q1] = o.transpose(0, 1)
    return out


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int],
    out: torch.Tensor,
) -> None:
    """All single-token sequences at once: one gather, two batched matmuls.

    GQA is done by grouping query heads per KV head instead of repeating K/V.
    """
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    lens = [meta.seq_lens_cpu[s] for s in seqs]
    nb = -(-max(lens) // block_size)
    idx = torch.tensor(seqs, device=query.device)
    rows = meta.query_start_loc[idx].long()  # [B] row of each sequence's token
    blocks = meta.block_tables[idx, :nb].long()  # [B, nb]
    b = len(seqs)
    length = nb * block_size
    k = _gather_blocks(key_cache, blocks).view(b, length, num_kv_heads, head_dim).to(query.dtype)
    v = _gather_blocks(value_cache, blocks).view(b, length, num_kv_heads, head_dim).to(query.dtype)
    q = query[rows].view(b, num_kv_heads, group, head_dim)  # [B, KVH, G, D]
    seq_lens = torch.tensor(lens, device=query.device)
    keep = torch.arange(length, device=query.device)[None, :] < seq_lens[:, None]  # [B, L]
    # GQA without repeating K/V: a KV head's G query heads are G "query rows" of that
    # head (same position, so no causal mask among them). 4-D inputs take the fused kernel.
    o = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :], scale=scale
    )  # [B, KVH, G, D]
    out[rows] = o.reshape(b, num_heads, head_dim)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] as whole-page row copies: index_select on a 2-D view is several
    times faster on CPU than advanced indexing of the 4-D cache."""
    num_blocks = cache.shape[0]
    rows = cache.view(num_blocks, -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape, *cache.shape[1:])
