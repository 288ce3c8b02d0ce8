"""An external worker's ``/metrics`` page as the ``LoadFigures`` the routers price it by.

The counts come from vLLM's gauges, which ``serve-replica`` exports too
(``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``). The
figures the kvroute policy needs for a predicted TTFT (prefill tokens/s, decode step
seconds, queued prefill) come:

- from ``serve-replica``: its engine's own measured figures, exported as
  ``kvroute:prefill_tokens_per_second``, ``kvroute:decode_step_seconds``,
  ``kvroute:queued_prefill_tokens`` and ``kvroute:queued_prefill_seconds``;
- from vLLM, which exports none of them: estimated by ``WorkerRates`` from how its
  per-request histograms moved over the last ``WINDOW_S`` of polls:
  - decode step = Δ sum / Δ count of ``vllm:inter_token_latency_seconds``;
  - prefill rate = Δ sum of ``vllm:request_prefill_kv_computed_tokens`` (tokens
    computed, cache hits excluded) over min(Δ sum of ``vllm:request_prefill_time_seconds``,
    the window's wall time). While prefills do not overlap, the time they took is the
    time the engine spent on them; once they overlap (several prompts in one step), the
    wall time bounds it, so the rate is the engine's throughput in both cases, as a
    kvroute engine measures its own;
  - queued prefill = ``num_requests_waiting`` × the mean computed tokens per request
    (Δ sum / Δ count of ``request_prefill_kv_computed_tokens``), priced by the router
    at the prefill rate.
  A figure whose histogram did not move in the window keeps its last estimate; before
  the first one (and until a quarter of a window has passed) it is 0 and the router uses the fleet's mean or its defaults
  (``router/load_view.py``).

The pool reads every worker's page every poll, and most of a vLLM page is series the
pool never reads (per-request histograms' buckets, HTTP and process metrics), which a
whole parse with ``prometheus_client`` would pay for. ``parse_load`` keeps only the
lines of the dozen series it needs (a prefix test per line, then the exact name) and
reads those by hand (``kvroute bench worker_pool_cpu``; figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import replace
from typing import Iterator, Optional

from kvroute.replica.kv_events import LoadFigures

WINDOW_S = 10.0  # the estimates follow the histograms' movement over this many seconds
MIN_SPAN = 0.25  # and wait for a window this fraction of WINDOW_S long (a few polls are noise)
_GAUGES = {"vllm:num_requests_running": "num_running", "vllm:num_requests_waiting": "num_waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}  # fmt: skip
# kvroute's own measured figures (serve-replica): LoadFigures field by metric name
OWN_FIGURES = {"kvroute:prefill_tokens_per_second": "prefill_tokens_per_s",
               "kvroute:decode_step_seconds": "decode_step_s",
               "kvroute:queued_prefill_tokens": "queued_prefill_tokens",
               "kvroute:queued_prefill_seconds": "queued_prefill_s"}  # fmt: skip
# vLLM's histograms the estimates read: sample name -> key
_SUMS = {"vllm:inter_token_latency_seconds_sum": "itl_sum", "vllm:inter_token_latency_seconds_count": "itl_count",
         "vllm:request_prefill_time_seconds_sum": "prefill_s",
         "vllm:request_prefill_kv_computed_tokens_sum": "computed",
         "vllm:request_prefill_kv_computed_tokens_count": "requests"}  # fmt: skip
_CACHE_INFO = "vllm:cache_config_info"
_WANTED = (*_GAUGES, *OWN_FIGURES, *_SUMS, _CACHE_INFO)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


class WorkerRates:
    """One worker's estimated prefill rate, decode step and mean computed prompt
    tokens (module docstring), fed one poll's histogram sums at a time."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._polls: deque[tuple[float, dict[str, float]]] = deque()
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        self.mean_prompt_tokens = 0.0  # computed (uncached) tokens per request

    def observe(self, sums: dict[str, float], now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if self._polls and any(sums.get(k, 0.0) < v for k, v in self._polls[-1][1].items()):
            self._polls.clear()  # the worker restarted: its counters began again
        self._polls.append((now, sums))
        while len(self._polls) > 2 and now - self._polls[1][0] >= self.window_s:
            self._polls.popleft()
        t0, old = self._polls[0]
        if now - t0 < MIN_SPAN * self.window_s:
            return

        def d(key: str) -> float:
            return sums.get(key, 0.0) - old.get(key, 0.0)

        if d("itl_count") > 0:
            self.decode_step_s = d("itl_sum") / d("itl_count")
        if d("requests") > 0 and d("computed") > 0:
            self.mean_prompt_tokens = d("computed") / d("requests")
            busy = min(d("prefill_s"), now - t0) if d("prefill_s") > 0 else now - t0
            if busy > 0:
                self.prefill_tokens_per_s = d("computed") / busy

    def figures(self, base: LoadFigures) -> LoadFigures:
        """``base`` (the gauges' counts) with the estimates filled in."""
        return replace(base, prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
                       queued_prefill_tokens=round(base.num_waiting * self.mean_prompt_tokens))  # fmt: skip


def parse_load(
    text: str, ticket: int, rates: Optional[WorkerRates] = None, now: Optional[float] = None
) -> tuple[LoadFigures, dict[str, int]]:
    """A worker's Prometheus text as ``LoadFigures`` (summed over its label sets), and
    the integer fields of vLLM's ``cache_config_info`` where it exports it
    (``num_gpu_blocks``, ``block_size``, …). The worker's own measured figures where it
    exports them; else ``rates``' estimates, fed this page first (none: left 0)."""
    values = {key: 0.0 for key in _GAUGES.values()}
    own: dict[str, float] = {}
    sums: dict[str, float] = {}
    cache: dict[str, int] = {}
    for name, labels, value in _samples(text):
        if name in _GAUGES:
            values[_GAUGES[name]] += value
        elif name in OWN_FIGURES:
            field = OWN_FIGURES[name]
            own[field] = own.get(field, 0.0) + value
        elif name in _SUMS:
            sums[_SUMS[name]] = sums.get(_SUMS[name], 0.0) + value
        else:  # vllm:cache_config_info
            cache = {k: int(v) for k, v in _LABEL.findall(labels) if v.isdigit()}
    figures = LoadFigures(num_waiting=int(values["num_waiting"]), num_running=int(values["num_running"]),
                          kv_usage=min(1.0, values["kv_usage"]), route_ticket=ticket)  # fmt: skip
    if own:
        own["queued_prefill_tokens"] = int(own.get("queued_prefill_tokens", 0))
        return replace(figures, **own), cache
    if rates is not None:
        rates.observe(sums, now)
        figures = rates.figures(figures)
    return figures, cache


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """``(name, labels text, value)`` of the page's samples of the series ``parse_load``
    reads (the rest is skipped unparsed). A sample line is ``name[{labels}] value
    [timestamp]``; a wanted line without a number is a ValueError, as the whole page's
    parse raised before."""
    for line in text.splitlines():
        if not line.startswith(_WANTED):  # comments, blank lines and every other series
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, end = line[:brace], line.rfind("}")
            if end < brace:
                raise ValueError(f"unclosed labels in metrics line {line[:200]!r}")
            labels, rest = line[brace + 1 : end], line[end + 1 :]
        else:
            name, labels, rest = line[:space] if space != -1 else line, "", line[space:] if space != -1 else ""
        if name not in _WANTED:  # a longer name with a wanted prefix (vllm:num_requests_running_by_x)
            continue
        parts = rest.split()
        if not parts:
            raise ValueError(f"no value in metrics line {line[:200]!r}")
        yield name, labels, float(parts[0])
