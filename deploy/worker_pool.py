"""The external workers of a ``kvroute serve --workers`` application: which
OpenAI-compatible servers (vLLM, ``kvroute serve-replica``) exist, which are up, and
what the router actors know of them.

One ``WorkerPool`` per application, a detached Ray actor (``kvroute-workers:<app>``)
that every ingress replica asks for the workers that are up. Every ``poll_interval_s``
it polls each up worker's ``/metrics`` into ``LoadFigures`` (``deploy/worker_load.py``:
vLLM's gauges, and the worker's prefill rate and decode step, measured or estimated)
and hands them to every router actor (``report_load``, also the worker's sign of life); a worker whose poll fails, or that an ingress reports dead
(``mark_down``), is removed from every router and probed (``/health``, then
``/v1/models``) until it answers again. A worker comes up only if it serves the
application's model; its LoRA adapters (the ``/v1/models`` entries with a ``parent``)
are read again every ``MODELS_REFRESH_S``. Its cache entries come from its KV events where it has an event
endpoint (``cluster/kv_subscriber.py``'s ``KVEventSubscriber`` registers it and
streams them); without one it is registered with an empty cache, and the routers'
own pending runs and load increments carry routing.

Load tickets: a worker does not know the routers' tickets, so a poll's figures count
every request routed more than ``TRANSIT_MARGIN_US`` before the poll started (its
``route_ticket``; tickets follow the wall clock), and the increments of later ones stay
on top (``router/load_view.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

import httpx
import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.messages import ROUTER_NAMESPACE
from kvroute.cluster.router_actor import get_or_create_router_actors
from kvroute.deploy.worker_load import WorkerRates, parse_load
from kvroute.replica.kv_events import LoadFigures

log = logging.getLogger(__name__)

TRANSIT_MARGIN_US = 100_000  # a request routed this long before a poll has reached its worker
UNKNOWN_CAPACITY_BLOCKS = 1 << 20  # a worker that names no KV capacity: never skipped for room
MODELS_REFRESH_S = 2.0  # how often an up worker's /v1/models is read again (adapters loaded at run time)


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
class _Worker:
    spec: WorkerSpec
    up: bool = False
    model: Optional[str] = None  # the name it serves (its /v1/models' first id)
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> root (path)
    models_at: float = 0.0  # when its /v1/models was last read
    capacity: int = 0
    load: Optional[LoadFigures] = None
    last_error: str = ""
    subscriber: Any = None
    counters: dict[str, int] = field(default_factory=lambda: {"downs": 0, "ups": 0, "polls": 0})
    rates: WorkerRates = field(default_factory=WorkerRates)  # its prefill rate and decode step, where it names none


def _adapters(models: list[dict[str, Any]]) -> dict[str, str]:
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


class WorkerPool:
    """Plain state and one poll loop (started by the first call); ``WorkerPoolActor``
    is it as a Ray actor."""

    def __init__(self, config: ClusterConfig, specs: Sequence[dict], model_names: Sequence[str],
                 poll_interval_s: float = 1.0, routers: Optional[list] = None) -> None:  # fmt: skip
        self.config = config
        self.model_names = set(model_names)
        self.poll_interval_s = poll_interval_s
        self.routers = routers if routers is not None else get_or_create_router_actors(config)
        self.workers: dict[str, _Worker] = {}
        for s in specs:
            spec = WorkerSpec.model_validate(s)
            if self._clash(spec):
                raise ValueError(f"worker {spec.worker_id} ({spec.url}) is listed twice")
            self.workers[spec.worker_id] = _Worker(spec)
        self._client: Optional[httpx.AsyncClient] = None
        self._task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ API
    async def up_workers(self) -> dict[str, tuple[str, str, dict[str, str]]]:
        """``{worker id: (url, the model name it serves, its LoRA adapters {name: root})}``
        of the workers that are up."""
        self._start()
        return {wid: (w.spec.url, w.model, w.adapters) for wid, w in self.workers.items() if w.up and w.model}

    async def refresh_models(self) -> None:
        """Read every up worker's ``/v1/models`` again now (its adapters changed)."""
        up = [w for w in self.workers.values() if w.up]
        for w, models in zip(up, await asyncio.gather(*(self._models(w) for w in up), return_exceptions=True)):
            if not isinstance(models, BaseException):
                w.adapters, w.models_at = _adapters(models), time.monotonic()

    async def describe(self) -> list[dict[str, Any]]:
        self._start()
        return [self._describe(w) for w in self.workers.values()]

    async def add(self, spec: dict) -> dict[str, Any]:
        """Add a worker (probed at once: up if it answers). ``{"worker": ...}`` or
        ``{"error": message, "status": 400 | 409}``."""
        self._start()
        parsed = WorkerSpec.model_validate(spec)
        if self._clash(parsed):
            return {"error": f"worker {parsed.worker_id} ({parsed.url}) is already in the pool", "status": 409}
        w = _Worker(parsed)
        try:
            await self._probe(w)
        except ValueError as exc:
            return {"error": str(exc), "status": 400}
        self.workers[parsed.worker_id] = w
        return {"worker": self._describe(w)}

    async def remove(self, worker_id: str) -> bool:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return False
        await self._take_out(w, "removed")
        return True

    async def mark_down(self, worker_id: str, reason: str) -> None:
        """An ingress saw the worker fail (connection refused or lost, a 5xx)."""
        w = self.workers.get(worker_id)
        if w is not None and w.up:
            await self._take_out(w, reason)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers.values():
            await self._take_out(w, "pool stopped")

    # ------------------------------------------------------------------ loop
    def _start(self) -> None:
        if self._task is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.gather(*(self._tick(w) for w in list(self.workers.values())), return_exceptions=True)
            await asyncio.sleep(self.poll_interval_s)

    async def _tick(self, w: _Worker) -> None:
        if self.workers.get(w.spec.worker_id) is not w:
            return  # removed meanwhile
        if not w.up:
            try:
                await self._probe(w)
            except ValueError as exc:
                w.last_error = str(exc)
            return
        try:
            w.load, _ = await self._poll(w)
            if time.monotonic() - w.models_at >= MODELS_REFRESH_S:
                w.adapters = _adapters(await self._models(w))
                w.models_at = time.monotonic()
        except (httpx.HTTPError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            await self._take_out(w, f"metrics poll failed: {exc!r}")
            return
        await self._report(w)

    async def _poll(self, w: _Worker) -> tuple[LoadFigures, dict[str, int]]:
        ticket = time.time_ns() // 1000 - TRANSIT_MARGIN_US
        r = await self._client.get(w.spec.url + "/metrics")
        r.raise_for_status()
        w.counters["polls"] += 1
        return parse_load(r.text, ticket, w.rates)

    async def _probe(self, w: _Worker) -> None:
        """Bring ``w`` up if it answers and serves our model (ValueError if it serves
        another); otherwise note why and leave it down."""
        try:
            if (await self._client.get(w.spec.url + "/health")).status_code != 200:
                w.last_error = "health probe did not answer 200"
                return
            models = await self._models(w)
            names = {m["id"] for m in models} | {str(m.get("root")) for m in models if m.get("root")}
            if not names & self.model_names:
                raise ValueError(f"worker {w.spec.worker_id} serves {sorted(names)}, not this application's model "
                                 f"(one of {sorted(self.model_names)})")  # fmt: skip
            w.load, cache = await self._poll(w)
            block_size = self.config.hash_spec.block_size
            if cache.get("block_size", block_size) != block_size:
                raise ValueError(f"worker {w.spec.worker_id} has KV blocks of {cache['block_size']} tokens; this "
                                 f"application hashes blocks of {block_size} (set --block-size to the workers')")  # fmt: skip
            w.capacity = w.spec.capacity_blocks or cache.get("num_gpu_blocks") or await self._server_info_capacity(w)
        except (httpx.HTTPError, KeyError, TypeError, json.JSONDecodeError) as exc:
            w.last_error = f"probe failed: {exc!r}"
            return
        ids = [m["id"] for m in models]
        w.model = next((i for i in ids if i in self.model_names), ids[0])  # the name to send it
        w.adapters, w.models_at = _adapters(models), time.monotonic()
        w.up, w.last_error = True, ""
        w.counters["ups"] += 1
        if w.spec.kv_events_endpoint:
            w.subscriber = start_subscriber(w.spec.worker_id, w.spec, self.config, self.routers, w.capacity)
        if w.subscriber is None:
            await self._register(w)
        log.info("worker %s (%s) is up: %s, %d KV blocks", w.spec.worker_id, w.spec.url, w.model, w.capacity)

    async def _models(self, w: _Worker) -> list[dict[str, Any]]:
        r = await self._client.get(w.spec.url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"]

    async def _server_info_capacity(self, w: _Worker) -> int:
        """``serve-replica``'s ``/get_server_info`` names its KV blocks; else unknown."""
        r = await self._client.get(w.spec.url + "/get_server_info")
        blocks = r.json().get("num_kv_blocks") if r.status_code == 200 else None
        return int(blocks) if isinstance(blocks, int) and blocks > 0 else UNKNOWN_CAPACITY_BLOCKS

    async def _register(self, w: _Worker, routers: Optional[list] = None) -> None:
        """Register ``w`` with an empty cache (no KV events) on ``routers`` (default: all)."""
        calls = [r.register.remote(w.spec.worker_id, self.config.hash_spec, w.capacity, [], 0, w.load)
                 for r in (routers or self.routers)]  # fmt: skip
        for exc in (a for a in await asyncio.gather(*calls, return_exceptions=True) if isinstance(a, Exception)):
            log.warning("worker %s: a router refused or missed its registration: %r", w.spec.worker_id, exc)

    async def _report(self, w: _Worker) -> None:
        calls = [r.report_load.remote(w.spec.worker_id, w.load) for r in self.routers]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        unknown = [r for r, ok in zip(self.routers, answers) if ok is False]
        if unknown and w.subscriber is None:  # a router restarted empty
            await self._register(w, unknown)

    async def _take_out(self, w: _Worker, reason: str) -> None:
        was_up, w.up, w.last_error = w.up, False, reason
        if w.subscriber is not None:
            await asyncio.to_thread(w.subscriber.stop)  # joins its thread, unregisters from the routers
            w.subscriber = None
        calls = [r.remove_replica.remote(w.spec.worker_id) for r in self.routers]
        await asyncio.gather(*calls, return_exceptions=True)
        if was_up:
            w.counters["downs"] += 1
            log.warning("worker %s (%s) taken out of routing: %s", w.spec.worker_id, w.spec.url, reason)

    # ------------------------------------------------------------------ helpers
    def _clash(self, spec: WorkerSpec) -> bool:
        return spec.worker_id in self.workers or any(w.spec.url == spec.url for w in self.workers.values())

    def _describe(self, w: _Worker) -> dict[str, Any]:
        return {
            "id": w.spec.worker_id, "url": w.spec.url, "state": "up" if w.up else "down", "model": w.model,
            "adapters": sorted(w.adapters), "capacity_blocks": w.capacity or None, "kv_events": w.subscriber is not None, "last_error": w.last_error or None,
            "load": None if w.load is None else {"num_running": w.load.num_running, "num_waiting": w.load.num_waiting,
                                                 "kv_usage": w.load.kv_usage, "prefill_tokens_per_s": w.load.prefill_tokens_per_s,
                                                 "decode_step_s": w.load.decode_step_s},
            **w.counters,
        }  # fmt: skip


WorkerPoolActor = ray.remote(num_cpus=0, max_restarts=-1)(WorkerPool)


def pool_actor_name(app_name: str) -> str:
    return f"kvroute-workers:{app_name}"


def get_or_create_worker_pool(config: ClusterConfig, specs: Sequence[dict], model_names: Sequence[str],
                              poll_interval_s: float) -> Any:  # fmt: skip
    """The application's pool actor, created on first use (detached, like the routers)."""
    return WorkerPoolActor.options(name=pool_actor_name(config.app_name), namespace=ROUTER_NAMESPACE,
                                   lifetime="detached", get_if_exists=True).remote(
        config, list(specs), list(model_names), poll_interval_s)  # fmt: skip


def kill_worker_pool(app_name: str) -> bool:
    try:
        actor = ray.get_actor(pool_actor_name(app_name), namespace=ROUTER_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
