"""A real local Ray cluster with Serve (no HTTP proxy), started once for the cluster tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need ray[serve] (pip install -e .[serve])")


@pytest.fixture(scope="session")
def ray_cluster():
    from ray import serve

    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False)
    serve.start(proxy_location="Disabled")
    yield
    # Not serve.shutdown(): it waits for every handle's router in this process, and a
    # test that killed replicas or the router actor can leave one waiting. Ending the
    # Ray session ends Serve with it.
    ray.shutdown()


def tiny_engine(model: Path, **overrides: Any):
    from kvroute.replica.config import EngineConfig

    kwargs: dict[str, Any] = dict(
        model=str(model), block_size=8, num_kv_blocks=256, max_model_len=512, dtype="float32", max_num_seqs=64
    )
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
