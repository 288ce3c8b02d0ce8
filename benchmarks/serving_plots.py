"""PNG plots of serving benchmark results (matplotlib, Agg backend): TTFT CDF per run,
prefix-cache hit rate per run, TTFT against request rate per router. Each takes the
result dicts that :func:`kvroute.benchmarks.serving.benchmark` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(results: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """One empirical CDF of per-request TTFT (ms) per labelled result."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in results.items():
        ttfts = np.sort([t * 1000 for t in r["ttfts"] if t is not None])
        if ttfts.size:
            ax.step(ttfts, np.arange(1, ttfts.size + 1) / ttfts.size, where="post", label=label)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Time to first token")
    return _save(fig, plt, path)


def hit_rates(results: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Prefix-cache hit rate per labelled result, with the best possible as a line."""
    plt = _pyplot()
    labels = list(results)
    rates = [results[k].get("prefix_cache_hit_rate") or 0.0 for k in labels]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar(range(len(labels)), rates, color="tab:blue")
    for bar, rate in zip(bars, rates):
        ax.text(bar.get_x() + bar.get_width() / 2, rate + 0.01, f"{rate:.2f}", ha="center", fontsize=8)
    best = [results[k].get("best_prefix_cache_hit_rate") for k in labels]
    if best and best[0] is not None:
        ax.axhline(best[0], color="tab:red", ls="--", lw=1, label=f"best possible {best[0]:.2f}")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("prefix cache hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Prefix cache hit rate")
    return _save(fig, plt, path)


def ttft_vs_rate(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, stats: Sequence[str] = ("median", "p90")) -> Path:
    """Per router (key), TTFT median (solid) and p90 (dashed) against request rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"median": "-", "p90": "--", "p99": ":", "mean": "-."}
    for i, (label, results) in enumerate(runs.items()):
        pts = sorted((float(r["request_rate"]), r) for r in results if r.get("request_rate") not in (None, "inf"))
        if not pts:
            continue
        color = f"C{i}"
        for s in stats:
            ax.plot([x for x, _ in pts], [r[f"{s}_ttft_ms"] for _, r in pts], styles.get(s, "-"), marker="o",
                    color=color, label=f"{label} {s}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("TTFT vs request rate")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
