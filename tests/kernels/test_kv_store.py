"""KV store: the Triton per-token store against the reference scatter. Copies are exact,
so every comparison is bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.kv_store import store_kv_reference, store_kv_triton
from tests.kernels.batches import DEVICE, build_batch


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize(
    "ctx_lens,q_lens,block_size,dtype",
    [
        ([0, 16, 33, 5, 64], [32, 16, 1, 20, 1], 16, torch.bfloat16),  # prompt, aligned chunk, decode, mid-page chunk
        ([0, 32, 7], [64, 33, 1], 32, torch.float32),  # a prompt's last chunk ending mid-page
        ([3, 9], [1, 1], 16, torch.float32),  # decode only
    ],
)
def test_triton_store_matches_reference(ctx_lens, q_lens, block_size, dtype):
    kc, vc, meta, _, _, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, 3, 16, dtype)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_reference(new_k, new_v, want_k, want_v, meta.slot_mapping)
    store_kv_triton(new_k, new_v, kc, vc, meta.slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.usefixtures("triton_available")
def test_negative_slots_write_nothing_in_both_implementations():
    k = torch.arange(12, dtype=torch.float32, device=DEVICE).view(3, 2, 2) + 1
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    for store in (store_kv_reference, store_kv_triton):
        kc = torch.zeros(2, 4, 2, 2, device=DEVICE)
        vc = torch.zeros_like(kc)
        store(k, -k, kc, vc, slots)
        assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[0, 0], k[2]) and torch.equal(vc[0, 0], -k[2])
        assert int((kc != 0).any(-1).any(-1).sum()) == 2


def test_triton_store_rejects_bad_layouts(triton_available):
    kc = torch.zeros(2, 4, 2, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(AssertionError, match="cache dtype"):
        store_kv_triton(k.bfloat16(), k.bfloat16(), kc, kc.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(AssertionError, match="contiguous"):
        store_kv_triton(k, k, kc.transpose(0, 1), kc.clone().transpose(0, 1), torch.zeros(3, dtype=torch.int64))
