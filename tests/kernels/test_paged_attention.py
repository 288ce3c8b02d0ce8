"""The paged-attention and KV-store references against plain dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvroute.kernels.attention_metadata import AttentionMetadata
from kvroute.kernels.kv_store import store_kv_reference
from kvroute.kernels.paged_attention import paged_attention_reference
from kvroute.kernels.rms_norm import rms_norm_reference


def build_batch(ctx_lens, q_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Random K/V for every position; cached context is pre-stored in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens)) + 3
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v, slots = [], [], [], []
    for c, q in zip(ctx_lens, q_lens):
        n = -(-(c + q) // block_size)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        k = torch.randn(c + q, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c + q, num_kv_heads, head_dim, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for p in range(c):  # the cached prefix is already in the cache
            kc[table[p // block_size], p % block_size] = k[p]
            vc[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32),
        torch.tensor(ctx_lens, dtype=torch.int32),
        bt,
        torch.tensor(slots, dtype=torch.int64),
        qsl,
        [c + q for c, q in zip(ctx_lens, q_lens)],
        list(ctx_lens),
    )
    new_k = torch.cat([k[c:] for k, c in zip(full_k, ctx_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, ctx_lens)])
    return kc, vc, meta, full_k, full_v, new_k, new_v


def dense_attention(q, k, v, ctx, scale):
    """q: [q_len, H, D]; k, v: [ctx + q_len, KVH, D]; explicit causal softmax in fp32."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(h // kvh, dim=1)
    v = v.float().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


CASES = [
    # ctx_lens, q_lens: decode, prefill without context, prefill chunk with cached
    # context, chunks ending mid-page, a prompt whose whole prefix is cached.
    ([0, 17, 33, 0, 64], [5, 1, 15, 1, 1]),
    ([48, 0, 5], [16, 40, 11]),
    ([0], [1]),
]


@pytest.mark.parametrize("ctx_lens,q_lens", CASES)
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shortcut", [False, True])
def test_paged_attention_matches_dense(ctx_lens, q_lens, gqa, block_size, dtype, tol, shortcut):
    kvh, d = 2, 64
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, kvh, d, dtype)
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(sum(q_lens), kvh * gqa, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 1 / math.sqrt(d)
    out = paged_attention_reference(q, kc, vc, meta, scale, *( (new_k, new_v) if shortcut else () ))
    assert out.shape == q.shape and out.dtype == dtype
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        q0 = meta.query_start_loc_cpu[s]
        want = dense_attention(q[q0 : q0 + n], full_k[s], full_v[s], c, scale)
        torch.testing.assert_close(out[q0 : q0 + n].float(), want, atol=tol, rtol=tol)


def test_store_kv_writes_exact_slots_and_nothing_else():
    kc = torch.zeros(4, 4, 1, 2)
    vc = torch.zeros_like(kc)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    store_kv_reference(k, -k, kc, vc, torch.tensor([13, 2, 7]))
    assert torch.equal(kc[3, 1], k[0]) and torch.equal(kc[0, 2], k[1]) and torch.equal(kc[1, 3], k[2])
    assert torch.equal(vc[3, 1], -k[0])
    assert int((kc != 0).any(-1).sum()) == 3


def test_rms_norm_reference():
    x = torch.randn(3, 8)
    w = torch.rand(8)
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), want)
