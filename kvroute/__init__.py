"""kvroute: multi-replica LLM serving with a prefix-cache-aware router.

The public facade is resolved lazily so that ``import kvroute.router`` never pulls in
torch (ARCHITECTURE.md §1).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvroute.replica.llm",
    "RequestOutput": "kvroute.replica.outputs",
    "SamplingParams": "kvroute.replica.sampling_params",
    "EngineConfig": "kvroute.replica.config",
    "Engine": "kvroute.replica.engine",
    "AsyncEngine": "kvroute.replica.async_engine",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
