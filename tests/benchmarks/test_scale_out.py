"""The scale-out benchmark's report (``benchmarks/scale_out.py``): only the requests that
start within the window after the new replica serves count, the new replica's apart."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from kvroute.benchmarks.scale_out import _report  # noqa: E402


def _rec(start: float, by: str, cached: int, prompt: int = 100, **kw) -> dict:
    return {"start": start, "served_by": by, "prompt": prompt, "cached": cached, "ttft": 0.1, **kw}


def test_the_window_and_the_new_replicas_share():
    records = [
        _rec(1.0, "old", 0),  # before the new replica served
        _rec(5.0, "new", 20), _rec(6.0, "new", 60), _rec(6.5, "old", 90), _rec(7.0, "old", 90),
        _rec(8.0, "new", 0, error="gone"),  # failed: left out
        _rec(20.0, "new", 0),  # past the window
    ]
    xfer = {"warmup_prefixes": 1, "warmup_blocks": 2, "warmup_tokens": 32, "warmup_skipped": 0, "warmup_s": 0.5}
    r = _report(records, "new", joined_at=3.0, ready_at=4.0, window_s=10.0, xfer=xfer, prefixes=8)
    assert (r["window_requests"], r["new_requests"], r["errors"]) == (4, 2, 1)
    assert r["new_hit_rate"] == pytest.approx(0.4) and r["fleet_hit_rate"] == pytest.approx(0.65)
    assert r["ratio"] == pytest.approx(0.4 / 0.65) and r["join_s"] == 1.0
    assert r["warmup"]["warmup_tokens"] == 32


def test_the_joined_replicas_hit_rate_and_share_from_their_counters():
    from kvroute.benchmarks.router_report import joined_hit

    spread = {"a": {"requests": 30, "prompt_tokens": 3000, "cached_tokens": 2700},
              "new": {"requests": 10, "prompt_tokens": 1000, "cached_tokens": 500}}
    assert joined_hit(spread, ["new"]) == {"joined_hit_rate": 0.5, "joined_request_share": 0.25}
    assert joined_hit(spread, ["gone"]) == {"joined_hit_rate": None, "joined_request_share": 0.0}
