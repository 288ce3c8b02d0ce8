"""The router comparison's report: one table row per run, the target ratios at each
rate (kvroute against the best other router and against power of two), ``table.md``,
``combined.json`` and the plots (``benchmarks/compare_routers.py`` writes them), and the
figures of one run around its mid-run event: the hit rate in a window after it, the
requests per ingress."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from kvroute.benchmarks import serving
from kvroute.benchmarks.real_speed import SUFFIX, RouterOverhead


def table_rows(results: dict[str, dict[str, Any]], overhead: Optional[RouterOverhead] = None) -> list[dict[str, Any]]:
    """One row per run; with ``overhead``, each row also carries its router's real-speed
    added latency and the TTFTs plus it (``real_speed.RouterOverhead.annotate``)."""
    rows = []
    for key, r in results.items():
        routing = r.get("routing") or {}
        rows.append({
            "run": key, "router": r["router"], "rate": r["request_rate"], "completed": r["completed"], "failed": r["failed"],
            "hit_rate": r["prefix_cache_hit_rate"], "best_hit_rate": r["best_prefix_cache_hit_rate"],
            "req_s": r["request_throughput"], "out_tok_s": r["output_throughput"],
            "ttft_median_ms": r["median_ttft_ms"], "ttft_p90_ms": r.get("p90_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms"),
            "tpot_median_ms": r["median_tpot_ms"], "e2el_median_ms": r["median_e2el_ms"],
            # kvroute's own: requests routed without the router, and |predicted - actual| cached tokens / prompt tokens
            "fallbacks": routing.get("fallbacks"),
            "pred_cached_err": (routing["cached_tokens_abs_error"] / max(r["total_input_tokens"], 1)
                                if routing.get("routed_requests") else None),  # (none: the router predicted nothing)
            # decision quality (kvroute's /metrics): the reuse the directory saw available and the
            # router captured, per offered token; peers have only delivered (hit) and best possible
            "available_rate": _share(routing, "available"), "captured_rate": _share(routing, "captured"),
            "cpu_cores": r.get("fleet_cpu_cores"),  # the whole fleet's CPU (benchmarks/cpu_account.py)
        })  # fmt: skip
    return [overhead.annotate(r) for r in rows] if overhead else rows


def _share(routing: dict[str, float], figure: str) -> float | None:
    """``figure`` per offered token over the run; None when the run offered none (no
    kvroute prediction) or the counters went backwards (an ingress's counts left the
    sums mid-run: no figure rather than a wrong one)."""
    offered = routing.get("reuse:offered")
    return routing.get(f"reuse:{figure}", 0.0) / offered if offered and offered > 0 else None


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    cols = [("router", "router", "{}"), ("rate", "rate", "{}"), ("ok", "completed", "{}"), ("err", "failed", "{}"),
            ("hit", "hit_rate", "{:.3f}"), ("avail", "available_rate", "{:.3f}"), ("capt", "captured_rate", "{:.3f}"),
            ("best", "best_hit_rate", "{:.3f}"), ("req/s", "req_s", "{:.2f}"),
            ("tok/s", "out_tok_s", "{:.1f}"), ("TTFT p50", "ttft_median_ms", "{:.0f}"), ("TTFT p90", "ttft_p90_ms", "{:.0f}"),
            ("TTFT p99", "ttft_p99_ms", "{:.0f}"), ("TPOT p50", "tpot_median_ms", "{:.1f}"), ("E2E p50", "e2el_median_ms", "{:.0f}"),
            ("CPU cores", "cpu_cores", "{:.2f}")]
    return markdown_table(rows, cols + plus_router_cols(rows))


def plus_router_cols(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Where the rows carry the routers' real-speed added latency: its columns (the
    added p50 / p99, then TTFT p50 / p90 / p99 plus it); else none."""
    if not any(("ttft_p90_ms" + SUFFIX) in r for r in rows):
        return []
    return [("added p50 (real)", "router_added_p50_ms", "{:.1f}"), ("added p99 (real)", "router_added_p99_ms", "{:.1f}"),
            ("TTFT p50 +added", "ttft_median_ms" + SUFFIX, "{:.0f}"), ("p90 +added", "ttft_p90_ms" + SUFFIX, "{:.0f}"),
            ("p99 +added", "ttft_p99_ms" + SUFFIX, "{:.0f}")]  # fmt: skip


