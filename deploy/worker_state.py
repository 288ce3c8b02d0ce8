"""One external worker as the pool (``deploy/worker_pool.py``) holds it: its spec (what
``serve.yaml``'s ``workers`` and ``POST /admin/workers`` give), what the pool learnt of
it (up or down, the model and adapters it serves, its load, why it failed), its KV event
subscriber, and how ``/admin/workers`` shows it.

A worker with a KV event endpoint gets a ``KVEventSubscriber`` once it is up
(``subscribe``), whether or not the endpoint takes a TCP connection then (a ZMQ SUB
socket connects whenever the publisher comes to listen); while it does not,
``/admin/workers`` shows ``kv_events: "unreachable"`` with the error, and how many
messages or replay answers came from it, so a silent endpoint is told from a dead one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

import zmq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.deploy.worker_load import WorkerRates
from kvroute.replica.kv_events import LoadFigures

log = logging.getLogger(__name__)


class WorkerSpec(BaseModel):
    """One external worker, as ``serve.yaml``'s ``workers`` and ``POST /admin/workers`` give it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="the worker's base URL, e.g. http://10.0.0.5:8000")
    id: Optional[str] = Field(default=None, min_length=1, max_length=128, description="default: host:port of url")
    kv_events_endpoint: Optional[str] = Field(default=None, description="its ZMQ KV event publisher, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: Optional[str] = None
    capacity_blocks: Optional[int] = Field(default=None, ge=1, description="its KV cache in blocks (default: asked)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"url must be http(s)://host[:port][/path], got {v!r}")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"url has a bad port: {v!r}") from None
        return v.rstrip("/")

    @property
    def worker_id(self) -> str:
        return self.id or urlsplit(self.url).netloc


@dataclass
class Worker:
    spec: WorkerSpec
    up: bool = False
    model: Optional[str] = None  # the name it serves (its /v1/models' first id)
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> root (path)
    models_at: float = 0.0  # when its /v1/models was last read
    capacity: int = 0
    load: Optional[LoadFigures] = None
    last_error: str = ""
    subscriber: Optional[KVEventSubscriber] = None
    counters: dict[str, int] = field(default_factory=lambda: {"downs": 0, "ups": 0, "polls": 0})
    rates: WorkerRates = field(default_factory=WorkerRates)  # its prefill rate and decode step, where it names none
    generation: int = 0  # bumped by every take-out: what a tick begun before it learnt is dropped
    task: Optional[asyncio.Task] = None  # its tick in progress
    ticked_at: Optional[float] = None  # time.monotonic() of its last finished tick
    events_error: str = ""  # why its KV event endpoint is not usable ("" while it is)
    events_checked_at: float = 0.0


def adapters_of(models: list[dict[str, Any]]) -> dict[str, str]:
    """A worker's LoRA adapters from its ``/v1/models``: the entries with a ``parent``
    (vLLM and kvroute list an adapter so, with its path as ``root``)."""
    return {m["id"]: str(m.get("root") or "") for m in models if m.get("parent")}


def start_subscriber(worker_id: str, spec: WorkerSpec, config: ClusterConfig, routers: list, capacity: int) -> KVEventSubscriber:
    """The worker's KV event subscriber, started: it registers the worker with every
    router and streams its events (``cluster/kv_subscriber.py``)."""
    sub = KVEventSubscriber(worker_id, spec.kv_events_endpoint, config.hash_spec, routers, capacity,
                            replay_endpoint=spec.replay_endpoint)  # fmt: skip
    sub.start()
    return sub


def subscribe(w: Worker, events_error: Optional[str], config: ClusterConfig, routers: list) -> None:
    """Start ``w``'s KV event subscriber (it registers ``w``) and note whether its
    endpoint answered (``events_error``: why not). One that cannot be bound or parsed
    gets none (the caller registers ``w`` without events)."""
    w.events_checked_at = time.monotonic()
    if not w.spec.kv_events_endpoint:
        return
    if events_error:
        log.warning("worker %s: KV event endpoint unreachable: %s", w.spec.worker_id, events_error)
    w.events_error = events_error or ""
    try:
        w.subscriber = start_subscriber(w.spec.worker_id, w.spec, config, routers, w.capacity)
    except (zmq.ZMQError, ValueError, RuntimeError) as exc:
        w.events_error = f"could not subscribe to {w.spec.kv_events_endpoint}: {exc}"
        log.warning("worker %s: %s", w.spec.worker_id, w.events_error)


def describe_worker(w: Worker, now: float) -> dict[str, Any]:
    """``w`` as ``/admin/workers`` lists it (``now``: ``time.monotonic()``)."""
    sub = w.subscriber
    kv_events: Any = "unreachable" if w.events_error else sub is not None
    return {
        "id": w.spec.worker_id, "url": w.spec.url, "state": "up" if w.up else "down", "model": w.model,
        "adapters": sorted(w.adapters), "capacity_blocks": w.capacity or None, "last_error": w.last_error or None,
        "kv_events": kv_events, "kv_events_error": w.events_error or None,
        "kv_events_messages": sub.counters["messages"] + sub.counters["replay_answers"] if sub is not None else 0,
        "last_tick_age_s": None if w.ticked_at is None else now - w.ticked_at,
        "load": None if w.load is None else {"num_running": w.load.num_running, "num_waiting": w.load.num_waiting,
                                             "kv_usage": w.load.kv_usage, "prefill_tokens_per_s": w.load.prefill_tokens_per_s,
                                             "decode_step_s": w.load.decode_step_s},
        **w.counters,
    }  # fmt: skip
