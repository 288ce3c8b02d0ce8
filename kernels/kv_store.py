"""Writing a step's new K/V into the paged cache: torch reference and Triton kernels.

Two Triton paths, chosen per page by the launcher from the step's plan
(:func:`plan_kv_store`):

- **page path**: every cache page that a sequence's chunk covers completely is one
  contiguous copy of ``block_size`` token rows. Page-aligned prefill scheduling (vLLM
  #19878) makes every non-final prefill chunk exactly such a run of whole pages.
- **slot path**: every other token (decode tokens, the tail of a prompt, chunks that
  start or end mid-page) is copied to its own slot from ``slot_mapping``; a negative slot
  means "padding, write nothing" (CUDA-graph batches are padded that way).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class KVStorePlan:
    """Which pages go whole and which tokens go one by one.

    Page *i* is page number ``page_indices[i]`` of sequence ``page_seqs[i]`` (so its block
    is ``block_tables[seq, page]`` and its first token row is
    ``query_start_loc[seq] + page * block_size - context_len[seq]``). ``tail_rows`` lists
    the token rows the slot path copies; ``None`` means every row.
    """

    page_seqs: torch.Tensor | None  # [num_pages] int32
    page_indices: torch.Tensor | None  # [num_pages] int32
    tail_rows: torch.Tensor | None  # [num_tail] int32
    num_pages: int
    num_tail: int  # -1 when tail_rows is None (every row)


SLOT_ONLY = KVStorePlan(None, None, None, 0, -1)


def plan_kv_store(
    query_start_loc: list[int], context_lens: list[int], block_size: int, device: torch.device
) -> KVStorePlan:
    """Split a step's tokens into whole pages and single slots (host lists in, small
    device tensors out; built once per step, shared by every layer)."""
    page_seqs: list[int] = []
    page_indices: list[int] = []
    tail_rows: list[int] = []
    for s, ctx in enumerate(context_lens):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        end = ctx + (q1 - q0)
        first, last = -(-ctx // block_size), end // block_size  # pages [first, last) are whole
        if first >= last:
            tail_rows.extend(range(q0, q1))
            continue
        page_seqs.extend([s] * (last - first))
        page_indices.extend(range(first, last))
        tail_rows.extend(range(q0, q0 + first * block_size - ctx))
        tail_rows.extend(range(q0 + last * block_size - ctx, q1))
    if not page_seqs:
        return SLOT_ONLY
    return KVStorePlan(
        torch.tensor(page_seqs, dtype=torch.int32, device=device),
        torch.tensor(page_indices, dtype=torch.int32, device=device),
        torch.tensor(tail_rows, dtype=torch.int32, device=device) if tail_rows else None,
        len(page_seqs),
        len(tail_rows),
    )


@kernel
def _store_slots_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    rows_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        row = pid.to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # (the interpreter rejects `vector & scalar` masks, so broadcast the scalar first)
    mask = (offs < ROW) & (offs * 0 + slot >= 0)
    k = tl.load(key_ptr + row * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + row * stride_vt + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v, mask=mask)


@kernel
def _store_pages_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    page_seqs_ptr,
    page_indices_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_kt,
    stride_vt,
    stride_bt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    PAGE: tl.constexpr,  # block_size
    BLOCK: tl.constexpr,  # elements per program, divides PAGE * ROW
):
    page = tl.program_id(0)
    part = tl.program_id(1)
    seq = tl.load(page_seqs_ptr + page)
    index = tl.load(page_indices_ptr + page)
    q0 = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q0
    ctx = tl.load(seq_lens_ptr + seq) - q_len
    row0 = (q0 + index * PAGE - ctx).to(tl.int64)
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + index).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)  # flat offsets inside the page
    tok = offs // ROW
    inner = offs % ROW
    k = tl.load(key_ptr + (row0 + tok) * stride_kt + inner)
    v = tl.load(value_ptr + (row0 + tok) * stride_vt + inner)
    dst = block * (PAGE * ROW) + offs
    tl.store(key_cache_ptr + dst, k)
    tl.store(value_cache_ptr + dst, v)


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
    plan: KVStorePlan = SLOT_ONLY,
    query_start_loc: torch.Tensor | None = None,  # [num_seqs + 1] int32, needed with pages
    seq_lens: torch.Tensor | None = None,  # [num_seqs] int32, needed with pages
    block_tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32, needed with pages
) -> None:
    """Write K/V into the cache in place: whole pages from ``plan``, then single slots."""
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
    page_size = key_cache.shape[1]
    if plan.num_pages:
        assert query_start_loc is not None and seq_lens is not None and block_tables is not None
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
        page_elems = page_size * row
        block = min(page_elems & -page_elems, 4096)  # the largest power of two dividing a page
        _store_pages_kernel[(plan.num_pages, page_elems // block)](
            key, value, key_cache, value_cache,
            plan.page_seqs, plan.page_indices, query_start_loc, seq_lens, block_tables,
            key.stride(0), value.stride(0), block_tables.stride(0),
            ROW=row, PAGE=page_size, BLOCK=block,
        )  # fmt: skip
    num_slots = num_tokens if plan.num_tail < 0 else plan.num_tail
    if num_slots:
        rows = plan.tail_rows
        _store_slots_kernel[(num_slots,)](
            key, value, key_cache, value_cache, slot_mapping,
            rows if rows is not None else slot_mapping,
            key.stride(0), value.stride(0),
            ROW=row, BLOCK=triton.next_power_of_2(row), HAS_ROWS=rows is not None,
        )  # fmt: skip
