"""Paged attention: the torch reference against plain dense attention, and the Triton
kernel (interpreted on CPU) against both.

Tolerances: fp32 2e-5 (reference) / 1e-5 (Triton vs dense, fp32 accumulation in both);
bf16 2e-2 absolute and relative (inputs rounded to bf16, P rounded to bf16 before P@V,
output rounded to bf16: a few bf16 ulps of values of order 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvroute.kernels.kv_store import store_kv_reference
from kvroute.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from kvroute.kernels.rms_norm import rms_norm_reference
from tests.kernels.batches import DEVICE, assert_attention_matches, build_batch, dense_attention


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
    q = torch.randn(sum(q_lens), kvh * gqa, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
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


# ---------------------------------------------------------------- Triton (interpreted on CPU)
# Each interpreted launch costs ~0.5 s here, so the cases are chosen, not crossed:
# together they cover GQA 1/3/8, fp32/bf16, block sizes 16/32, head_dim 64/128, a ragged
# mixed batch, a prefill chunk over a cached prefix that ends mid-page, a prompt whose
# whole prefix is cached (only its last token computed), decode-only batches, split-K,
# BLOCK_N smaller and larger than a page, and padding rows.
MIXED = ([0, 17, 47, 0, 64], [5, 1, 1, 1, 1])  # 47 + 1: a 48-token prompt, all but its last token cached
CHUNKS = ([48, 0, 5], [16, 40, 11])  # page-aligned chunk over a cached prefix; mid-page ends
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check_triton(ctx_lens, q_lens, gqa, block_size, dtype, head_dim=64, num_splits=1, block_n=None, kvh=2):
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, kvh, head_dim, dtype)
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(sum(q_lens), kvh * gqa, head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_triton(q, kc, vc, meta, scale, num_splits=num_splits, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    assert_attention_matches(out, q, kc, vc, meta, full_k, full_v, ctx_lens, q_lens, scale, TOL[dtype])


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize(
    "lens,gqa,block_size,dtype,block_n",
    [
        (MIXED, 1, 16, torch.float32, 16),
        (MIXED, 3, 32, torch.bfloat16, 64),
        (MIXED, 8, 16, torch.bfloat16, 32),
        (CHUNKS, 1, 32, torch.bfloat16, 16),
        (CHUNKS, 3, 16, torch.float32, 64),
        (CHUNKS, 8, 32, torch.float32, 32),
    ],
)
def test_triton_paged_attention_mixed_batches(lens, gqa, block_size, dtype, block_n):
    _check_triton(*lens, gqa, block_size, dtype, block_n=block_n)


@pytest.mark.usefixtures("triton_available")
def test_triton_paged_attention_head_dim_128():
    _check_triton([20, 0], [1, 9], 2, 16, torch.bfloat16, head_dim=128, kvh=1)


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("num_splits,dtype", [(1, torch.float32), (3, torch.float32), (4, torch.bfloat16)])
def test_triton_decode_batch_and_split_k(num_splits, dtype):
    # Context lengths shorter than, equal to and longer than the number of slices'
    # worth of tiles, so some slices are empty.
    _check_triton([0, 15, 16, 70], [1, 1, 1, 1], 4, 16, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_padding_rows_read_nothing_and_return_zeros(num_splits):
    """CUDA-graph padding: seq_len 0, one query token, a block table of garbage."""
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch([9, 30], [1, 1], 16, 2, 64, torch.float32)
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(4, 4, 64, device=DEVICE)
    meta.query_start_loc = torch.arange(5, dtype=torch.int32, device=DEVICE)
    meta.query_start_loc_cpu = [0, 1, 2, 3, 4]
    meta.seq_lens = torch.tensor([10, 31, 0, 0], dtype=torch.int32, device=DEVICE)
    garbage = torch.full((2, meta.block_tables.shape[1]), 10**6, dtype=torch.int32, device=DEVICE)
    meta.block_tables = torch.cat([meta.block_tables, garbage])
    out = paged_attention_triton(q, kc, vc, meta, 0.125, num_splits=num_splits)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    for s, c in enumerate([9, 30]):
        torch.testing.assert_close(out[s : s + 1], dense_attention(q[s : s + 1], full_k[s], full_v[s], c, 0.125), atol=1e-5, rtol=1e-5)


def test_triton_launcher_rejects_bad_layouts(triton_available):
    kc, vc, meta, *_ = build_batch([3], [1], 16, 2, 64, torch.float32)
    with pytest.raises(AssertionError, match="dtypes"):
        paged_attention_triton(torch.randn(1, 4, 64, dtype=torch.bfloat16), kc, vc, meta, 0.1)
    with pytest.raises(AssertionError, match="GQA"):
        paged_attention_triton(torch.randn(1, 3, 64), kc, vc, meta, 0.1)
    with pytest.raises(AssertionError, match="split-K"):
        paged_attention_triton(torch.randn(2, 4, 64), kc, vc, build_batch([3], [2], 16, 2, 64, torch.float32)[2], 0.1, num_splits=2)
