"""Where one graph-replayed decode step's time goes (CUDA only): a Llama-3.2-1B-shaped
model (bf16, random weights through the real loader) at batch 64 x 1k context.

Prints, per step: the wall time of ``ModelRunner.execute`` (host input preparation,
upload, graph replay, logits), the GPU time of the replay and logits alone (CUDA
events), and the profiler's kernel time split into attention, GEMMs, norms, RoPE, KV
store, activation, logits and copies; the host's share is the wall time less the
GPU's busy time. The HBM roofline of the step is printed beside it.

    kvroute bench gpu_profile [--batches 1,64] [--context 1024] [--checkpoints DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvroute.benchmarks import options

# kernel-name fragments per category, first match wins
CATEGORIES = [
    ("attention", ("paged_attention", "merge_splits")),
    ("kv_store", ("store_kv",)),
    ("norm", ("rms_norm",)),
    ("rope", ("rotary",)),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90", "cublas", "splitk")),
    ("activation", ("silu", "mul", "act_and_mul")),
    ("copy", ("memcpy", "copy", "fill", "elementwise")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def _device_us(evt: Any) -> float:
    return float(getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0))


def kernel_split(prof: Any, steps: int) -> dict[str, float]:
    """Microseconds per step of device time in each category (and each kernel name)."""
    split: dict[str, float] = {}
    names: dict[str, float] = {}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # CPU ops' device time repeats their kernels'
        us = _device_us(evt) / steps
        if us <= 0:
            continue
        split[category(evt.key)] = split.get(category(evt.key), 0.0) + us
        names[evt.key] = names.get(evt.key, 0.0) + us
    return {"by_category_us": split, "by_kernel_us": dict(sorted(names.items(), key=lambda kv: -kv[1])[:25])}


def profile_decode(folder: Path, batch: int, context: int, iters: int = 20) -> dict[str, Any]:
    from kvroute.benchmarks.gpu_shapes import _rows, copy_bandwidth, decode_bytes, weight_bytes_of
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.cuda_graphs import default_graph_sizes
    from kvroute.replica.model_runner import ModelRunner
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(folder))
    bs = 16
    num_blocks = batch * -(-(context + 1) // bs) + 16
    runner = ModelRunner(arch, folder, num_blocks, bs, torch.device("cuda"), torch.bfloat16, 8192, default_graph_sizes(max(batch, 64)))
    step = _rows(batch, context, 1, bs)
    for _ in range(3):
        runner.execute(step)
    torch.cuda.synchronize()
    walls, gpus = [], []
    graphs = runner.graphs
    replay = graphs.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_replay(b: int, n: int, *lora: bool) -> torch.Tensor:
        start.record()
        return replay(b, n, *lora)

    graphs.replay = timed_replay  # type: ignore[method-assign]
    for _ in range(iters):
        t = time.perf_counter()
        runner.execute(step)
        end.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        gpus.append(start.elapsed_time(end) / 1e3)
    graphs.replay = replay  # type: ignore[method-assign]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    out: dict[str, Any] = {}
    for mode in ("graph", "eager"):
        runner.graphs = graphs if mode == "graph" else None
        runner.execute(step)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(iters):
                runner.execute(step)
                torch.cuda.synchronize()
        out[mode] = kernel_split(prof, iters)
    runner.graphs = graphs
    try:
        host = host_phases(runner, step)
    except ImportError:  # an engine from before _StepInputs (a side-by-side with an older commit)
        host = {}
    wall, gpu = statistics.median(walls), statistics.median(gpus)
    nbytes = decode_bytes(weight_bytes_of(runner.model), arch, batch, context, 2)
    roofline = nbytes / copy_bandwidth()
    return dict(batch=batch, context=context, step_ms=wall * 1e3, replay_and_logits_gpu_ms=gpu * 1e3,
                host_ms=(wall - gpu) * 1e3, roofline_ms=roofline * 1e3, roofline_fraction=roofline / wall,
                host_phases_us=host, profile=out)  # fmt: skip


@torch.inference_mode()
def host_phases(runner: Any, step: Any, iters: int = 50) -> dict[str, float]:
    """Host microseconds of a graph-replayed step's phases: building the inputs, loading
    them into the graph's buffers, and launching the graph (each alone, device idle)."""
    from kvroute.replica.model_runner import _StepInputs

    def median_us(fn: Any) -> float:
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    graphs, n = runner.graphs, len(step.rows)
    tables = getattr(runner, "block_tables", None)  # (the persistent tables, where the engine has them)
    build = (lambda: _StepInputs(step.rows, runner.block_size)) if tables is None else \
        (lambda: _StepInputs(step.rows, runner.block_size, tables))  # fmt: skip
    inputs = build()
    b = graphs.load(inputs.input_ids, inputs.positions, inputs.slots, inputs.tables, inputs.seq_lens)
    return dict(inputs=median_us(build),
                load=median_us(lambda: graphs.load(inputs.input_ids, inputs.positions, inputs.slots, inputs.tables, inputs.seq_lens)),
                launch=median_us(lambda: graphs.replay(b, n)))  # fmt: skip


