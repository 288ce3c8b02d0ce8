"""Batched LoRA: add each row's low-rank product ``(x · Aᵀ) · Bᵀ`` to a Linear's output,
for a batch whose rows use different adapters (or none).

The batch is described by segments (``LoRASegments``): runs of consecutive rows that
use one adapter slot; rows outside every segment (the base model's) are left alone.
Adapters sit in stacked tensors, one slot each: ``a [slots, NR, in]`` and
``b [slots, out, NR]`` (``NR`` the slot's rank width, padded with zeros; the adapter's
scale already folded into ``b``).

- ``lora_add_reference``: torch, grouped by adapter (the rows of one slot gathered,
  multiplied by its A then its B, added back), used on CPU.
- ``lora_add_triton``: two Triton kernels in the punica SGMV style: *shrink*
  (``x · Aᵀ`` per segment into an fp32 buffer ``[T, NR]``) and *expand* (``· Bᵀ`` added
  onto ``y``), a program per (segment, row block[, column block]).

Both compute the two products in the model dtype's accumulator (fp32) and round the
sum ``y + delta`` once, so they differ only in summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroute.kernels.triton_compat import kernel, tl, triton


@dataclass(frozen=True)
class LoRASegments:
    """A step's adapter layout over its token rows, built once per step.

    ``starts``/``lens``/``slots`` (int32, on the device, ``[S]``): segment *s* covers
    rows ``[starts[s], starts[s] + lens[s])`` and uses adapter slot ``slots[s]``.
    ``groups``: per slot, the row indices it covers (``[n]`` int64, on the device), for
    the grouped torch path. ``max_len``: the longest segment (the Triton grid's size).
    """

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor], ...]
    max_len: int

    @classmethod
    def from_rows(cls, row_slots: list[tuple[int, int, int]], device: torch.device) -> "LoRASegments | None":
        """``row_slots``: ``(start, length, slot)`` per run of rows (slot -1: base rows).
        Adjacent runs of one slot are merged; None when no row uses an adapter."""
        merged: list[list[int]] = []
        for start, length, slot in row_slots:
            if slot < 0 or length == 0:
                continue
            if merged and merged[-1][2] == slot and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += length
            else:
                merged.append([start, length, slot])
        if not merged:
            return None
        by_slot: dict[int, list[int]] = {}
        for start, length, slot in merged:
            by_slot.setdefault(slot, []).extend(range(start, start + length))
        cols = list(zip(*merged))
        as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        return cls(
            starts=as_tensor(cols[0], torch.int32),
            lens=as_tensor(cols[1], torch.int32),
            slots=as_tensor(cols[2], torch.int32),
            groups=tuple((s, as_tensor(rows, torch.int64)) for s, rows in by_slot.items()),
            max_len=max(cols[1]),
        )


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoRASegments) -> None:
    """``y[rows] += (x[rows] · a[slot]ᵀ) · b[slot]ᵀ`` for every slot's rows, in place.

    y: [T, out], x: [T, in], a: [slots, NR, in], b: [slots, out, NR]."""
    for slot, rows in seg.groups:
        xs = x.index_select(0, rows).float()  # [n, in]
        # F.linear, not `xs @ a.T`: on CPU the transposed matmul takes a much slower path
        delta = F.linear(F.linear(xs, a[slot].float()), b[slot].float())  # [n, out]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


@kernel
def _lora_shrink_kernel(
    buf_ptr, x_ptr, a_ptr, starts_ptr, lens_ptr, slots_ptr,
    IN: tl.constexpr, NR: tl.constexpr, NR_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(1) * BLOCK_M < length:
        rows = (start + m).to(tl.int64)
        row_ok = m < length
        r = tl.arange(0, NR_PAD)
        acc = tl.zeros((BLOCK_M, NR_PAD), dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + rows[:, None] * IN + k[None, :], mask=row_ok[:, None] & (k[None, :] < IN), other=0.0)
            ak = tl.load(a_ptr + slot * NR * IN + r[None, :] * IN + k[:, None],
                         mask=(r[None, :] < NR) & (k[:, None] < IN), other=0.0)  # [BLOCK_K, NR_PAD]  # fmt: skip
            acc += tl.dot(xk.to(tl.float32), ak.to(tl.float32), input_precision="ieee")
        tl.store(buf_ptr + rows[:, None] * NR + r[None, :], acc, mask=row_ok[:, None] & (r[None, :] < NR))


@kernel
def _lora_expand_kernel(
    y_ptr, buf_ptr, b_ptr, starts_ptr, lens_ptr, slots_ptr,
    OUT: tl.constexpr, NR: tl.constexpr, NR_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(1) * BLOCK_M < length:
        rows = (start + m).to(tl.int64)
        row_ok = m < length
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, NR_PAD)
        h = tl.load(buf_ptr + rows[:, None] * NR + r[None, :], mask=row_ok[:, None] & (r[None, :] < NR), other=0.0)
        bt = tl.load(b_ptr + slot * OUT * NR + n[None, :] * NR + r[:, None],
                     mask=(n[None, :] < OUT) & (r[:, None] < NR), other=0.0)  # [NR_PAD, BLOCK_N]  # fmt: skip
        delta = tl.dot(h, bt.to(tl.float32), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        offs = rows[:, None] * OUT + n[None, :]
        ok = row_ok[:, None] & (n[None, :] < OUT)
        y = tl.load(y_ptr + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, (y.to(tl.float32) + delta).to(y.dtype), mask=ok)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoRASegments) -> None:
    """:func:`lora_add_reference` as two Triton launches (shrink, then expand)."""
    t, in_features = x.shape
    slots, nr, out = a.shape[0], a.shape[1], b.shape[1]
    assert x.is_contiguous() and y.is_contiguous() and a.is_contiguous() and b.is_contiguous()
    assert y.shape == (t, out) and a.shape == (slots, nr, in_features) and b.shape == (slots, out, nr)
    buf = torch.empty((t, nr), dtype=torch.float32, device=x.device)  # [T, NR], only segment rows written
    nr_pad = max(16, triton.next_power_of_2(nr))
    block_m = 16 if seg.max_len <= 16 else 32
    num_segs = seg.starts.shape[0]
    grid_m = triton.cdiv(seg.max_len, block_m)
    _lora_shrink_kernel[(num_segs, grid_m)](
        buf, x, a, seg.starts, seg.lens, seg.slots,
        IN=in_features, NR=nr, NR_PAD=nr_pad, BLOCK_M=block_m, BLOCK_K=min(64, max(16, triton.next_power_of_2(in_features))),
    )  # fmt: skip
    block_n = min(64, max(16, triton.next_power_of_2(out)))
    _lora_expand_kernel[(num_segs, grid_m, triton.cdiv(out, block_n))](
        y, buf, b, seg.starts, seg.lens, seg.slots,
        OUT=out, NR=nr, NR_PAD=nr_pad, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
