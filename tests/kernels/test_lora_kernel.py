"""The SGMV LoRA kernels (shrink, expand) against the grouped torch reference: rows of
several adapters and of the base model in one batch, segments longer than a row block,
fused outputs wider than a column block, fp32 and bf16 (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.lora import LoRASegments, lora_add_reference, lora_add_triton
from tests.kernels.batches import DEVICE

# (start, length, slot) runs of a 90-row step: base rows (-1) between adapter rows; a
# 40-row segment spans two row blocks; slot 2 appears twice, apart.
LAYOUT = [(0, 3, 0), (3, 1, -1), (4, 40, 2), (44, 1, 1), (45, 5, -1), (50, 1, 0), (51, 1, 0), (52, 38, 2)]


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("dtype,fan_in,out,width", [(torch.float32, 64, 96, 24), (torch.bfloat16, 48, 160, 8)])
def test_triton_lora_matches_reference(dtype, fan_in, out, width):
    g = torch.Generator().manual_seed(0)
    t, slots = 90, 3
    x = torch.randn(t, fan_in, generator=g).to(DEVICE, dtype)
    a = (torch.randn(slots, width, fan_in, generator=g) * 0.3).to(DEVICE, dtype)
    b = (torch.randn(slots, out, width, generator=g) * 0.3).to(DEVICE, dtype)
    y = torch.randn(t, out, generator=g).to(DEVICE, dtype)
    seg = LoRASegments.from_rows(LAYOUT, torch.device(DEVICE))
    assert seg is not None and seg.starts.tolist() == [0, 4, 44, 50, 52] and seg.max_len == 40  # 50, 51 merged
    want, got = y.clone(), y.clone()
    lora_add_reference(want, x, a, b, seg)
    lora_add_triton(got, x, a, b, seg)
    base_rows = [3, 45, 46, 47, 48, 49]
    assert torch.equal(got[base_rows], y[base_rows]) and torch.equal(want[base_rows], y[base_rows])
    assert not torch.equal(want, y)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_no_adapter_rows_is_none():
    assert LoRASegments.from_rows([(0, 4, -1), (4, 1, -1)], torch.device("cpu")) is None


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("dtype,fan_in,row_slots", [
    (torch.float32, 1100, [2, -1, 0, 2, 2, -1, 0, 2, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]),  # 3 input splits
    (torch.bfloat16, 64, [-1, 3, -1]),  # one row, three empty slots
    (torch.float32, 40, [-1, -1, -1, -1]),  # no adapter row: nothing changes
])  # fmt: skip
def test_static_layout_matches_reference(dtype, fan_in, row_slots):
    """A decode layout on static buffers (rows grouped by slot through ``order``, one
    segment per slot, empty ones included; the grid sized by the buffers' batch, not by
    the lengths), as a CUDA graph replays it, against the reference."""
    from kvroute.kernels.lora import group_rows

    g = torch.Generator().manual_seed(1)
    t, slots, out, width = len(row_slots), 4, 72, 16
    x = torch.randn(t, fan_in, generator=g).to(DEVICE, dtype)
    a = (torch.randn(slots, width, fan_in, generator=g) * 0.1).to(DEVICE, dtype)
    b = (torch.randn(slots, out, width, generator=g) * 0.3).to(DEVICE, dtype)
    y = torch.randn(t, out, generator=g).to(DEVICE, dtype)
    order, starts, lens = group_rows(row_slots, slots)
    assert sorted(order.tolist()) == [i for i, s in enumerate(row_slots) if s >= 0]
    assert lens.tolist() == [row_slots.count(s) for s in range(slots)]
    # static buffers wider than this step, stale entries past its lengths
    order_buf = torch.full((64,), 7, dtype=torch.int32)
    order_buf[: len(order)] = torch.from_numpy(order)
    as_dev = lambda v: torch.as_tensor(v, dtype=torch.int32).to(DEVICE)  # noqa: E731
    seg = LoRASegments.static(order_buf.to(DEVICE), as_dev(starts), as_dev(lens), as_dev(range(slots)), 64)
    want, got = y.clone(), y.clone()
    lora_add_reference(want, x, a, b, seg)
    lora_add_triton(got, x, a, b, seg)
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows]) and torch.equal(want[base_rows], y[base_rows])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if len(base_rows) < t:
        assert not torch.equal(want, y)