def markdown_table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table: ``cols`` are (heading, row key, format); a missing value is n/a."""
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join("n/a" if r.get(k) is None else f.format(r[k]) for _, k, f in cols) + " |")
    return "\n".join(lines)


def target_ratios(results: dict[str, dict[str, Any]], rate: Any, overhead: Optional[RouterOverhead] = None) -> dict[str, Any]:
    """At one rate: kvroute's hit rate vs the best possible, its p90 TTFT vs the best of
    the others, and its p90 TTFT / throughput vs power of two; with ``overhead``, the
    p90 ratios again (``*_plus_router``) with each router's real-speed added p99 on its
    p90 (a router without a figure: 0 ms, named in ``counted_without_added``)."""
    at = {r["router"]: r for r in results.values() if r["request_rate"] == rate}
    k = at.get("kvroute")
    if k is None:
        return {}
    out: dict[str, Any] = {"rate": rate}
    if k["prefix_cache_hit_rate"] is not None and k["best_prefix_cache_hit_rate"]:
        out["kvroute_hit_over_best"] = k["prefix_cache_hit_rate"] / k["best_prefix_cache_hit_rate"]
    others = {n: r for n, r in at.items() if n != "kvroute" and r["completed"]}
    if others:
        best_name = min(others, key=lambda n: others[n]["p90_ttft_ms"])
        out["best_other_router"] = best_name
        out["kvroute_p90_ttft_over_best_other"] = k["p90_ttft_ms"] / max(others[best_name]["p90_ttft_ms"], 1e-9)
    p2 = at.get("power_of_two")
    if p2 is not None and p2["completed"]:
        out["kvroute_p90_ttft_over_power_of_two"] = k["p90_ttft_ms"] / max(p2["p90_ttft_ms"], 1e-9)
        out["kvroute_throughput_over_power_of_two"] = k["request_throughput"] / max(p2["request_throughput"], 1e-9)
    if overhead is not None:
        out.update(_plus_router_ratios(k, others, p2, overhead))
    out["errors"] = sum(r["failed"] for r in at.values())
    return out


def _plus_router_ratios(k: dict[str, Any], others: dict[str, dict[str, Any]], p2: Optional[dict[str, Any]],
                        overhead: RouterOverhead) -> dict[str, Any]:  # fmt: skip
    """kvroute's p90 ratios with every router's added latency counted."""
    out: dict[str, Any] = {}
    ours = overhead.plus("kvroute", k["p90_ttft_ms"], "p99")
    if ours is None:
        return {"plus_router_note": "no data_path figure for kvroute"}
    p90 = {n: overhead.counted(n, r["p90_ttft_ms"], "p99") for n, r in others.items()}
    if p90:
        best = min(p90, key=lambda n: p90[n])
        out["best_other_router_plus_router"] = best
        out["kvroute_p90_ttft_over_best_other_plus_router"] = ours / max(p90[best], 1e-9)
    if p2 is not None and p2["completed"]:
        out["kvroute_p90_ttft_over_power_of_two_plus_router"] = ours / max(p90["power_of_two"], 1e-9)
    out["counted_without_added"] = sorted(n for n in others if overhead.for_router(n) is None)
    return out


def write_outputs(out_dir: Path, results: dict[str, dict[str, Any]], meta: dict[str, Any],
                  overhead: Optional[RouterOverhead] = None) -> dict[str, Any]:  # fmt: skip
    from kvroute.benchmarks import serving_plots as plots

    out_dir.mkdir(parents=True, exist_ok=True)
    for key, r in results.items():
        serving.write_json(r, out_dir / f"{key}.json")
    rows = table_rows(results, overhead)
    rates = sorted({r["request_rate"] for r in results.values()}, key=lambda x: math.inf if x == "inf" else float(x))
    targets = [target_ratios(results, rate, overhead) for rate in rates]
    table = format_rows(rows)
    (out_dir / "table.md").write_text(table + "\n")
    top = rates[-1]
    plots.ttft_cdf({r["router"]: r for r in results.values() if r["request_rate"] == top}, out_dir / "ttft_cdf.png")
    plots.hit_rates({r["router"]: r for r in results.values() if r["request_rate"] == top}, out_dir / "hit_rate.png")
    by_router: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        by_router.setdefault(r["router"], []).append(r)
    plots.ttft_vs_rate(by_router, out_dir / "ttft_vs_rate.png")
    combined = {"benchmark": "compare_routers", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta, "rows": rows, "targets": targets}
    if overhead is not None:
        combined["router_overhead"] = overhead.describe()
    (out_dir / "combined.json").write_text(json.dumps(combined, indent=1))
    return combined


def after_event(r: dict[str, Any], event_s: float, window_s: float) -> dict[str, Any]:
    """The completed requests that started within ``window_s`` after the event: their
    ids and prefix-cache hit rate (the same ids' rate in an undisturbed run compares)."""
    picked = [i for i, (t, err) in enumerate(zip(r["start_times"], r["errors"])) if not err and event_s <= t < event_s + window_s]
    return {"after_event_request_ids": [r["request_ids"][i] for i in picked],
            "after_event_hit_rate": window_hit_rate(r, [r["request_ids"][i] for i in picked])}  # fmt: skip


def joined_hit(spread: dict[str, dict[str, float]], added: Sequence[str]) -> dict[str, Any]:
    """The replicas that joined mid-run (scale-out), from their counters over the run,
    which is their whole life: their prefix-cache hit rate (cached / prompt tokens) and
    their share of the fleet's requests."""
    rows = [spread[rid] for rid in added if rid in spread]
    prompt = sum(r.get("prompt_tokens", 0.0) for r in rows)
    total = sum(r.get("requests", 0.0) for r in spread.values())
    return {"joined_hit_rate": sum(r.get("cached_tokens", 0.0) for r in rows) / prompt if prompt else None,
            "joined_request_share": sum(r.get("requests", 0.0) for r in rows) / total if total else None}  # fmt: skip


def window_hit_rate(r: dict[str, Any], request_ids: Sequence[str]) -> Optional[float]:
    """Cached / prompt tokens over ``request_ids`` of run ``r`` (None: no prompt tokens)."""
    at = {rid: i for i, rid in enumerate(r["request_ids"])}
    idx = [at[rid] for rid in request_ids if rid in at and not r["errors"][at[rid]]]
    prompt = sum(r["input_lens"][i] for i in idx)
    return sum(r["cached_lens"][i] or 0 for i in idx) / prompt if prompt else None


def per_ingress(r: dict[str, Any], ingresses: int) -> list[int]:
    """Completed requests per ingress (the client's side of the spread)."""
    counts = [0] * ingresses
    for i, err in zip(r["ingresses"], r["errors"]):
        counts[i] += not err
    return counts
