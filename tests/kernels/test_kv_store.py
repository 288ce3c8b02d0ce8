"""KV store: the step plan (which pages go whole) and the Triton paths against the
reference scatter. Copies are exact, so every comparison is bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.kv_store import SLOT_ONLY, plan_kv_store, store_kv_reference, store_kv_triton
from tests.kernels.batches import DEVICE, build_batch


def _plan_lists(plan):
    pages = list(zip(plan.page_seqs.tolist(), plan.page_indices.tolist())) if plan.num_pages else []
    tail = None if plan.tail_rows is None else plan.tail_rows.tolist()
    return pages, tail


def test_plan_splits_whole_pages_from_single_slots():
    # block 4. seq 0: page-aligned chunk of 2 whole pages (ctx 8, 8 new) -> pages 2, 3.
    # seq 1: decode -> one slot. seq 2: ctx 2, 9 new (positions 2..10) -> page 1 whole,
    # head rows for positions 2-3 and tail rows for 8-10 go by slot.
    plan = plan_kv_store([0, 8, 9, 18], [8, 20, 2], 4, torch.device("cpu"))
    pages, tail = _plan_lists(plan)
    assert pages == [(0, 2), (0, 3), (2, 1)]
    assert tail == [8, 9, 10, 15, 16, 17]
    assert plan.num_pages == 3 and plan.num_tail == 6


def test_plan_for_decode_or_partial_pages_is_slot_only():
    assert plan_kv_store([0, 1, 2], [5, 9], 4, torch.device("cpu")) is SLOT_ONLY
    assert plan_kv_store([0, 3], [1], 4, torch.device("cpu")) is SLOT_ONLY  # positions 1..3


def test_plan_all_pages_has_no_tail():
    plan = plan_kv_store([0, 8], [4], 4, torch.device("cpu"))
    assert _plan_lists(plan) == ([(0, 1), (0, 2)], None) and plan.num_tail == 0


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize(
    "ctx_lens,q_lens,block_size,dtype",
    [
        ([0, 16, 33, 5, 64], [32, 16, 1, 20, 1], 16, torch.bfloat16),  # pages, decode, mid-page chunk
        ([0, 32, 7], [64, 33, 1], 32, torch.float32),  # a prompt's last chunk with a tail
        ([3, 9], [1, 1], 16, torch.float32),  # decode only: slot path alone
    ],
)
def test_triton_store_matches_reference(ctx_lens, q_lens, block_size, dtype):
    kc, vc, meta, _, _, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, 3, 16, dtype)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_reference(new_k, new_v, want_k, want_v, meta.slot_mapping)
    plan = plan_kv_store(meta.query_start_loc_cpu, meta.context_lens_cpu, block_size, kc.device)
    store_kv_triton(new_k, new_v, kc, vc, meta.slot_mapping, plan, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.usefixtures("triton_available")
def test_triton_store_pages_only_and_slots_only_agree():
    """The same chunk written page by page and token by token gives the same cache."""
    kc, vc, meta, _, _, new_k, new_v = build_batch([16], [48], 16, 2, 16, torch.float32)
    plan = plan_kv_store(meta.query_start_loc_cpu, meta.context_lens_cpu, 16, kc.device)
    assert plan.num_pages == 3 and plan.num_tail == 0
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_triton(new_k, new_v, kc, vc, meta.slot_mapping, plan, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    store_kv_triton(new_k, new_v, kc2, vc2, meta.slot_mapping)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


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
