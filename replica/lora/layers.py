"""The layers that apply LoRA adapters and the device slots they hold (ARCHITECTURE.md
§4, LoRA adapters).

``LoRALinear`` wraps one of the model's fused Linears (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``). PEFT's per-projection ``A``/``B`` land on the fused
output slices: the slot's ``a`` stacks the slices' ``A`` (``[S·R, in]``, rank padded
to ``max_lora_rank`` = ``R`` with zeros) and its ``b`` is block diagonal
(``[out, S·R]``: slice *j*'s ``B × scale`` at its output rows and rank columns *j*), so
one product serves every slice and an untargeted slice adds exact zeros.

``LayerSlots`` (the bookkeeping of ``slots.py``) wraps a model's Linears and keeps the
registered adapters on the host (at most ``max_cpu_loras``) and ``max_loras`` device
slots in the wrappers, assigned least recently used first. Each eager step, ``lay_out`` makes
the step's adapters resident and sets the ``LoRABatch`` (``batch.py``) the wrappers read;
a graph-replayed decode step takes ``row_slots`` instead, which the graph's buffers carry.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from kvroute.kernels import ops
from kvroute.replica.lora.batch import LoRABatch
from kvroute.replica.lora.peft import LoRAAdapter, module_shapes, read_adapter
from kvroute.replica.lora.slots import AdapterSlots
from kvroute.replica.models.arch import ModelArch

# Fused Linear -> the PEFT projections side by side in its output.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip


class LoRALinear(nn.Module):
    """``base(x)`` plus, for the rows of each adapter, that adapter's low-rank product."""

    def __init__(self, base: nn.Module, fan_in: int, slice_outs: Sequence[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base, self.batch = base, batch
        self.slice_outs, self.max_rank = tuple(slice_outs), max_rank
        width = len(slice_outs) * max_rank
        self.a = torch.zeros((max_loras, width, fan_in), dtype=dtype, device=device)  # [slots, S·R, in]
        self.b = torch.zeros((max_loras, sum(slice_outs), width), dtype=dtype, device=device)  # [slots, out, S·R]

    def set_slot(self, slot: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> None:
        """Write one adapter's ``(A, B)`` per slice (None: slice not targeted) into ``slot``."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        row, r0 = 0, 0
        for out, pair in zip(self.slice_outs, pairs):
            if pair is not None:
                a, b = pair
                rank = a.shape[0]
                self.a[slot, r0 : r0 + rank].copy_(a)
                self.b[slot, row : row + out, r0 : r0 + rank].copy_(b * scale)
            row, r0 = row + out, r0 + self.max_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        seg = self.batch.segments
        if seg is not None:
            ops.lora_add(y, x, self.a, self.b, seg)
        return y


def add_lora_layers(model: nn.Module, arch: ModelArch, max_loras: int, max_rank: int, batch: LoRABatch,
                    dtype: torch.dtype, device: torch.device) -> list[dict[str, LoRALinear]]:  # fmt: skip
    """Wrap every layer's fused Linears (after fusing and packing); per layer, the
    wrappers by fused name."""
    shapes = module_shapes(arch)
    out = []
    for layer in model.model.layers:
        wrapped = {}
        for fused, parts in FUSED_SLICES.items():
            owner = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
            lin = LoRALinear(getattr(owner, fused), shapes[parts[0]][0], [shapes[p][1] for p in parts],
                             max_loras, max_rank, batch, dtype, device)  # fmt: skip
            setattr(owner, fused, lin)
            wrapped[fused] = lin
        out.append(wrapped)
    return out


class LayerSlots(AdapterSlots):
    """``AdapterSlots`` whose slots are the wrapped Linears' ``a``/``b`` rows: a slot load
    copies the adapter's weights there (timed). One owner: the model runner."""

    def __init__(self, model: nn.Module, arch: ModelArch, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__(max_loras, max_rank, max_cpu_loras)
        self.arch = arch
        self.batch = LoRABatch()
        self.layers = add_lora_layers(model, arch, max_loras, max_rank, self.batch, dtype, device)

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and validate the PEFT folder, weights too (``peft.py``)."""
        return read_adapter(name, path, self.arch, self.max_rank)

    def lay_out(self, rows: Sequence[tuple[int, int, str | None]], device: torch.device) -> bool:
        """Make the adapters of ``rows`` (``(start, length, adapter or None)``) resident
        and set the step's ``LoRABatch``; whether any row uses an adapter."""
        self.acquire({n for _, _, n in rows if n is not None})
        return self.batch.lay_out(rows, self.resident, device) is not None

    def row_slots(self, names: Sequence[str | None]) -> list[int] | None:
        """Make the adapters of a decode step's rows (``names``: each row's adapter or
        None) resident; each row's slot (-1: the base model), or None when no row uses
        an adapter. For a replayed CUDA graph, which reads the layout from its buffers."""
        used = {n for n in names if n is not None}
        if not used:
            return None
        self.acquire(used)
        return [-1 if n is None else self.resident[n] for n in names]

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> float:
        t0 = time.perf_counter()
        for layer_idx, wrapped in enumerate(self.layers):
            for fused, parts in FUSED_SLICES.items():
                pairs = [adapter.weights.get((layer_idx, p)) for p in parts]
                wrapped[fused].set_slot(slot, pairs, adapter.scale)
        if self.layers and self.layers[0]["qkv_proj"].a.is_cuda:
            torch.cuda.synchronize()  # (copies are asynchronous: time them whole)
        return time.perf_counter() - t0
