"""Kernel microbenchmarks on a CUDA GPU (Triton vs the torch references):

- decode attention (Llama-3.2-1B and Qwen3-0.6B head shapes, batch 1/16/64/256, contexts
  1k and 8k): time, KV bytes read / time as a fraction of the measured copy bandwidth,
  for split-K slices 1 (no split), the launcher's choice and a sweep (is split-K worth it?);
- prefill attention: a 2k prompt and a 512-token chunk over a 1.5k cached prefix, TFLOP/s;
- KV store: a 2048-token chunk through the Triton per-token store vs the torch reference;
- fused add+RMSNorm and RoPE: GB/s.

    kvroute bench kernels [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from kvroute.benchmarks import options

HEADS = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128)}


def _meta(ctx_lens: list[int], q_lens: list[int], block_size: int, device: str) -> Any:
    """Metadata for sequences on disjoint, shuffled block ranges."""
    from kvroute.kernels.attention_metadata import AttentionMetadata

    tables, slots, qsl = [], [], [0]
    nxt = 0
    for c, q in zip(ctx_lens, q_lens):
        n = -(-(c + q) // block_size)
        table = list(range(nxt, nxt + n))
        nxt += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        qsl.append(qsl[-1] + q)
    width = max(map(len, tables))
    perm = torch.randperm(nxt, generator=torch.Generator().manual_seed(0))
    bt = perm[torch.tensor([t + [0] * (width - len(t)) for t in tables])].to(torch.int32)
    slot_t = torch.tensor(slots)
    slot_t = perm[slot_t // block_size] * block_size + slot_t % block_size
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    return AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        bt.to(device),
        slot_t.to(device),
        qsl,
        seq_lens,
        list(ctx_lens),
    ), nxt


def _bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds (Triton's do_bench: warm-up, L2 flush between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_bench(lambda: dst.copy_(src)) / 1e3)


def bench_decode(quick: bool, bw: float) -> list[dict[str, Any]]:
    from kvroute.kernels import ops
    from kvroute.kernels.paged_attention import paged_attention_reference, paged_attention_triton

    rows = []
    for name, (h, kvh, d) in HEADS.items():
        for ctx in [1024] if quick else [1024, 8192]:
            for b in [1, 16] if quick else [1, 16, 64, 256]:
                if b * ctx > 256 * 1024:
                    continue
                meta, nblocks = _meta([ctx - 1] * b, [1] * b, 16, "cuda")
                kc = torch.randn(nblocks, 16, kvh, d, device="cuda", dtype=torch.bfloat16)
                vc = torch.randn_like(kc)
                q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
                kv_bytes = 2 * b * ctx * kvh * d * 2
                auto = ops.decode_splits(b, kvh, q.device)
                row: dict[str, Any] = dict(model=name, batch=b, context=ctx, auto_splits=auto, kv_bytes=kv_bytes)
                for s in sorted({1, 2, 4, 8, 16, auto}):
                    ms = _bench(lambda: paged_attention_triton(q, kc, vc, meta, d**-0.5, num_splits=s))
                    row[f"splits_{s}_us"] = ms * 1e3
                    row[f"splits_{s}_bw_fraction"] = kv_bytes / (ms / 1e3) / bw
                if b * ctx <= 64 * 1024:
                    row["reference_us"] = _bench(lambda: paged_attention_reference(q, kc, vc, meta, d**-0.5)) * 1e3
                rows.append(row)
                best = min((k for k in row if k.startswith("splits_") and k.endswith("_us")), key=row.get)
                print(f"decode {name} b={b} ctx={ctx}: no split {row['splits_1_us']:.1f} us "
                      f"({row['splits_1_bw_fraction']:.0%} of copy BW), auto({auto}) {row[f'splits_{auto}_us']:.1f} us, best {best}")  # fmt: skip
    return rows


def bench_prefill(quick: bool) -> list[dict[str, Any]]:
    from kvroute.kernels.paged_attention import paged_attention_reference, paged_attention_triton

    rows = []
    for name, (h, kvh, d) in HEADS.items():
        for ctx, new in [(0, 2048), (1536, 512)]:
            meta, nblocks = _meta([ctx], [new], 16, "cuda")
            kc = torch.randn(nblocks, 16, kvh, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            q = torch.randn(new, h, d, device="cuda", dtype=torch.bfloat16)
            pairs = sum(ctx + i + 1 for i in range(new))
            flops = 4 * h * d * pairs
            ms = _bench(lambda: paged_attention_triton(q, kc, vc, meta, d**-0.5))
            ref = _bench(lambda: paged_attention_reference(q, kc, vc, meta, d**-0.5))
            rows.append(dict(model=name, cached=ctx, computed=new, triton_us=ms * 1e3, reference_us=ref * 1e3,
                             triton_tflops=flops / (ms / 1e3) / 1e12))  # fmt: skip
            print(f"prefill attention {name} {ctx}+{new}: triton {ms*1e3:.0f} us ({flops/(ms/1e3)/1e12:.1f} TFLOP/s), reference {ref*1e3:.0f} us")
    return rows


def bench_kv_store(bw: float) -> list[dict[str, Any]]:
    from kvroute.kernels.kv_store import store_kv_reference, store_kv_triton

    rows = []
    for name, (_, kvh, d) in HEADS.items():
        for bs in (16, 32):
            meta, nblocks = _meta([2048], [2048], bs, "cuda")
            kc = torch.zeros(nblocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            k = torch.randn(2048, kvh, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            tri = _bench(lambda: store_kv_triton(k, v, kc, vc, meta.slot_mapping))
            ref = _bench(lambda: store_kv_reference(k, v, kc, vc, meta.slot_mapping))
            nbytes = 2 * 2 * k.numel() * 2  # read + write, K and V
            rows.append(dict(model=name, block_size=bs, tokens=2048, triton_us=tri * 1e3, reference_us=ref * 1e3,
                             triton_bw_fraction=nbytes / (tri / 1e3) / bw, reference_bw_fraction=nbytes / (ref / 1e3) / bw))  # fmt: skip
            print(f"kv store {name} block {bs}: triton {tri*1e3:.1f} us ({nbytes/(tri/1e3)/bw:.0%} of copy BW), "
                  f"reference {ref*1e3:.1f} us ({ref/tri:.2f}x)")  # fmt: skip
    return rows


def bench_norm_rope(bw: float) -> dict[str, Any]:
    from kvroute.kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_triton
    from kvroute.kernels.rotary import rotary_reference_, rotary_triton_

    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16)
    tri = _bench(lambda: rms_norm_triton(x, w, 1e-5, r))
    ref = _bench(lambda: fused_add_rms_norm_reference(x, r, w, 1e-5))
    q = torch.randn(2048, 32, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2048, 8, 64, device="cuda", dtype=torch.bfloat16)
    cos = torch.rand(2048, 1, 64, device="cuda", dtype=torch.bfloat16)
    sin = torch.rand_like(cos)
    rope_tri = _bench(lambda: rotary_triton_(q, k, cos, sin))
    rope_ref = _bench(lambda: rotary_reference_(q, k, cos, sin))
    norm_bytes = 4 * x.numel() * 2
    rope_bytes = 2 * (q.numel() + k.numel()) * 2
    out = dict(add_rms_norm_us=tri * 1e3, add_rms_norm_reference_us=ref * 1e3, add_rms_norm_bw_fraction=norm_bytes / (tri / 1e3) / bw,
               rope_us=rope_tri * 1e3, rope_reference_us=rope_ref * 1e3, rope_bw_fraction=rope_bytes / (rope_tri / 1e3) / bw)  # fmt: skip
    print(f"add+rmsnorm 2048x2048: {tri*1e3:.1f} us (reference {ref*1e3:.1f}); rope 2048 tok: {rope_tri*1e3:.1f} us (reference {rope_ref*1e3:.1f})")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    options.add_output(ap, "kernels")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kvroute.benchmarks.kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    from kvroute.benchmarks.common import write_result

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw/1e9:.0f} GB/s")
    decode = bench_decode(args.quick, bw)
    prefill = bench_prefill(args.quick)
    store = bench_kv_store(bw)
    norm = bench_norm_rope(bw)
    result = dict(copy_bandwidth_gbs=bw / 1e9, decode=decode, prefill=prefill, kv_store=store, norm_rope=norm)
    d16 = next((r for r in decode if r["batch"] == 16 and r["context"] == 1024), decode[0])
    summary = (
        f"decode b16 ctx1k {d16['splits_1_us']:.0f} us ({d16['splits_1_bw_fraction']:.0%} of copy BW); "
        f"prefill 2k {prefill[0]['triton_tflops']:.0f} TFLOP/s; "
        f"kv store 2k {store[0]['triton_us']:.1f} us ({store[0]['reference_us'] / store[0]['triton_us']:.2f}x faster than torch)"
    )
    write_result("kernels", result, summary, args.out)
    return 0


if __name__ == "__main__":
    from kvroute.benchmarks.cli import module_main

    raise SystemExit(module_main(__spec__.name))
