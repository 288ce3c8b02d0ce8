"""SiLU-and-mul of the MLP (``silu(gate) * up`` for ``gate_up = [gate | up]``): torch
reference and one Triton kernel (torch's eager path is two kernels, silu then mul, and
on CUDA each is launch-bound at decode sizes, and a step runs them once per layer).

The kernel rounds where the eager expression does: ``silu`` computed in float32 and
rounded to the model dtype, then the product of the two model-dtype values computed in
float32 and rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvroute.kernels.triton_compat import kernel, round_to, tl, triton


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@kernel
def _silu_and_mul_kernel(out_ptr, in_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(in_ptr + row * 2 * width + cols, mask=ok, other=0.0)
    up = tl.load(in_ptr + row * 2 * width + width + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
    tl.store(out_ptr + row * width + cols, round_to(act * up.to(tl.float32), gate.dtype).to(gate.dtype), mask=ok)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * d], contiguous -> [..., d]
    assert gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0, "silu_and_mul needs a contiguous [..., 2d] input"
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * width) if width else 0
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](out, gate_up, width, BLOCK=block)
    return out
