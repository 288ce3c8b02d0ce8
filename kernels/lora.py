"""Batched LoRA: add each row's low-rank product ``(x · Aᵀ) · Bᵀ`` to a Linear's output,
for a batch whose rows use different adapters (or none).

The batch is described by segments (``LoRASegments``): runs of rows that use one adapter
slot; rows outside every segment (the base model's) are left alone. A segment covers
entries ``[start, start + len)`` of the step's row order: the rows themselves when the
layout has no ``order`` (a prefill's runs of consecutive rows), else ``order[start:
start + len]`` (a decode batch's rows grouped by slot, so each adapter's weights are
read once per step, not once per row run). Adapters sit in stacked tensors, one slot
each: ``a [slots, NR, in]`` and ``b [slots, out, NR]`` (``NR`` the slot's rank width,
padded with zeros; the adapter's scale already folded into ``b``).

- ``lora_add_reference``: torch, grouped by adapter (the rows of one slot gathered,
  multiplied by its A then its B, added back), used on CPU.
- ``lora_add_triton``: two Triton kernels in the punica SGMV style: *shrink*
  (``x · Aᵀ``, the input dimension split over programs, partial sums into an fp32
  buffer ``[splits, T, NR]``) and *expand* (the partials summed, ``· Bᵀ`` added onto
  ``y``). Their grids depend only on the segment count and the layout's
  ``row_programs``, never on the lengths, which the kernels read on the device: a layout
  whose tensors are static buffers (``LoRASegments.static``) can be captured in a CUDA
  graph and replayed with new lengths and orders, the programs of an empty segment
  returning at once.

Both compute the two products in fp32 and round the sum ``y + delta`` once, so they
differ only in summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroute.kernels.triton_compat import kernel, tl, triton

_SPLIT_K = 512  # input columns per shrink program when the input is split
_WIDE_GRID = 64  # segments x row programs from which the shrink's input is not split


@dataclass(frozen=True)
class LoRASegments:
    """A step's adapter layout over its token rows.

    ``starts``/``lens``/``slots`` (int32, on the device, ``[S]``): segment *s* covers
    entries ``[starts[s], starts[s] + lens[s])`` of the row order and uses adapter slot
    ``slots[s]``. ``order`` (int32 ``[T]`` on the device, or None for the identity): the
    row order. ``groups``: per slot, the row indices it covers (``[n]`` int64), for the
    grouped torch path (None: read from the device tensors). ``max_len``: the longest
    segment's bound; ``row_programs``: programs per segment along its rows (each takes
    every ``row_programs``-th block of ``block_m`` rows).
    """

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor], ...] | None
    max_len: int
    order: torch.Tensor | None = None
    row_programs: int = 0  # 0: one per row block of the longest segment

    @property
    def block_m(self) -> int:
        return 16 if self.max_len <= 16 else 32

    @property
    def grid_m(self) -> int:
        return self.row_programs or triton.cdiv(self.max_len, self.block_m)

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

    @classmethod
    def static(cls, order: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
               max_rows: int) -> "LoRASegments":  # fmt: skip
        """A layout over buffers that are rewritten between launches (a CUDA graph's
        inputs): one segment per slot, ``order`` the rows grouped by slot, lengths of at
        most ``max_rows`` (the graph's batch size); see ``group_rows``."""
        return cls(starts=starts, lens=lens, slots=slots, groups=None, max_len=max_rows, order=order,
                   row_programs=max(1, max_rows // 64))  # fmt: skip

    def host_groups(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """``groups``, read back from the device tensors when the layout has none."""
        if self.groups is not None:
            return self.groups
        out: dict[int, list[int]] = {}
        order = self.order.tolist() if self.order is not None else None
        for start, length, slot in zip(self.starts.tolist(), self.lens.tolist(), self.slots.tolist()):
            rows = order[start : start + length] if order is not None else range(start, start + length)
            if length:
                out.setdefault(slot, []).extend(rows)
        dev = self.starts.device
        return tuple((s, torch.tensor(r, dtype=torch.int64, device=dev)) for s, r in out.items())


def group_rows(row_slots, num_slots: int):
    """A decode batch's layout for ``LoRASegments.static``: ``(order, starts, lens)`` as
    int32 numpy arrays, the rows of ``row_slots`` (slot per row, -1: the base model's)
    grouped by slot in row order, ``starts``/``lens`` per slot ``0..num_slots-1``."""
    import numpy as np

    s = np.asarray(row_slots, dtype=np.int32)
    order = np.argsort(s, kind="stable").astype(np.int32)
    order = order[s[order] >= 0]
    lens = np.bincount(s[s >= 0], minlength=num_slots).astype(np.int32)
    starts = np.zeros(num_slots, dtype=np.int32)
    np.cumsum(lens[:-1], out=starts[1:])
    return order, starts, lens


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoRASegments) -> None:
    """``y[rows] += (x[rows] · a[slot]ᵀ) · b[slot]ᵀ`` for every slot's rows, in place.

    y: [T, out], x: [T, in], a: [slots, NR, in], b: [slots, out, NR]."""
    for slot, rows in seg.host_groups():
        xs = x.index_select(0, rows).float()  # [n, in]
        # F.linear, not `xs @ a.T`: on CPU the transposed matmul takes a much slower path
        delta = F.linear(F.linear(xs, a[slot].float()), b[slot].float())  # [n, out]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


@kernel
def _lora_shrink_kernel(
    part_ptr, x_ptr, a_ptr, starts_ptr, lens_ptr, slots_ptr, order_ptr, T,
    IN: tl.constexpr, NR: tl.constexpr, NR_PAD: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ORDER: tl.constexpr,
):  # fmt: skip
    # program (segment, row program, split): part[split, row] = x[row, split's columns] · a[slot, :, those]ᵀ
    seg = tl.program_id(0)
    split = tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    r = tl.arange(0, NR_PAD)
    for mb in range(tl.program_id(1), tl.cdiv(length, BLOCK_M), tl.num_programs(1)):
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < length
        if HAS_ORDER:
            rows = tl.load(order_ptr + start + m, mask=row_ok, other=0).to(tl.int64)
        else:
            rows = (start + m).to(tl.int64)
        acc = tl.zeros((BLOCK_M, NR_PAD), dtype=tl.float32)
        for k0 in range(split * SPLIT, split * SPLIT + SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + rows[:, None] * IN + k[None, :], mask=row_ok[:, None] & (k[None, :] < IN), other=0.0)
            ak = tl.load(a_ptr + slot * NR * IN + r[None, :] * IN + k[:, None],
                         mask=(r[None, :] < NR) & (k[:, None] < IN), other=0.0)  # [BLOCK_K, NR_PAD]  # fmt: skip
            acc += tl.dot(xk.to(tl.float32), ak.to(tl.float32), input_precision="ieee")
        offs = split.to(tl.int64) * T * NR + rows[:, None] * NR + r[None, :]
        tl.store(part_ptr + offs, acc, mask=row_ok[:, None] & (r[None, :] < NR))


@kernel
def _lora_expand_kernel(
    y_ptr, part_ptr, b_ptr, starts_ptr, lens_ptr, slots_ptr, order_ptr, T,
    OUT: tl.constexpr, NR: tl.constexpr, NR_PAD: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ORDER: tl.constexpr,
):  # fmt: skip
    # program (segment, row program, column block): y[row, cols] += (Σ_split part[split, row]) · b[slot, cols]ᵀ
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, NR_PAD)
    if tl.program_id(1) * BLOCK_M < length:  # (an empty segment reads none of its adapter's weights)
        bt = tl.load(b_ptr + slot * OUT * NR + n[None, :] * NR + r[:, None],
                     mask=(n[None, :] < OUT) & (r[:, None] < NR), other=0.0).to(tl.float32)  # [NR_PAD, BLOCK_N]  # fmt: skip
        for mb in range(tl.program_id(1), tl.cdiv(length, BLOCK_M), tl.num_programs(1)):
            m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = m < length
            if HAS_ORDER:
                rows = tl.load(order_ptr + start + m, mask=row_ok, other=0).to(tl.int64)
            else:
                rows = (start + m).to(tl.int64)
            h = tl.zeros((BLOCK_M, NR_PAD), dtype=tl.float32)
            h_ok = row_ok[:, None] & (r[None, :] < NR)
            for s in range(SPLITS):
                h += tl.load(part_ptr + s * T * NR + rows[:, None] * NR + r[None, :], mask=h_ok, other=0.0)
            delta = tl.dot(h, bt, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
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
    block_m, grid_m = seg.block_m, seg.grid_m
    num_segs = seg.starts.shape[0]
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    # Few row blocks (a decode step): split the input so more programs read A; many (a
    # prefill): one split, each program the whole input.
    width = _SPLIT_K if num_segs * grid_m < _WIDE_GRID else in_features
    split = triton.cdiv(min(width, in_features), block_k) * block_k  # whole BLOCK_K steps per split
    splits = triton.cdiv(in_features, split)
    part = torch.empty((splits, t, nr), dtype=torch.float32, device=x.device)  # only segment rows written
    nr_pad = max(16, triton.next_power_of_2(nr))
    order = seg.order if seg.order is not None else seg.starts  # (not read without an order)
    _lora_shrink_kernel[(num_segs, grid_m, splits)](
        part, x, a, seg.starts, seg.lens, seg.slots, order, t,
        IN=in_features, NR=nr, NR_PAD=nr_pad, SPLIT=split, BLOCK_M=block_m, BLOCK_K=block_k,
        HAS_ORDER=seg.order is not None,
    )  # fmt: skip
    block_n = min(64, max(16, triton.next_power_of_2(out)))
    _lora_expand_kernel[(num_segs, grid_m, triton.cdiv(out, block_n))](
        y, part, b, seg.starts, seg.lens, seg.slots, order, t,
        OUT=out, NR=nr, NR_PAD=nr_pad, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_ORDER=seg.order is not None,
    )  # fmt: skip
