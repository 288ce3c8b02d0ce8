"""Paged attention for a mixed batch (prefill chunks with cached context + decodes): the
pure-torch reference every other implementation must match, and the Triton kernel.

The Triton kernel is one varlen launch for the whole batch. A program owns one KV head
and a tile of ``BLOCK_Q`` query tokens of one sequence; its ``BLOCK_M = BLOCK_Q x
GROUP_PAD`` rows are those tokens times the KV head's query heads (GQA), so each K/V
tile is read once per group, not once per query head. Programs find their sequence by a
binary search over ``query_start_loc`` (no host-side tile table, so the launch is
CUDA-graph safe). K/V tiles of ``BLOCK_N`` positions are gathered through the block
table, so ``BLOCK_N`` and the page size are independent. With ``num_splits > 1``
(flash-decoding) each program handles one slice of the context and a second kernel
merges the slices by their log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvroute.kernels import cpu_kernels
from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.kernels.triton_compat import interpreting, kernel, tl, triton


_DECODE_GROUP = 16


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this step's K
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this step's V
    native: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole prefix.

    The step's K/V must already be stored in the cache. ``key``/``value`` are an
    optional shortcut: a sequence with no cached context reads them directly instead
    of gathering from the cache (same values, less copying). ``native`` (the engine's CPU
    path): single-token sequences go to the native decode kernel and longer chunks to the
    native prefill kernel (``cpu_kernels.c``: pages read in place, no gather, no padding,
    GQA without repeating K/V) when they cover them.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    decodes = [s for s in range(meta.num_seqs) if qsl[s + 1] - qsl[s] == 1]
    done: set[int] = set()  # sequences whose rows of ``out`` are written
    if decodes and native:
        tables, lens, rows, _ = _select(meta, decodes, query.device)
        if cpu_kernels.decode_attention(query, key_cache, value_cache, tables, lens, rows, out, scale):
            done.update(decodes)
    if len(decodes) > 1 and not done:
        # Batches of similar length, so padding to the longest wastes little.
        decodes.sort(key=lambda s: meta.seq_lens_cpu[s])
        for i in range(0, len(decodes), _DECODE_GROUP):
            _decode_batch(query, key_cache, value_cache, meta, scale, decodes[i : i + _DECODE_GROUP], out)
        done.update(decodes)
    chunks = [s for s in range(meta.num_seqs) if qsl[s + 1] - qsl[s] > 1]
    if chunks and native:
        tables, lens, rows, q_lens = _select(meta, chunks, query.device)
        if cpu_kernels.prefill_attention(query, key_cache, value_cache, tables, lens, rows, q_lens, out, scale):
            done.update(chunks)
    for s in range(meta.num_seqs):
        if s in done:
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
        # 3-D or enable_gqa fall back to the much slower unfused math path.
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


def _select(
    meta: AttentionMetadata, seqs: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block tables, sequence lengths, first query rows and query lengths of
    ``seqs``, as the native kernels take them."""
    qsl = meta.query_start_loc
    if len(seqs) == meta.num_seqs:  # every sequence of the step: the metadata as it is
        return meta.block_tables, meta.seq_lens, qsl[:-1], qsl[1:] - qsl[:-1]
    idx = torch.tensor(seqs, device=device)
    return meta.block_tables[idx], meta.seq_lens[idx], qsl[idx], qsl[idx + 1] - qsl[idx]


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


@kernel
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] in query dtype, or [T, H, NUM_SPLITS, D] fp32 partials
    lse_ptr,  # [T, H, NUM_SPLITS] fp32 (split mode only)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2e,
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr,  # every sequence has exactly one query token
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tile
        local = tile * 0
    else:
        # Sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1):
        # find the last s whose first tile is <= this one.
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first <= tile, mid, lo)
            hi = tl.where(first <= tile, hi, mid)
        seq = lo
        local = tile - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] token index inside the chunk
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    q_rows = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    q_pos = ctx + tok  # [BLOCK_M] absolute position of each row's token

    # Keys this tile can see end at its last token; a tile past the chunk sees none.
    kv_end = tl.minimum(seq_len, ctx + (local + 1) * BLOCK_Q)
    kv_end = tl.where(local * BLOCK_Q < q_len, kv_end, 0)
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
        t_begin = split * per_split
        t_end = tl.minimum(t_begin + per_split, num_kv_tiles)
    else:
        t_begin = tile * 0
        t_end = num_kv_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        kv_pos = t * BLOCK_N + cols  # [BLOCK_N]
        kv_ok = kv_pos < kv_end
        block = tl.load(table + kv_pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (kv_pos % PAGE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_ok[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = s * scale_log2e  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_low = p.to(v.dtype)  # same rounding of P as the GPU's low-precision dot
        if UPCAST:
            pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_low, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row that saw nothing (padding) writes zeros
    o = acc / l_safe[:, None]
    if NUM_SPLITS > 1:
        part = (q_rows * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + part, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


@kernel
def _merge_splits_kernel(
    out_ptr,  # [T, H, D]
    part_ptr,  # [T, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [T, H, NUM_SPLITS] fp32, log2 domain
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    base = (t * num_heads + h) * NUM_SPLITS
    ok = sp < NUM_SPLITS
    lse = tl.load(lse_ptr + base + sp, mask=ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # [SPLITS_PAD], 0 for empty slices
    parts = tl.load(part_ptr + (base + sp)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, o.to(out_ptr.dtype.element_ty))


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    num_splits: int = 1,
    block_n: int | None = None,
    launch: dict[str, int] | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as :func:`paged_attention_reference` (the step's K/V must already be
    in the cache). Uses only tensor shapes and ``meta.max_query_len`` on the host, so a
    decode launch can be captured in a CUDA graph. ``num_splits > 1`` is only allowed for
    decode-only batches. Rows whose ``seq_len`` is 0 (padding) come out as zeros.
    ``launch``: Triton launch options of the attention kernel (``num_warps``,
    ``num_stages``), for tuning sweeps."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, page, num_kv_heads, kv_dim = key_cache.shape
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert kv_dim == head_dim, f"cache head_dim {kv_dim} != query head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert query.dtype == key_cache.dtype == value_cache.dtype, "query and cache dtypes must match"
    assert query.stride(2) == 1 and key_cache.stride(3) == 1, "head_dim must be contiguous"
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    num_seqs = meta.seq_lens.shape[0]
    assert meta.query_start_loc.shape == (num_seqs + 1,)
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out
    decode = meta.max_query_len == 1 and num_tokens == num_seqs
    assert num_splits == 1 or decode, "split-K is for decode-only batches"
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(16, group_pad) if decode else max(64, group_pad)
    block_q = 1 if decode else block_m // group_pad
    block_n = block_n or (64 if head_dim <= 64 else 32)
    grid0 = num_seqs if decode else num_tokens // block_q + num_seqs
    upcast = interpreting() and query.dtype != torch.float32
    common = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, PAGE=page, NUM_SPLITS=num_splits, DECODE=decode, UPCAST=upcast,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    strides = (
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), meta.block_tables.stride(0),
    )  # fmt: skip
    args = (query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            scale * 1.4426950408889634, num_seqs, num_heads)  # fmt: skip
    if num_splits == 1:
        _paged_attention_kernel[(grid0, num_kv_heads, 1)](out, out, *args, *strides, **common, **(launch or {}))
        return out
    parts = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_attention_kernel[(grid0, num_kv_heads, num_splits)](parts, lse, *args, *strides, **common, **(launch or {}))
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, parts, lse, num_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
    )  # fmt: skip
    return out
