"""Helpers of the cluster tests (the Ray cluster itself is tests/conftest.py's ``ray_cluster``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until  # noqa: F401  (re-exported for the cluster tests)

ray = pytest.importorskip("ray", reason="the cluster tests need ray[serve] (pip install -e .[serve])")


def tiny_engine(model: Path, **overrides: Any):
    from kvroute.replica.config import EngineConfig

    kwargs: dict[str, Any] = dict(
        model=str(model), block_size=8, num_kv_blocks=256, max_model_len=512, dtype="float32", max_num_seqs=64
    )
    kwargs.update(overrides)
    return EngineConfig(**kwargs)
