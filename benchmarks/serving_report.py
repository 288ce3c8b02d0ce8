"""What the serving benchmark reports: the metrics of ``vllm bench serve`` (same key
names) from the requests' outcomes, per-request arrays, the printed table and summary
line, and the best hit rate any router could reach on a workload."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvroute.benchmarks import workloads as wl
from kvroute.benchmarks.serving_config import DEFAULT_PERCENTILES, RequestOutcome
METRICS = ("ttft", "tpot", "itl", "e2el")


def best_prefix_cache_hit_rate(workload: wl.Workload, block_size: int) -> float:
    """Cached / prompt tokens if one cache saw every request in arrival order and kept
    every full prompt block: a request's hit is its leading full blocks some earlier
    request already had (the last prompt token is always computed). This is the hit
    rate of a fleet that serves every group on one replica after its first request,
    the ceiling of any router (it ignores requests that overlap in time)."""
    seen: set[int] = set()
    cached = total = 0
    order = sorted(range(len(workload.requests)), key=lambda i: (workload.requests[i].arrival_s, i))
    for i in order:
        ids = workload.requests[i].prompt_token_ids
        total += len(ids)
        h, hit, matching = 0, 0, True
        hashes = []
        for b in range(len(ids) // block_size):
            h = hash((h, ids[b * block_size : (b + 1) * block_size]))
            hashes.append(h)
            if matching and b < (len(ids) - 1) // block_size and h in seen:
                hit += block_size
            else:
                matching = False
        cached += hit
        seen.update(hashes)
    return cached / total if total else 0.0


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The metrics of ``vllm bench serve`` (same key names) plus the cache hit rate."""
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    duration_s = max(duration_s, 1e-9)
    series = {
        "ttft": [o.ttft_s * 1000 for o in ok if o.ttft_s is not None],
        "tpot": [o.tpot_s * 1000 for o in ok if o.tpot_s is not None],
        "itl": [x * 1000 for o in ok for x in o.itl_s],
        "e2el": [o.e2el_s * 1000 for o in ok if o.e2el_s is not None],
    }
    reported = [o for o in ok if o.cached_tokens is not None]
    reported_prompt = sum(o.prompt_tokens for o in reported)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(o.cached_tokens or 0 for o in reported),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "prefix_cache_hit_rate": (sum(o.cached_tokens for o in reported) / reported_prompt) if reported_prompt else None,
    }
    for name, values in series.items():
        arr = np.asarray(values, dtype=np.float64)
        have = arr.size > 0
        out[f"mean_{name}_ms"] = float(arr.mean()) if have else 0.0
        out[f"median_{name}_ms"] = float(np.median(arr)) if have else 0.0
        out[f"std_{name}_ms"] = float(arr.std()) if have else 0.0
        for p in percentiles:
            out[f"p{_pct_name(p)}_{name}_ms"] = float(np.percentile(arr, p)) if have else 0.0
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def per_request(outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    """Per-request arrays, as ``vllm bench serve`` saves them (seconds)."""
    return {
        "request_ids": [o.request_id for o in outcomes],
        "start_times": [o.start_s for o in outcomes],
        "input_lens": [o.prompt_tokens for o in outcomes],
        "cached_lens": [o.cached_tokens for o in outcomes],
        "output_lens": [o.output_tokens for o in outcomes],
        "ttfts": [o.ttft_s for o in outcomes],
        "e2els": [o.e2el_s for o in outcomes],
        "itls": [o.itl_s for o in outcomes],
        "errors": [o.error for o in outcomes],
        "ingresses": [o.ingress for o in outcomes],
    }


def format_table(result: dict[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES, title: str = "Serving Benchmark Result") -> str:
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total cached tokens:", result["total_cached_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
        ("Prefix cache hit rate:", "n/a" if result["prefix_cache_hit_rate"] is None else f"{result['prefix_cache_hit_rate']:.3f}"),
    ]
    if result.get("best_prefix_cache_hit_rate") is not None:
        rows.append(("Best possible hit rate:", f"{result['best_prefix_cache_hit_rate']:.3f}"))
    lines = [f"{' ' + title + ' ':=^50}"]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    heads = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)", "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in METRICS:
        lines.append(f"{heads[name]:-^50}")
        label = name.upper()
        lines.append(f"{'Mean ' + label + ' (ms):':<40}{result[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{'Median ' + label + ' (ms):':<40}{result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            lines.append(f"{'P' + _pct_name(p) + ' ' + label + ' (ms):':<40}{result[f'p{_pct_name(p)}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> str:
    hit = result["prefix_cache_hit_rate"]
    best = result.get("best_prefix_cache_hit_rate")
    hit_s = "n/a" if hit is None else f"{hit:.3f}" + (f" (best {best:.3f})" if best is not None else "")
    return (
        f"{result['completed']} ok / {result['failed']} failed in {result['duration']:.1f} s, "
        f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} out tok/s; "
        f"TTFT median {result['median_ttft_ms']:.0f} ms p90 {result.get('p90_ttft_ms', float('nan')):.0f} ms; "
        f"TPOT median {result['median_tpot_ms']:.1f} ms; hit rate {hit_s}"
    )
