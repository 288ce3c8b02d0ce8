"""Small JSON documents kept in Ray's GCS internal KV, so an actor that dies and is
restarted by Ray reads back what it had (the worker pool's worker list, the LoRA
registry's adapters), and an application's block-hash seed (``cluster/app_state.py``). One namespace for all of kvroute's state;
the caller picks a key that names its actor. Every function needs a process connected
to Ray (an actor, or a driver after ``ray.init``).
"""

from __future__ import annotations

import json
from typing import Any

KV_NAMESPACE = "kvroute"


def save_json(key: str, value: Any) -> None:
    """Store ``value`` (JSON-serialisable) under ``key``, replacing what was there."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, json.dumps(value), overwrite=True, namespace=KV_NAMESPACE)


def save_json_once(key: str, value: Any) -> Any:
    """Store ``value`` under ``key`` unless something is stored there already; returns
    what is stored (the first writer's value wins, whoever reads it)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, json.dumps(value), overwrite=False, namespace=KV_NAMESPACE)
    return load_json(key)


def load_json(key: str) -> Any:
    """What ``save_json`` stored under ``key``; None when nothing is."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def delete_saved(key: str) -> bool:
    """Forget ``key``; True when something was stored."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE) > 0
