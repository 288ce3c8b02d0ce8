"""Small helpers every benchmark shares: the machine it ran on, JSON output with one summary
line, the practical matmul peak."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from kvroute.benchmarks import options


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_result(name: str, result: dict[str, Any], summary: str, out: str | None = None) -> Path:
    """Write ``result`` (plus machine info) as JSON to ``out`` or, by the results rule
    (``options.py``), ``<results>/<name>.json``, and print the one summary line."""
    path = options.result_file(name, out)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **result}
    path.write_text(json.dumps(payload, indent=2))
    print(f"{name}: {summary}  [{path}]")
    return path


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5) -> float:
    """The practical peak: the best GFLOP/s of one large matmul, as torch's ``a @ b`` or
    as the engine's CPU Linears run it (``PackedLinear``: the weight prepacked for oneDNN,
    in fp32 for bf16 where oneDNN cannot reorder bf16; on AMD CPUs MKL's fp32 ``a @ b``
    reaches only half of it)."""
    from kvroute.replica.models.decoder import PackedLinear

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    ways = [lambda: a @ b]
    if torch.backends.mkldnn.is_available():
        with torch.device("meta"):
            linear = torch.nn.Linear(n, n, bias=False)
        linear.weight = torch.nn.Parameter(b, requires_grad=False)  # a @ b.T: the same FLOPs
        packed = PackedLinear(linear)
        ways.append(lambda: packed(a))
    best = float("inf")
    for way in ways:
        way()  # warm up
        for _ in range(repeats):
            t = time.perf_counter()
            way()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9
