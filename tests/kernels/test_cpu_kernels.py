"""The native CPU kernels (kernels/cpu_kernels.c) against the torch references, built
here with the machine's C compiler as the engine builds them.

Tolerances: decode attention fp32 2e-5, bf16 2e-2 (as the reference against dense);
RoPE must match bit for bit (it rounds where the eager expression rounds); RMSNorm and
SiLU-and-mul at most one bf16 ulp (the order of a float32 sum, an exponential's last
bits); the residual sum and oneDNN-packed Linears exactly (a bf16 Linear packed in fp32,
for CPUs without oneDNN's bf16 reorder, within one bf16 ulp).

The C kernels are tested as built for this CPU and forced down to AVX2 and to the x86-64
baseline (``native_build``: the portable loops); the ops, the packed Linears and the
argmax under every CPU mode (``cpu_mode``, tests/conftest.py), the native kernels off
included.
"""

from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from kvroute.kernels import cpu_capability, cpu_kernels, ops
from kvroute.kernels.kv_store import store_kv_reference
from kvroute.kernels.paged_attention import paged_attention_reference
from kvroute.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from kvroute.kernels.rotary import rotary_reference_
from kvroute.replica.models.decoder import PackedLinear
from kvroute.replica.models.rope import RotaryEmbedding
from tests.conftest import cpu_env
from tests.kernels.batches import build_batch, dense_attention


def paged_attention_cpu(*args):
    return paged_attention_reference(*args, native=True)

ULP = 1e-2  # one bf16 ulp of values of order 1 (relative 2^-7)


