"""RMSNorm (+ fused residual add) and in-place RoPE: Triton (interpreted on CPU) against
the references.

Tolerances: RoPE rounds at the same points as the eager expression, so it must match bit
for bit. RMSNorm differs only in the order of the fp32 sum of squares: fp32 1e-6; bf16 at
most one bf16 ulp (atol/rtol 1e-2); the fused residual sum is exact.
"""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kvroute.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference, rms_norm_triton
from kvroute.kernels.rotary import rotary_reference_, rotary_triton_
from kvroute.replica.models.rope import RotaryEmbedding
from tests.kernels.batches import DEVICE

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("shape,dtype", [((5, 96), torch.float32), ((7, 64), torch.bfloat16), ((3, 4, 16), torch.bfloat16)])
def test_triton_rms_norm(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = torch.rand(shape[-1], generator=g).to(DEVICE, dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 80, generator=g).to(DEVICE, dtype)  # 80: not a power of two
    res = torch.randn(6, 80, generator=g).to(DEVICE, dtype)
    w = torch.rand(80, generator=g).to(DEVICE, dtype)
    out, new_res = rms_norm_triton(x, w, 1e-5, res)
    want, want_res = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [(torch.float32, 4, 2, 16), (torch.bfloat16, 6, 2, 64)])
def test_triton_rotary_matches_reference_bit_for_bit(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}).to(DEVICE)  # fmt: skip
    positions = torch.tensor([0, 1, 5, 1000, 4095], device=DEVICE)
    cos, sin = rope.tables(positions, dtype)
    q = torch.randn(5, heads, head_dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(5, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    q2, k2 = q.clone(), k.clone()
    rotary_reference_(q, k, cos, sin)
    rotary_triton_(q2, k2, cos, sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_rotary_reference_is_rotate_half():
    """Hugging Face's convention: pairs (i, i + D/2) rotate by angle position * inv_freq[i]."""
    rope = RotaryEmbedding(16, 64, 10000.0, None)
    positions = torch.arange(7)
    cos, sin = rope.tables(positions, torch.float32)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    angle = positions[:, None, None].float() * inv  # [7, 1, 8]
    want = []
    for x in (q, k):
        x1, x2 = x[..., :8], x[..., 8:]
        want.append(torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1))
    rotary_reference_(q, k, cos, sin)
    torch.testing.assert_close(q, want[0])
    torch.testing.assert_close(k, want[1])


@pytest.mark.usefixtures("triton_available")
@pytest.mark.parametrize("shape,dtype", [((5, 96), torch.float32), ((7, 2 * 1100), torch.bfloat16), ((2, 3, 32), torch.bfloat16)])
def test_triton_silu_and_mul(shape, dtype):
    """One kernel for silu(gate) * up, rounding where the eager pair does (1100: more than
    one column block per row, and not a power of two)."""
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 4).to(DEVICE, dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=TOL[dtype], rtol=TOL[dtype])
