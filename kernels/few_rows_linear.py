"""``x · wᵀ`` for few rows of ``x`` and a wide ``w``: the logits of a decode step.

At decode sizes the lm_head is a weight stream (Llama-3.2-1B: 128,256 x 2,048 bf16 =
0.53 GB per step for at most a few dozen rows), and cuBLAS ran it at ~1.8 TB/s on an
H200 where the layers' GEMMs reach ~3.8 TB/s (benchmarks/GPU_NOTES.md). The Triton
kernel here gives each program ``BLOCK_N`` rows of ``w`` to stream once through the
K loop against all of ``x``'s rows (padded to 16, the smallest ``tl.dot``).

Which launch configuration wins depends on the card and the shape, so the first call
per shape on CUDA times every candidate, cuBLAS included, and keeps the fastest
(:func:`tuning`): never slower than cuBLAS by more than the timing's noise. That first
call must come before any CUDA graph capture (the decode graphs run each batch size
eagerly first); during a capture an untimed shape takes cuBLAS. Under the interpreter
the first Triton candidate runs, for correctness tests.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import torch

from kvroute.kernels.triton_compat import interpreting, kernel, tl, triton

MAX_ROWS = 64  # above this the product has enough rows for cuBLAS's GEMM tiles


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CANDIDATES = (  # bf16 tiles that fit Hopper's shared memory at BLOCK_M = 64
    Config(64, 128, 4, 4),
    Config(128, 64, 4, 4),
    Config(128, 128, 4, 3),
    Config(128, 128, 8, 4),
    Config(256, 64, 8, 3),
)
CUBLAS = None  # the choice "torch.matmul"
_chosen: dict[tuple, Config | None] = {}
_timings: dict[tuple, dict[str, float]] = {}


@kernel
def _gemv_few_rows_kernel(
    out_ptr, x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if WIDEN:  # the interpreter's bf16 dot returns garbage (Triton 3.9): multiply in fp32
            x, w = x.to(tl.float32), w.to(tl.float32)
        if x.dtype == tl.float32:  # as torch's fp32 matmul: no TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    dst = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: Config) -> None:
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    _gemv_few_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        out, x, w, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, WIDEN=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: Config | None) -> torch.Tensor:
    if cfg is CUBLAS:
        return torch.matmul(x, w.t(), out=out)
    _launch(x, w, out, cfg)
    return out


def _key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    return (max(16, triton.next_power_of_2(x.shape[0])), *w.shape, x.dtype, str(x.device))


def _time_ms(fn, reps: int = 25) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _name(cfg: Config | None) -> str:
    return "cublas" if cfg is CUBLAS else "triton %d/%d/w%d/s%d" % cfg


def _choose(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> Config | None:
    key = _key(x, w)
    if key in _chosen:
        return _chosen[key]
    if x.device.type != "cuda":
        return CANDIDATES[0]  # the interpreter: correctness only
    if x.dtype == torch.float32:
        return CUBLAS  # fp32 (tests) stays on torch's own product
    if torch.cuda.is_current_stream_capturing():
        return CUBLAS  # cannot time inside a capture; not remembered
    times: dict[str, float] = {}
    for cfg in (CUBLAS, *CANDIDATES):
        try:
            times[_name(cfg)] = _time_ms(lambda: _run(x, w, out, cfg))
        except Exception as exc:  # e.g. a configuration needing more shared memory than the card has
            if cfg is CUBLAS:
                raise
            times[_name(cfg)] = float("inf")
            print(f"few_rows_linear: {_name(cfg)} failed: {exc}")
    choice = min((CUBLAS, *CANDIDATES), key=lambda c: times[_name(c)])
    _chosen[key], _timings[key] = choice, times
    return choice


def few_rows_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] · w [N, K]ᵀ`` into ``out [M, N]`` (allocated if None), in ``x``'s dtype
    with float32 accumulation; more than ``MAX_ROWS`` rows go to cuBLAS."""
    m, k = x.shape
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1, "few_rows_linear: bad shapes"
    if out is None:
        out = torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    return _run(x, w, out, _choose(x, w, out) if m <= MAX_ROWS else CUBLAS)


def tuning() -> list[dict]:
    """What the first calls measured: per shape, each candidate's median ms and the choice."""
    rows = []
    for key, times in _timings.items():
        choice = _chosen[key]
        rows.append(dict(block_m=key[0], n=key[1], k=key[2], dtype=str(key[3]), ms=times,
                         chosen=_name(choice)))  # fmt: skip
    return rows
