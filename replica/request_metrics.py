"""Per-request latency histograms and counters of one engine (stdlib only).

Recorded by ``AsyncEngine`` for every request it streams, read as a plain JSON-able
report (``EngineMetrics.report``) that crosses process boundaries and is rendered as
Prometheus text at the HTTP edge under vLLM's metric names.
"""

from __future__ import annotations

import bisect
import os
import resource
from typing import Any

# Bucket bounds in seconds, the ones vLLM exposes, so dashboards built for it apply.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Counts per bucket (``le`` upper bounds, plus +Inf), sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), "bucket bounds must increase"
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def report(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class EngineMetrics:
    """What one engine measured about the requests it served."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def on_token(self, since_arrival_s: float, since_last_s: float | None, num_tokens: int) -> None:
        """A delta with ``num_tokens`` new tokens arrived (``since_last_s`` is None for the first)."""
        if num_tokens <= 0:
            return
        if since_last_s is None:
            self.ttft.observe(since_arrival_s)
        else:
            self.itl.observe(since_last_s / num_tokens)
        self.generation_tokens += num_tokens

    def on_finish(self, reason: str, e2e_s: float, num_prompt_tokens: int) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(e2e_s)
        self.prompt_tokens += num_prompt_tokens

    def report(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft.report(),
            "itl_s": self.itl.report(),
            "e2e_s": self.e2e.report(),
            "finished": dict(self.finished),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "process": process_figures(),
        }


def process_figures() -> dict[str, int]:
    """This process's id and resident memory in bytes (current on Linux, where
    /proc/self/statm has it; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"pid": os.getpid(), "rss_bytes": rss}
