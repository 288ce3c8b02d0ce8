"""RMSNorm, optionally fused with the residual add before it: torch reference and Triton.

Numerics follow Hugging Face's Llama/Qwen: the residual add happens in the model dtype,
the norm in float32, the result is cast back to the model dtype *before* the weight
multiply (``weight * h.to(dtype)``). The Triton kernel rounds at the same points, so the
two differ only in the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch

from kvroute.kernels.triton_compat import kernel, round_to, tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> same shape and dtype as x."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)`` (the new residual stream)."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


@kernel
def _rms_norm_kernel(
    out_ptr,
    res_out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    num_rows,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= DIM
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < DIM)
    offs = rows.to(tl.int64)[:, None] * DIM + cols[None, :]  # [ROWS, BLOCK]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dt = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        # Round the sum to the model dtype first, as the unfused `x + residual` does.
        h = round_to(h + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32), dt)
        tl.store(res_out_ptr + offs, h.to(dt), mask=mask)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(h * h, 1) / DIM + eps))  # [ROWS]
    h = round_to(h * inv[:, None], dt)
    w = tl.load(w_ptr + cols, mask=cols < DIM, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, round_to(h * w[None, :], dt).to(dt), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [..., dim], contiguous
    weight: torch.Tensor,  # [dim]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape and dtype as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_reference`, or with ``residual`` :func:`fused_add_rms_norm_reference`."""
    dim = x.shape[-1]
    assert x.is_contiguous(), "rms_norm needs a contiguous input"
    assert weight.shape == (dim,) and weight.is_contiguous()
    assert weight.dtype == x.dtype, "weight must be in the model dtype (the reference multiplies in it)"
    num_rows = x.numel() // dim
    out = torch.empty_like(x)  # [..., dim]
    res_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
        res_out = torch.empty_like(x)  # [..., dim], the new residual stream
    if num_rows:
        block = triton.next_power_of_2(dim)
        rows = max(1, min(16, 4096 // block))
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            out, res_out, x, residual if residual is not None else x, weight, num_rows, eps,
            DIM=dim, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out if residual is None else (out, res_out)