@pytest.fixture(autouse=True)
def two_threads_at_least() -> Iterator[None]:
    """At least two torch threads, whatever tests/conftest.py gave this pytest-xdist
    worker: the C kernels split rows and heads over torch's threads, and the shapes
    marked "the threaded path" test that split."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=["native", "avx2", "default"])
def native_build(request: pytest.FixtureRequest) -> Iterator[None]:
    """The C kernels built for the capability the run started with, and for AVX2 and the
    x86-64 baseline (a level the CPU lacks is not forced: the CPU's own build again).
    Fail (not skip) when one does not build: every CI machine has a C compiler, and the
    engine relies on it."""
    env = {"KVROUTE_NATIVE": None} | ({} if request.param == "native" else {cpu_capability.ENV: request.param})
    with cpu_env(env):
        assert cpu_kernels.available(), "the native CPU kernels did not build (see the log)"
        yield


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize(
    "ctx_lens,q_lens",
    [
        ([0, 17, 33, 300, 64], [1, 1, 1, 1, 1]),  # a pure decode step; one sequence of length 1
        ([0, 17, 33, 0, 64], [5, 1, 15, 1, 1]),  # decodes mixed with prefill chunks
        ([40, 0, 7], [300, 129, 1]),  # chunks of several query tiles, with and without context
    ],
)
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (8, 16), (24, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_native_attention_matches_dense(ctx_lens, q_lens, gqa, block_size, head_dim, dtype, tol):
    kvh = 2
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch(ctx_lens, q_lens, block_size, kvh, head_dim, dtype, device="cpu")
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(sum(q_lens), kvh * gqa, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype) * 2
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_cpu(q, kc, vc, meta, scale, new_k, new_v)
    assert out.shape == q.shape and out.dtype == dtype
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        q0 = meta.query_start_loc_cpu[s]
        want = dense_attention(q[q0 : q0 + n], full_k[s], full_v[s], c, scale)
        torch.testing.assert_close(out[q0 : q0 + n].float(), want, atol=tol, rtol=tol)


@pytest.mark.usefixtures("native_build")
def test_native_decode_reads_strided_queries_and_writes_only_decode_rows():
    """Queries as a strided view of one QKV output (as the model passes them); prefill
    rows come from the torch path, decode rows from the kernel, and match the reference."""
    ctx_lens, q_lens = [40, 0, 7], [1, 9, 1]
    kc, vc, meta, *_, new_k, new_v = build_batch(ctx_lens, q_lens, 16, 2, 64, torch.bfloat16, device="cpu")
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    qkv = torch.randn(sum(q_lens), 6 * 64 + 2 * 2 * 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    q = qkv[:, : 6 * 64].view(-1, 6, 64)
    assert not q.is_contiguous()
    got = paged_attention_cpu(q, kc, vc, meta, 0.125)
    want = paged_attention_reference(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("native_build")
def test_native_decode_declines_what_it_does_not_cover():
    ctx_lens, q_lens = [10], [1]
    kc, vc, meta, *_ = build_batch(ctx_lens, q_lens, 16, 1, 64, torch.float16, device="cpu")
    q = torch.randn(1, 20, 64, dtype=torch.float16)
    out = torch.zeros_like(q)
    # fp16 is not a native dtype; a group of 20 query heads per KV head exceeds the limit
    assert not cpu_kernels.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc[:-1], out, 0.1)
    assert not cpu_kernels.decode_attention(
        q.float(), kc.float(), vc.float(), meta.block_tables, meta.seq_lens, meta.query_start_loc[:-1], out.float(), 0.1
    )
    assert out.abs().sum() == 0
    # 160 query heads (a group of 10 over 16 KV heads) exceed the per-thread state
    kc16, vc16, meta16, *_ = build_batch(ctx_lens, q_lens, 16, 16, 64, torch.float32, device="cpu")
    q160 = torch.randn(1, 160, 64)
    assert not cpu_kernels.decode_attention(
        q160, kc16, vc16, meta16.block_tables, meta16.seq_lens, meta16.query_start_loc[:-1], torch.zeros_like(q160), 0.1
    )
    # ...and the op falls back to the reference path for them
    torch.testing.assert_close(
        paged_attention_cpu(q.float(), kc.float(), vc.float(), meta, 0.1),
        paged_attention_reference(q.float(), kc.float(), vc.float(), meta, 0.1),
    )


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 960)])  # 300 x 960: the threaded path
def test_native_rms_norm_and_fused_add(rows, dim):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    res = torch.randn(rows, dim, generator=g).bfloat16()
    w = torch.rand(dim, generator=g).bfloat16()
    res_before = res.clone()
    out, h = cpu_kernels.add_rms_norm(x, res, w, 1e-5)
    want_out, want_h = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(h, want_h) and torch.equal(res, res_before)
    torch.testing.assert_close(out, want_out, atol=ULP, rtol=ULP)
    alone, same = cpu_kernels.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(alone, rms_norm_reference(x, w, 1e-5), atol=ULP, rtol=ULP)


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("tokens", [3, 200])
def test_native_rotary_is_bitwise_the_reference_on_a_qkv_view(tokens):
    heads, kv_heads, d = 9, 3, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(d, 4096, 10000.0, None).tables(positions, torch.bfloat16)
    q, k, v = qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    want_q, want_k = q.clone(), k.clone()
    rotary_reference_(want_q, want_k, cos, sin)
    v_before = v.clone()
    assert cpu_kernels.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, v_before)  # the V columns of the same rows are untouched


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("rows,width", [(2, 1536), (64, 1536), (500, 256)])
def test_native_silu_and_mul(rows, width):
    gate_up = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=ULP, rtol=ULP)
    assert torch.equal(ops.silu_and_mul(gate_up), got)


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("rows,cols", [(1, 7), (3, 1000), (64, 49152)])  # 64 x 49152: threaded
def test_native_argmax_rows_is_torch_argmax_with_first_of_ties(rows, cols):
    x = torch.randn(rows + 1, cols, generator=torch.Generator().manual_seed(6)).bfloat16()[:rows]  # a row view
    x[0, -1] = 100.0  # the maximum on the last column
    if cols > 2:
        x[-1, 1] = x[-1, cols - 1] = 200.0  # equal maxima: the first wins
    x[-1, 0] = -0.0
    got = cpu_kernels.argmax_rows(x)
    assert torch.equal(got, x.float().argmax(dim=1))
    assert torch.equal(ops.argmax_rows(x), got)
    assert cpu_kernels.argmax_rows(x.float()) is None  # bf16 only; ops falls back
    assert torch.equal(ops.argmax_rows(x.float()), got)


def test_ops_use_the_references_when_the_backend_is_forced_to_torch():
    x = torch.randn(4, 2 * 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    with ops.use_backend("torch"):
        assert torch.equal(ops.silu_and_mul(x), F.silu(gate) * up)


def test_ops_match_the_references_in_every_cpu_mode(cpu_mode):
    """What the model calls, whichever implementation runs: the C kernels for this CPU or
    for AVX2, or the torch references (bf16 argmax widened first)."""
    assert cpu_kernels.available() == (cpu_mode != "no_native")
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 576, generator=g) * 2).bfloat16()
    res, w = torch.randn(5, 576, generator=g).bfloat16(), torch.rand(576, generator=g).bfloat16()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), atol=ULP, rtol=ULP)
    out, h = ops.fused_add_rms_norm(x, res, w, 1e-5)
    want_out, want_h = fused_add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out, want_out, atol=ULP, rtol=ULP)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, atol=ULP, rtol=ULP)
    q, k = x.view(5, 9, 64)[:, :6], x.view(5, 9, 64)[:, 6:]
    cos, sin = RotaryEmbedding(64, 4096, 10000.0, None).tables(torch.arange(5) * 300, torch.bfloat16)
    want_q, want_k = q.clone(), k.clone()
    rotary_reference_(want_q, want_k, cos, sin)
    ops.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    logits = torch.randn(3, 1000, generator=g).bfloat16()
    logits[2, 10] = logits[2, 900] = 100.0  # equal maxima: the first wins
    assert torch.equal(ops.argmax_rows(logits), torch.tensor([*logits[:2].float().argmax(dim=1), 10]))


def test_ops_attention_matches_dense_in_every_cpu_mode(cpu_mode):
    ctx_lens, q_lens = [0, 40, 7], [1, 1, 20]
    kc, vc, meta, full_k, full_v, new_k, new_v = build_batch(ctx_lens, q_lens, 16, 2, 64, torch.bfloat16, device="cpu")
    store_kv_reference(new_k, new_v, kc, vc, meta.slot_mapping)
    q = torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = ops.paged_attention(q, kc, vc, meta, 0.125, new_k, new_v)
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        q0 = meta.query_start_loc_cpu[s]
        want = dense_attention(q[q0 : q0 + n], full_k[s], full_v[s], c, 0.125)
        torch.testing.assert_close(out[q0 : q0 + n].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("cpu_mode")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_linear(bias):
    """oneDNN's bf16 path. Bit for bit without a bias. With one, about one run of this file
    in eight gave a last-bit difference (cause not pinned down; not reproduced in
    isolation), so within one bf16 ulp there."""
    if not cpu_capability.current().onednn_bf16_reorder:
        pytest.skip("this CPU has no oneDNN bf16 reorder (needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; "
                    "or KVROUTE_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA took them away)")
    lin = torch.nn.Linear(576, 960, bias=bias).bfloat16()
    packed = PackedLinear(lin)
    assert not packed.widen
    for rows in (1, 64, 300):
        x = torch.randn(rows, 576).bfloat16()
        with torch.no_grad():
            got, want = packed(x), lin(x)
        if bias:
            torch.testing.assert_close(got, want, atol=0, rtol=2**-8)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_without_the_bf16_reorder_is_packed_in_float32(bias):
    """Forced down to AVX2 (on every machine): the weight packed in fp32, the input widened,
    the output rounded once. That is F.linear in fp32 rounded to bf16 up to the summation
    order, and the bf16 Linear within one bf16 ulp."""
    lin = torch.nn.Linear(576, 960, bias=bias).bfloat16()
    with cpu_env({cpu_capability.ENV: "avx2"}):
        packed = PackedLinear(lin)
    assert packed.widen
    wide_bias = None if lin.bias is None else lin.bias.float()
    for rows in (1, 64, 300):
        x = torch.randn(rows, 576).bfloat16()
        with torch.no_grad():
            got, want = packed(x), F.linear(x.float(), lin.weight.float(), wide_bias)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)
            torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=2**-7)


@pytest.mark.usefixtures("cpu_mode")
def test_packed_linear_in_float32_is_the_linear_up_to_summation_order():
    lin = torch.nn.Linear(576, 1536)
    packed = PackedLinear(lin)
    for rows in (1, 64, 300):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("native_build")
def test_loading_the_kernels_keeps_subnormal_floats():
    """The library must not switch the process to flush-to-zero (what -ffast-math's
    startup code does): other libraries' float results would change."""
    import numpy as np

    assert cpu_kernels.available()
    tiny = np.array([1e-39], dtype=np.float32)
    assert float(tiny[0] * np.float32(0.5)) != 0.0
    assert torch.tensor([1e-39]).mul(0.5).item() != 0.0
