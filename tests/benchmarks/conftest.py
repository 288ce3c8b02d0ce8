"""The benchmarks' tests share Serve fleets: a test module that runs several
comparisons on one fleet shape asks for ``kept_fleet`` (module-scoped), and its
comparisons swap routers on one deployment instead of each starting and deleting its
own engine replicas (``compare_routers.KeptFleet``: a fixed hash seed, the fleet left
up between comparisons, closed when the module ends)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="module")
def kept_fleet(ray_cluster: str) -> Iterator[Any]:
    from kvroute.benchmarks.compare_routers import KeptFleet

    with KeptFleet(hash_seed=20240607) as kept:
        yield kept


# A hand-made `kvroute bench data_path` JSON (its keys as data_path writes them): the
# real-speed added latency over direct is 10 / 20 ms for kvroute's default path, 2 / 0 ms
# for sglang-router (its p99 below direct's: noise, counted as 0), and vllm-router failed.
HAND_DATA_PATH = {
    "benchmark": "data_path", "time": "2026-12-05T08:00:00+0000", "machine": {"cpu_model": "hand-made", "cpu_count": 2},
    "config": {"rate": 20.0, "seconds": 10.0, "emulate": "gpu_h100_llama3_8b", "time_scale": 0.25},
    "systems": [
        {"system": "kvroute_direct", "open_loop": {"p50_ms": 24.0, "p99_ms": 37.5}},
        {"system": "sglang_router", "open_loop": {"p50_ms": 16.0, "p99_ms": 17.0}},
        {"system": "vllm_router", "error": "RuntimeError: did not start"},
        {"system": "direct", "open_loop": {"p50_ms": 14.0, "p99_ms": 17.5}},
    ],
}  # fmt: skip
HAND_ADDED = {"kvroute": (10.0, 20.0), "kvroute_1router": (10.0, 20.0), "sglang_router": (2.0, 0.0)}


@pytest.fixture
def hand_data_path(tmp_path: Any) -> Any:
    """``HAND_DATA_PATH`` written to a file: its path."""
    import json

    path = tmp_path / "data_path.json"
    path.write_text(json.dumps(HAND_DATA_PATH))
    return path
