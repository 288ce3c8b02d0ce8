"""Rotary position embedding applied in place to q and k: torch reference and Triton.

Hugging Face's rotate-half convention (Llama, Mistral, Qwen2/3): with ``x = [x1, x2]``
split at ``head_dim / 2``, ``out = x * cos + [-x2, x1] * sin``. ``cos``/``sin`` are the
per-token rows of the model's tables, already gathered for this step's positions and cast
to the model dtype (as Hugging Face casts them). Both implementations round each product
and the sum to the model dtype, exactly like the eager expression, so they agree bit for
bit. (On the GPU that needs fp fusion off: with it, ``a * c + b * s`` compiles to one fused
multiply-add, whose single rounding differs from the eager product-then-sum in fp32.)
"""

from __future__ import annotations

import torch

from kvroute.kernels.triton_compat import kernel, round_to, tl, triton


def rotary_reference_(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim] (or [T, head_dim]), model dtype
    sin: torch.Tensor,  # [T, 1, head_dim] (or [T, head_dim]), model dtype
) -> None:
    """Rotate q and k in place."""
    if cos.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    for x in (q, k):
        x.copy_(x * cos + _rotate_half(x) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@kernel
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    num_heads,
    num_kv_heads,
    HEADS_PAD: tl.constexpr,  # next power of two >= num_heads (>= num_kv_heads)
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:  # program (t, 0) rotates q's heads, (t, 1) k's
        x_ptr, stride_t, stride_h, n = q_ptr, stride_qt, stride_qh, num_heads
    else:
        x_ptr, stride_t, stride_h, n = k_ptr, stride_kt, stride_kh, num_kv_heads
    cols = tl.arange(0, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    row = t * stride_ct + cols
    ok = cols < HALF
    c1 = tl.load(cos_ptr + row, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=ok, other=0.0).to(tl.float32)
    mask = (heads[:, None] < n) & (cols[None, :] < HALF)
    p1 = x_ptr + t * stride_t + heads[:, None] * stride_h + cols[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # out1 = x1*cos1 + (-x2)*sin1, out2 = x2*cos2 + x1*sin2, rounded like the eager ops.
    o1 = round_to(a * c1[None, :], dt) + round_to(-b * s1[None, :], dt)
    o2 = round_to(b * c2[None, :], dt) + round_to(a * s2[None, :], dt)
    tl.store(p1, round_to(o1, dt).to(dt), mask=mask)
    tl.store(p1 + HALF, round_to(o2, dt).to(dt), mask=mask)


def rotary_triton_(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim] (or [T, head_dim]), model dtype
    sin: torch.Tensor,  # [T, 1, head_dim] (or [T, head_dim]), model dtype
) -> None:
    """Same contract as :func:`rotary_reference_`."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    assert head_dim % 2 == 0, "rotate-half needs an even head_dim"
    cos2, sin2 = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    assert cos2.stride() == sin2.stride() and cos2.stride(1) == 1, "cos/sin rows must be contiguous"
    assert cos.dtype == sin.dtype == q.dtype == k.dtype, "cos/sin must be cast to the model dtype"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be contiguous"
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        q, k, cos2, sin2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0),
        num_heads, k.shape[1],
        HEADS_PAD=triton.next_power_of_2(max(num_heads, k.shape[1])),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), enable_fp_fusion=False,
    )  # fmt: skip
