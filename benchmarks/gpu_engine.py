"""GPU engine benchmark on random-weight checkpoints (nothing downloaded):

1. decode step time of a Llama-3.2-1B-shaped model (bf16) at batch 1/16/64/256 with 1k
   contexts, CUDA graphs and eager, as a fraction of the HBM roofline
   (bytes of weights + KV read per step / measured device copy bandwidth);
2. prefill tokens/s and model FLOP/s vs the measured bf16 matmul rate for a 2k prompt,
   with and without a 1.5k cached prefix;
3. offline throughput on the nano-vllm shape: 256 requests, input and output lengths
   uniform in [100, 1024], Qwen3-0.6B-shaped random weights, ignore_eos; plus
   transformers' generate on a subset, for scale;
4. with ``--restore``, only this: the host tier's restore of a 6k-token
   Llama-3-8B-shaped prefix against its recompute, and a step with an offload beside it;
5. with ``--cost-model``, only this: the simulator's GPU cost model of each of
   ``--shapes`` (bf16; ``benchmarks/gpu_cost_model.py``), saved as step profiles that the
   simulator and the emulated engine load by name (``replica/step_profiles/``).

Random checkpoints are saved to a temp dir (config + safetensors + a word-level fast
tokenizer) and loaded through the engine's real loader.

    kvroute bench gpu_engine [--quick] [--skip-offline] [--restore | --cost-model [--shapes A,B] [--save-profiles DIR]] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvroute.benchmarks import options
from kvroute.benchmarks.gpu_shapes import (
    SHAPES,
    _median_seconds,
    _rows,
    _sync,
    _time_steps,
    bf16_matmul_flops,
    copy_bandwidth,
    decode_bytes,
    prefill_flops,
    shape_checkpoint,
    weight_bytes_of,
)

def bench_llama(folder: Path, quick: bool) -> dict[str, Any]:
    from kvroute.replica.model_runner import ModelRunner
    from kvroute.replica.models.arch import ModelArch
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.cuda_graphs import default_graph_sizes

    arch = ModelArch.from_hf_config(load_hf_config(folder))
    bs, ctx = 16, 1024
    batches = [1, 16] if quick else [1, 16, 64, 256]
    num_blocks = max(batches) * -(-(ctx + 1) // bs) + 8192 // bs + 16
    runner = ModelRunner(arch, folder, num_blocks, bs, torch.device("cuda"), torch.bfloat16, 8192, default_graph_sizes(256))
    weight_bytes = weight_bytes_of(runner.model)
    body = sum(p.numel() for n, p in runner.model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    bw = copy_bandwidth()
    peak = bf16_matmul_flops()
    out: dict[str, Any] = {"copy_bandwidth_gbs": bw / 1e9, "bf16_matmul_tflops": peak / 1e12, "decode": [], "prefill": []}
    iters = 5 if quick else 20
    for b in batches:
        step = _rows(b, ctx, 1, bs)
        graphs = runner.graphs
        t_graph = _time_steps(runner, step, iters)
        runner.graphs = None
        t_eager = _time_steps(runner, step, iters)
        runner.graphs = graphs
        nbytes = decode_bytes(weight_bytes, arch, b, ctx, 2)
        roofline = nbytes / bw
        out["decode"].append(dict(batch=b, context=ctx, step_ms_graph=t_graph * 1e3, step_ms_eager=t_eager * 1e3,
                                  bytes_per_step=nbytes, roofline_ms=roofline * 1e3,
                                  roofline_fraction_graph=roofline / t_graph, roofline_fraction_eager=roofline / t_eager))  # fmt: skip
        print(f"decode b={b:3d} ctx={ctx}: graph {t_graph*1e3:.2f} ms, eager {t_eager*1e3:.2f} ms, roofline {roofline*1e3:.2f} ms ({roofline/t_graph:.0%})")
    for ctx_cached, new in [(0, 2048), (1536, 512)]:
        t = _time_steps(runner, _rows(1, ctx_cached, new, bs), iters)
        flops = prefill_flops(body, arch, ctx_cached, new)
        out["prefill"].append(dict(cached=ctx_cached, computed=new, step_ms=t * 1e3, prompt_tokens_per_s=(ctx_cached + new) / t,
                                   computed_tokens_per_s=new / t, model_tflops=flops / t / 1e12, fraction_of_matmul=flops / t / peak))  # fmt: skip
        print(f"prefill 2k prompt, {ctx_cached} cached: {t*1e3:.1f} ms, {new/t:.0f} computed tok/s, {flops/t/1e12:.1f} TFLOP/s ({flops/t/peak:.0%} of matmul)")
    return out


def bench_restore(folder: Path, device: torch.device, dtype: torch.dtype, prefix_tokens: int = 6144, iters: int = 10) -> dict[str, Any]:
    """The host tier against recompute for one ``prefix_tokens`` prefix, through the
    model runner's real copy path (one step's ``CopyPlan``, ``replica/host_copies.py``):

    - restore: the prefix's blocks copied back from the host tier (host clock, device
      synchronised; and the GPU's own timing of the copy), against its prefill;
    - restore + 16-token suffix in one step, against prefilling prefix + suffix;
    - the prefill step with an offload of as many blocks beside it, against the prefill
      alone (the offload must not hold the step up; only the compute stream is waited for).
    """
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.kv_cache_manager import CopyPlan
    from kvroute.replica.model_runner import ModelRunner, kv_bytes_per_block
    from kvroute.replica.models.arch import ModelArch
    from kvroute.replica.scheduler import SchedulerOutput

    arch = ModelArch.from_hf_config(load_hf_config(folder))
    bs, suffix = 16, 16
    n = prefix_tokens // bs
    if n < 1 or prefix_tokens % bs:
        raise ValueError(f"prefix_tokens must be a positive multiple of {bs}, got {prefix_tokens}")
    runner = ModelRunner(arch, folder, 2 * n + 16, bs, device, dtype, prefix_tokens + 2 * bs, (), host_blocks=n)
    copies = runner.host_copies
    prefill = _rows(1, 0, prefix_tokens, bs)  # blocks [0, n)
    t_prefill = _time_steps(runner, prefill, iters)
    t_prefill_suffix = _time_steps(runner, _rows(1, 0, prefix_tokens + suffix, bs), iters)
    runner.execute(prefill)  # the prefix's KV in blocks [0, n), offloaded to host blocks [0, n)
    copies.start(CopyPlan([(i, i) for i in range(n)], []))
    copies.join()
    copies.synchronize()
    restore = CopyPlan([], [(i, n + i) for i in range(n)])  # into blocks [n, 2n)

    def restore_only() -> None:
        copies.start(restore)
        copies.join()

    _sync(device)
    copies.take_restore_timings()
    t_restore = _median_seconds(restore_only, iters, lambda: _sync(device))
    _sync(device)
    gpu_timed = statistics.median(s for _, s in copies.take_restore_timings())
    exact = bool(torch.equal(runner.kv_cache[:, :, n : 2 * n], runner.kv_cache[:, :, :n]))
    with_suffix = SchedulerOutput(rows=_rows(1, prefix_tokens, suffix, bs, first_block=n).rows, copies=restore)
    t_restore_suffix = _time_steps(runner, with_suffix, iters)
    # a prefill step over blocks [0, n) while blocks [n, 2n) are offloaded
    beside = SchedulerOutput(rows=prefill.rows, copies=CopyPlan([(n + i, i) for i in range(n)], []))
    compute_done = (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else (lambda: None)
    t_step_offload = _median_seconds(lambda: runner.execute(beside), iters, compute_done)
    copies.synchronize()
    nbytes = n * kv_bytes_per_block(arch, bs, dtype)
    return dict(prefix_tokens=prefix_tokens, blocks=n, bytes=nbytes, prefill_ms=t_prefill * 1e3,
                restore_ms=t_restore * 1e3, restore_ms_gpu_timed=gpu_timed * 1e3,
                restore_gb_per_s=nbytes / t_restore / 1e9, restore_over_prefill=t_restore / t_prefill,
                prefill_with_suffix_ms=t_prefill_suffix * 1e3, restore_and_suffix_ms=t_restore_suffix * 1e3,
                prefill_with_offload_ms=t_step_offload * 1e3, restored_kv_exact=exact)  # fmt: skip


def bench_offline(folder: Path, quick: bool, hf_requests: int) -> dict[str, Any]:
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    n = 32 if quick else 256
    rng = random.Random(0)
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    prompts = [[rng.randrange(10, 151000) for _ in range(k)] for k in ins]
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_num_seqs=256, max_num_batched_tokens=8192,
              kv_cache_memory_gb=8 if quick else 40, max_model_len=4096)  # fmt: skip
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm up
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    produced = sum(len(r.token_ids) for r in res)
    assert produced == sum(outs)
    del llm
    torch.cuda.empty_cache()
    out = dict(requests=n, output_tokens=produced, seconds=dt, output_tokens_per_s=produced / dt)
    print(f"offline nano-vllm shape: {n} requests, {produced} tokens in {dt:.1f} s = {produced/dt:.0f} tok/s")
    # transformers' generate on a subset, batched with left padding, for scale.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    k = min(hf_requests, n)
    batch = 16
    hf_tokens = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, k, batch):
            ps, os_ = prompts[i : i + batch], outs[i : i + batch]
            width = max(map(len, ps))
            ids = torch.tensor([[2] * (width - len(p)) + p for p in ps], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device="cuda")
            model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_), do_sample=False, pad_token_id=2)
            hf_tokens += sum(os_)  # only the tokens each request asked for count
    hf_dt = time.perf_counter() - t
    out["transformers"] = dict(requests=k, batch_size=batch, output_tokens=hf_tokens, seconds=hf_dt, output_tokens_per_s=hf_tokens / hf_dt)
    print(f"transformers generate: {k} requests in batches of {batch}: {hf_tokens/hf_dt:.0f} tok/s")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes, iterations and requests")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--cost-model", action="store_true", help="only measure the simulator's GPU cost model for --shapes")
    ap.add_argument("--shapes", default="llama-3-8b", help=f"cost-model shapes, comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--restore-json", default=None, help="a gpu_restore result whose restore rate the profiles take")
    ap.add_argument("--save-profiles", default=None, help="folder to write each cost model's profile JSON into")
    ap.add_argument("--restore", action="store_true",
                    help="only measure the host tier: a 6k-token Llama-3-8B-shaped prefix restored vs recomputed")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests run through transformers' generate")
    ap.add_argument("--checkpoints", default=None, help="folder keeping the random checkpoints across runs (default: a temp dir)")
    options.add_output(ap, "gpu_engine")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kvroute.benchmarks.gpu_engine needs a CUDA GPU (torch.cuda.is_available() is False)")
    with tempfile.TemporaryDirectory(prefix="kvroute-gpu-bench-") as tmp:
        root = Path(args.checkpoints or tmp)
        if args.restore:
            restore_main(shape_checkpoint("llama-3-8b", root), args)
        elif args.cost_model:
            from kvroute.benchmarks.gpu_cost_model import run_cost_models

            run_cost_models(args.shapes.split(","), root, args.quick, args.restore_json, args.save_profiles, args.out)
        else:
            engine_main(root, args)
    return 0


def restore_main(folder: Path, args: argparse.Namespace) -> None:
    from kvroute.benchmarks.common import write_result

    r = bench_restore(folder, torch.device("cuda"), torch.bfloat16, 6144, 5 if args.quick else 10)
    summary = (f"6k-token Llama-3-8B prefix: restore {r['restore_ms']:.1f} ms ({r['restore_gb_per_s']:.1f} GB/s) "
               f"vs prefill {r['prefill_ms']:.1f} ms = {r['restore_over_prefill']:.2f}x; the prefill with an offload "
               f"beside it {r['prefill_with_offload_ms']:.1f} ms")  # fmt: skip
    write_result("gpu_restore", r, summary, args.out)


def engine_main(root: Path, args: argparse.Namespace) -> None:
    from kvroute.benchmarks.common import write_result

    result: dict[str, Any] = {"llama_3_2_1b": bench_llama(shape_checkpoint("llama-3.2-1b", root), args.quick)}
    if not args.skip_offline:
        result["offline_qwen3_0_6b"] = bench_offline(shape_checkpoint("qwen3-0.6b", root), args.quick, args.hf_requests)
    dec = {d["batch"]: d for d in result["llama_3_2_1b"]["decode"]}
    parts = [f"decode b{b} {d['step_ms_graph']:.2f} ms ({d['roofline_fraction_graph']:.0%} of HBM roofline)" for b, d in dec.items()]
    if "offline_qwen3_0_6b" in result:
        o = result["offline_qwen3_0_6b"]
        parts.append(f"offline {o['output_tokens_per_s']:.0f} tok/s vs transformers {o['transformers']['output_tokens_per_s']:.0f}")
    write_result("gpu_engine", result, "; ".join(parts), args.out)


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
