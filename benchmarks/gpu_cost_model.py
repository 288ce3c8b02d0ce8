"""The simulator's GPU cost model, measured on this engine (``gpu_engine --cost-model``).

For each model shape (bf16, random weights through the real loader): decode steps over a
grid of batch sizes and context lengths (replayed from the engine's CUDA graphs, as the
engine runs) and single-prompt prefill steps, fitted to
``overhead + batch * per_seq + context_tokens * per_ctx_token`` and
``prefill_tokens / rate`` (replica/profiles.py). Each fit is written as a step profile
``gpu_<card>_<shape>.json`` (card, date and command in it) that
``replica/profiles.get_profile`` loads by name once it is in ``replica/step_profiles/``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    return torch.linalg.lstsq(a, torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()


def bench_cost_model(folder: Path, quick: bool, label: str) -> dict[str, Any]:
    """Step times of the checkpoint in ``folder`` through the engine's ModelRunner,
    fitted to the simulator's cost model."""
    from kvroute.benchmarks.gpu_shapes import _rows, _time_steps, kv_bytes_per_token, weight_bytes_of
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.cuda_graphs import default_graph_sizes
    from kvroute.replica.model_runner import ModelRunner
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(folder))
    bs = 16
    batches = [1, 16, 64] if quick else [1, 8, 16, 32, 64, 128]
    contexts = [512, 2048] if quick else [256, 1024, 2048, 4096]
    grid = [(b, c) for b in batches for c in contexts if b * c <= 128 * 2048]  # KV of at most 256k tokens
    max_rows = max(b * -(-(c + 1) // bs) for b, c in grid)
    prefills = [512, 2048] if quick else [256, 512, 1024, 2048, 4096]
    num_blocks = max(max_rows, -(-max(prefills) // bs)) + 16
    t0 = time.perf_counter()
    runner = ModelRunner(arch, folder, num_blocks, bs, torch.device("cuda"), torch.bfloat16, 8192, default_graph_sizes(max(batches)))
    load_s = time.perf_counter() - t0
    kv_per_token = kv_bytes_per_token(arch, 2)
    iters = 5 if quick else 10
    decode, prefill = [], []
    for b, c in grid:
        t = _time_steps(runner, _rows(b, c, 1, bs), iters)
        decode.append(dict(batch=b, context=c, step_ms=t * 1e3))
        print(f"{label} decode b={b:3d} ctx={c:4d}: {t*1e3:.2f} ms")
    for n in prefills:
        t = _time_steps(runner, _rows(1, 0, n, bs), iters)
        prefill.append(dict(tokens=n, step_ms=t * 1e3))
        print(f"{label} prefill {n:4d} tokens: {t*1e3:.2f} ms ({n/t:.0f} tok/s)")
    overhead, per_seq, per_ctx = _least_squares([[1.0, d["batch"], d["batch"] * d["context"]] for d in decode],
                                                [d["step_ms"] / 1e3 for d in decode])  # fmt: skip
    # Prefill: time = overhead + tokens / rate (one row, no decode), fitted with the
    # decode fit's overhead held fixed so the two share one intercept.
    rate = sum(d["tokens"] for d in prefill) / sum(max(d["step_ms"] / 1e3 - overhead, 1e-9) for d in prefill)
    props = torch.cuda.get_device_properties(0)
    weight_bytes = weight_bytes_of(runner.model)
    # KV the card would hold with this model: 90% of its memory less the weights and 4 GiB
    # of activations / graphs (about what the engine's gpu_memory_utilization default leaves).
    kv_tokens = int((0.9 * props.total_memory - weight_bytes - 4 * 2**30) / kv_per_token)
    fit = dict(overhead_s=overhead, decode_s_per_seq=per_seq, attn_s_per_ctx_token=per_ctx, prefill_tokens_per_s=rate,
               kv_blocks_per_replica=kv_tokens // bs)  # fmt: skip
    worst = max(abs(overhead + per_seq * d["batch"] + per_ctx * d["batch"] * d["context"] - d["step_ms"] / 1e3) / (d["step_ms"] / 1e3) for d in decode)
    print(f"{label} fit: overhead {overhead*1e3:.2f} ms, per seq {per_seq*1e6:.1f} us, per ctx token {per_ctx*1e9:.2f} ns, "
          f"prefill {rate:.0f} tok/s, KV {kv_tokens} tokens; decode fit worst error {worst:.0%}")  # fmt: skip
    return dict(shape=label, device=props.name, max_model_len=arch.max_position_embeddings, load_s=load_s, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
                decode=decode, prefill=prefill, fit=fit, decode_fit_worst_rel_error=worst)  # fmt: skip


def card_slug(device_name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``."""
    m = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", device_name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"\W+", "_", device_name)).lower()


def profile_of(result: dict[str, Any], host_copy_bytes_per_s: float, command: str) -> dict[str, Any]:
    """A step profile (replica/profiles.StepProfile's fields) plus where it came from."""
    f = result["fit"]
    name = f"gpu_{card_slug(result['device'])}_{result['shape'].replace('-', '_').replace('.', '_')}"
    date = time.strftime("%Y-%m-%d")
    copies = f"{host_copy_bytes_per_s / 1e9:.1f} GB/s measured host tier restores" if host_copy_bytes_per_s else "no host tier rate"
    return dict(
        name=name, card=result["device"], date=date, command=command,
        source=f"measured: this engine on an {result['device']}, {result['shape']} shape, bf16 ({date}; {copies}; "
               f"decode fit worst error {result['decode_fit_worst_rel_error']:.0%})",
        overhead_s=f["overhead_s"], prefill_tokens_per_s=f["prefill_tokens_per_s"],
        decode_s_per_seq=f["decode_s_per_seq"], attn_s_per_ctx_token=f["attn_s_per_ctx_token"],
        kv_blocks_per_replica=f["kv_blocks_per_replica"], kv_bytes_per_token=result["kv_bytes_per_token"],
        host_copy_bytes_per_s=host_copy_bytes_per_s, max_model_len=result["max_model_len"],
    )  # fmt: skip


def run_cost_models(shapes: list[str], root: Path, quick: bool, restore_json: str | None, save_dir: str | None, out: str | None) -> None:
    from kvroute.benchmarks.common import write_result
    from kvroute.benchmarks.gpu_shapes import SHAPES, shape_checkpoint

    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    host_rate = json.loads(Path(restore_json).read_text())["restore_gb_per_s"] * 1e9 if restore_json else 0.0
    command = f"kvroute bench gpu_engine --cost-model --shapes {','.join(shapes)}" + (" --quick" if quick else "") + (
        f" --restore-json {restore_json}" if restore_json else "")  # fmt: skip
    results, profiles = [], []
    for shape in shapes:
        results.append(bench_cost_model(shape_checkpoint(shape, root), quick, shape))
        torch.cuda.empty_cache()
        profile = profile_of(results[-1], host_rate, command)
        profiles.append(profile)
        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            (Path(save_dir) / f"{profile['name']}.json").write_text(json.dumps(profile, indent=2) + "\n")
    parts = [f"{p['name']}: {p['overhead_s']*1e3:.2f} ms + {p['decode_s_per_seq']*1e6:.0f} us/seq + "
             f"{p['attn_s_per_ctx_token']*1e9:.1f} ns/ctx token, prefill {p['prefill_tokens_per_s']:.0f} tok/s" for p in profiles]  # fmt: skip
    write_result("gpu_cost_model", {"results": results, "profiles": profiles}, "; ".join(parts), out)
