"""LoRA's cost on a decode step against the base model's (CUDA only), on the
Llama-3.2-1B shape in bf16 with 1k contexts: the same scheduled step through

- a runner without LoRA (the base decode step, CUDA graphs);
- a runner with ``enable_lora`` (``max_loras`` 8, rank 16) and no row on an adapter;
- the same with every row on one adapter, and with the rows spread over 8 adapters
  (row *i* on adapter *i* mod 8, as a batch of 64 mixed requests is);

each the median of ``iters`` steps (``runner.execute`` with the device synchronised),
and its ratio to the base step; and the 8-adapter step's logits against the same step
run eager (relative norm of the difference; bf16 rounding is ~1e-2). Random PEFT adapters (``benchmarks/lora_adapters.py``)
are read through the engine's loader. The harness uses only what every engine version
has (``ModelRunner``'s ``lora_slots``, ``LayerSlots.read``/``register``), so
``gpu_check.sh`` can run it on a base commit too.

    python3 -m kvroute.benchmarks.gpu_lora --checkpoints DIR [--batches 1,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvroute.benchmarks.gpu_shapes import _rows, _time_steps, shape_checkpoint

ADAPTERS, RANK = 8, 16
DEVICE = "cuda"  # (a CPU smoke run of the harness sets "cpu")


def _runner(folder: Path, batch: int, ctx: int, lora: bool) -> Any:
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.cuda_graphs import default_graph_sizes
    from kvroute.replica.model_runner import ModelRunner
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(folder))
    bs = 16
    num_blocks = batch * -(-(ctx + 1) // bs) + 16
    slots = (ADAPTERS, RANK, None) if lora else None
    return ModelRunner(arch, folder, num_blocks, bs, torch.device(DEVICE), torch.bfloat16, 8192,
                       default_graph_sizes(max(batch, 64)), lora_slots=slots)  # fmt: skip


def _step(batch: int, ctx: int, names: list[str | None]) -> Any:
    step = _rows(batch, ctx, 1, 16)
    for i, row in enumerate(step.rows):
        row.request.lora_name = names[i % len(names)]
    return step


def bench_lora(folder: Path, batches: list[int], ctx: int, iters: int) -> dict[str, Any]:
    from kvroute.benchmarks.lora_adapters import save_random_adapter

    out: dict[str, Any] = {"adapters": ADAPTERS, "rank": RANK, "context": ctx, "steps": []}
    base_ms = {}
    runner = _runner(folder, max(batches), ctx, lora=False)
    for b in batches:
        base_ms[b] = _time_steps(runner, _step(b, ctx, [None]), iters) * 1e3
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    runner = _runner(folder, max(batches), ctx, lora=True)
    with tempfile.TemporaryDirectory(prefix="kvroute-lora-") as tmp:
        names = [f"lora{i}" for i in range(ADAPTERS)]
        for i, name in enumerate(names):
            path = save_random_adapter(Path(tmp) / name, runner.arch, rank=RANK, alpha=2 * RANK, seed=i, std=0.01)
            runner.lora.register(runner.lora.read(name, path))
        for b in batches:
            row = dict(batch=b, base_ms=base_ms[b])
            for label, mix in (("no_adapter", [None]), ("one_adapter", names[:1]), ("adapters_8", names)):
                ms = _time_steps(runner, _step(b, ctx, mix), iters) * 1e3
                row[f"{label}_ms"], row[f"{label}_x"] = ms, ms / base_ms[b]
            # the same 8-adapter step eager: its logits against the (graph-replayed) ones
            step = _step(b, ctx, names)
            fast = runner.execute(step).float().clone()
            graphs, runner.graphs = runner.graphs, None
            eager = runner.execute(step).float()
            runner.graphs = graphs
            row["adapters_8_rel_err_vs_eager"] = float((fast - eager).norm() / eager.norm())
            out["steps"].append(row)
            print(f"b={b:3d}: base {row['base_ms']:.3f} ms; enable_lora, no adapter {row['no_adapter_ms']:.3f} ms "
                  f"({row['no_adapter_x']:.2f}x); 1 adapter {row['one_adapter_ms']:.3f} ms ({row['one_adapter_x']:.2f}x); "
                  f"8 adapters {row['adapters_8_ms']:.3f} ms ({row['adapters_8_x']:.2f}x, logits vs eager "
                  f"{row['adapters_8_rel_err_vs_eager']:.1e})", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", required=True, help="folder keeping the random checkpoints across runs")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    folder = shape_checkpoint("llama-3.2-1b", Path(args.checkpoints))
    with torch.inference_mode():
        result = bench_lora(folder, [int(b) for b in args.batches.split(",")], args.context, args.iters)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
