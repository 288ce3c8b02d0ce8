"""``few_rows_linear`` (the decode logits' kernel) against a float64 product: under the
Triton interpreter on CPU (the first candidate configuration), every candidate and the
tuner at real sizes on a GPU (tests/kernels/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels import ops
from kvroute.kernels.few_rows_linear import CANDIDATES, MAX_ROWS, _launch, few_rows_linear

pytestmark = pytest.mark.usefixtures("triton_available")


def _case(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    ref = (x.double() @ w.double().T).float()
    return x, w, ref


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float().cpu() - ref.cpu()).norm() / ref.norm())


@pytest.mark.parametrize("m", [1, 5, 16, 33, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64(m, dtype):
    # N and K not multiples of any block: the edge masks are exercised
    x, w, ref = _case(m, 300, 200, dtype)
    out = torch.full((m, 300), float("nan"), dtype=dtype)  # poisoned: every element must be written
    got = few_rows_linear(x, w, out)
    assert got is out and got.dtype == dtype
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_writes_only_its_rows_of_a_wider_buffer():
    x, w, ref = _case(3, 130, 64, torch.float32)
    buf = torch.full((8, 130), -7.0)
    few_rows_linear(x, w, buf[:3])
    assert _rel(buf[:3], ref) < 1e-5
    assert bool((buf[3:] == -7.0).all())


def test_lm_head_dispatch():
    """Triton devices take the kernel for up to MAX_ROWS rows; a head without a plain
    weight (the CPU's prepacked Linear) is called as it is."""
    head = torch.nn.Linear(48, 100, bias=False)
    x = torch.randn(4, 48)
    want = head(x)
    with ops.use_backend("triton"):
        assert torch.allclose(ops.lm_head(x, head), want, atol=1e-5)
        out = torch.empty(4, 100)
        assert ops.lm_head(x, head, out) is out and torch.allclose(out, want, atol=1e-5)
    with ops.use_backend("torch"):
        assert torch.equal(ops.lm_head(x, head), want)


def test_many_rows_and_bad_shapes():
    x, w, ref = _case(MAX_ROWS + 1, 32, 16, torch.float32)
    assert _rel(few_rows_linear(x, w), ref) < 1e-5  # past MAX_ROWS: torch's product
    with pytest.raises(AssertionError, match="few_rows_linear"):
        few_rows_linear(x, w.t())


def test_every_candidate_config_is_correct_under_the_interpreter():
    x, w, ref = _case(7, 260, 300, torch.float32)
    for cfg in CANDIDATES:
        out = torch.full((7, 260), float("nan"))
        _launch(x, w, out, cfg)
        assert _rel(out, ref) < 1e-5, cfg
