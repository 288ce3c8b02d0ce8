"""One external worker as the pool (``cluster/worker_pool.py``) holds it: its spec (what
``serve.yaml``'s ``workers`` and ``POST /admin/workers`` give), what the pool learnt of
it (up or down, the model and adapters it serves, its load, why it failed), its KV event
subscriber, and how ``/admin/workers`` and ``/metrics`` show it.

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

import httpx
import zmq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.worker_load import WorkerRates
from kvroute.cluster.worker_probe import bounded_get, endpoint_error
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
    client: Optional[httpx.AsyncClient] = None  # its own HTTP client (the pool's event loop)

    async def get(self, timeout_s: float, path: str) -> httpx.Response:
        """GET ``path`` of the worker, its whole answer within ``timeout_s``. One client
        (and kept connection) per worker: one shared client's pool scans every
        connection per request, which grows with the fleet."""
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        return await bounded_get(self.client, self.spec.url + path, timeout_s)

    async def close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()


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


async def recheck_events(w: Worker, gen: int, config: ClusterConfig, routers: list) -> None:
    """Check ``w``'s event endpoint again (its tick, every few seconds): the error shown
    follows it, and a subscriber that could not start before is started now. Nothing
    changes if ``w`` was taken out meanwhile (``gen``)."""
    error = await endpoint_error(w.spec.kv_events_endpoint)
    if w.generation != gen or not w.up:
        return
    if w.subscriber is None:  # its endpoint could not be bound before: try again
        subscribe(w, error, config, routers)
        if w.subscriber is None:
            return
    elif bool(error) != bool(w.events_error):
        log.warning("worker %s: KV event endpoint %s", w.spec.worker_id, error or "reachable again")
    w.events_error, w.events_checked_at = error or "", time.monotonic()


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


def pool_metrics_text(described: Optional[dict[str, Any]], model_name: str) -> bytes:
    """A pool's ``describe()`` (None: it did not answer) as Prometheus text:
    ``kvroute:worker_pool_up``, ``kvroute:worker_pool_last_tick_age_seconds`` (since its
    last completed round of polls: it grows while its loop is stuck),
    ``kvroute:worker_pool_ticks_total``, and per worker ``kvroute:worker_up``,
    ``kvroute:worker_polls_total`` and ``kvroute:worker_last_tick_age_seconds``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest

    one, labels = ["model_name"], ["model_name", "worker"]
    up = GaugeMetricFamily("kvroute:worker_pool_up", "1 when the worker pool answered this scrape.", labels=one)
    up.add_metric([model_name], float(described is not None))
    families = [up]
    if described is not None:
        pool = described["pool"]
        age = GaugeMetricFamily("kvroute:worker_pool_last_tick_age_seconds",
                                "Seconds since the worker pool last completed a round of polls.", labels=one)  # fmt: skip
        if pool["last_tick_age_s"] is not None:
            age.add_metric([model_name], pool["last_tick_age_s"])
        ticks = CounterMetricFamily("kvroute:worker_pool_ticks", "Rounds of polls the worker pool completed.", labels=one)
        ticks.add_metric([model_name], pool["ticks"])
        w_up = GaugeMetricFamily("kvroute:worker_up", "1 while the worker is in routing.", labels=labels)
        polls = CounterMetricFamily("kvroute:worker_polls", "Successful /metrics polls of the worker.", labels=labels)
        w_age = GaugeMetricFamily("kvroute:worker_last_tick_age_seconds",
                                  "Seconds since the worker's last finished poll or probe.", labels=labels)  # fmt: skip
        for w in described["workers"]:
            w_up.add_metric([model_name, w["id"]], float(w["state"] == "up"))
            polls.add_metric([model_name, w["id"]], w["polls"])
            if w["last_tick_age_s"] is not None:
                w_age.add_metric([model_name, w["id"]], w["last_tick_age_s"])
        families += [age, ticks, w_up, polls, w_age]

    class _Families:
        def collect(self) -> list:
            return families

    return generate_latest(_Families())  # type: ignore[arg-type]