def sweep_decode_attention(bw: float) -> list[dict[str, Any]]:
    """Decode attention's launch options (BLOCK_N x num_warps x num_stages, at the
    launcher's split choice) against the default, Llama-3.2-1B heads, 1k context."""
    from kvroute.benchmarks.kernels import HEADS, _bench, _meta
    from kvroute.kernels import ops
    from kvroute.kernels.paged_attention import paged_attention_triton

    h, kvh, d = HEADS["llama-3.2-1b"]
    ctx, rows = 1024, []
    for b in (1, 64):
        meta, nblocks = _meta([ctx - 1] * b, [1] * b, 16, "cuda")
        kc = torch.randn(nblocks, 16, kvh, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
        splits = ops.decode_splits(b, kvh, q.device)
        kv_bytes = 2 * b * ctx * kvh * d * 2
        default = _bench(lambda: paged_attention_triton(q, kc, vc, meta, d**-0.5, num_splits=splits)) * 1e3
        best = (default, "default")
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    opts = dict(num_warps=warps, num_stages=stages)
                    try:
                        us = _bench(lambda: paged_attention_triton(q, kc, vc, meta, d**-0.5, splits, block_n, opts)) * 1e3
                    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                        print(f"  b{b} block_n {block_n} {opts}: {type(e).__name__}")
                        continue
                    best = min(best, (us, f"block_n={block_n} warps={warps} stages={stages}"))
        rows.append(dict(batch=b, context=ctx, splits=splits, default_us=default, best_us=best[0], best=best[1],
                         default_bw_fraction=kv_bytes / (default / 1e6) / bw, best_bw_fraction=kv_bytes / (best[0] / 1e6) / bw))  # fmt: skip
        print(f"attention b{b} ctx {ctx} (splits {splits}): default {default:.1f} us ({rows[-1]['default_bw_fraction']:.0%} of copy BW), "
              f"best {best[0]:.1f} us ({rows[-1]['best_bw_fraction']:.0%}) at {best[1]}")  # fmt: skip
    return rows


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", default="64", help="comma-separated decode batch sizes ('' for none)")
    ap.add_argument("--checkpoints", default=None, help="folder keeping the random checkpoint across runs")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="also sweep decode attention's launch options")
    options.add_output(ap, "gpu_profile")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kvroute.benchmarks.gpu_profile needs a CUDA GPU")
    from kvroute.benchmarks.common import write_result
    from kvroute.benchmarks.gpu_shapes import copy_bandwidth, shape_checkpoint

    with tempfile.TemporaryDirectory(prefix="kvroute-gpu-profile-") as tmp:
        folder = shape_checkpoint("llama-3.2-1b", Path(args.checkpoints or tmp))
        runs = [profile_decode(folder, int(b), args.context) for b in args.batches.split(",") if b]
    parts = []
    for r in runs:
        print(f"batch {r['batch']}:")
        for mode, split in r["profile"].items():
            cats = split["by_category_us"]
            print(f"  {mode}: kernels {sum(cats.values()):.0f} us/step: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])))  # fmt: skip
            for name, us in list(split["by_kernel_us"].items())[:10]:
                print(f"    {us:8.1f} us  {name[:110]}")
        print("  host: " + ", ".join(f"{k} {v:.0f} us" for k, v in r["host_phases_us"].items()))
        parts.append(f"b{r['batch']}: step {r['step_ms']:.2f} ms = GPU {r['replay_and_logits_gpu_ms']:.2f} + host "
                     f"{r['host_ms']:.2f}, roofline {r['roofline_ms']:.2f} ({r['roofline_fraction']:.0%})")  # fmt: skip
    sweep = sweep_decode_attention(copy_bandwidth()) if args.sweep else []
    write_result("gpu_profile", {"runs": runs, "attention_sweep": sweep}, f"Llama-3.2-1B decode, ctx {args.context}: " + "; ".join(parts), args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
