"""Feeds the router actors from an external worker's KV events (vLLM's ZMQ stream, or
``kvroute serve-replica --kv-events-config``), so the directory holds what each
worker caches (ARCHITECTURE.md §3.3, external workers).

One ``KVEventSubscriber`` per worker: a thread with a ZMQ SUB socket connected to the
worker's ``endpoint`` (bound instead when it has a wildcard address, for a worker whose
publisher connects, as vLLM's does to a non-wildcard endpoint) turns each batch into kvroute ``KVEvents`` (``router/vllm_events.py``:
``WorkerStream``) and sends them to every router, as an engine replica's
``_RouterLink`` does: per router its own ``EventPublisher`` (own ``seq``), a fresh
registration with a snapshot of the worker's blocks (the stream's own mirror) whenever
that router does not know the worker or saw a gap, and a heartbeat every
``heartbeat_s`` while the worker is quiet (vLLM publishes only steps that change the
cache). On a gap in the worker's ``seq`` it asks the ``replay_endpoint`` for the
missing batches; without one, or when the worker no longer buffers them, the worker's
blocks are dropped (every router gets an empty snapshot) and rebuilt from new events.

A vLLM worker with data parallelism publishes one stream per rank (``endpoint``'s port
plus the rank): one subscriber, and one worker id, per rank.

``routers`` are Ray actor handles (``.register.remote``, ``.push.remote``) or plain
objects with the same methods (a ``RouterService``), called directly. ``stop`` takes the
worker out of every router (``remove_replica``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from kvroute.cluster.publisher import EventPublisher
from kvroute.replica.block_hash import HashSpec
from kvroute.replica.kv_events import KVEvents, LoadFigures
from kvroute.router import vllm_events as wire
from kvroute.router.vllm_events import Gap, WorkerStream

log = logging.getLogger(__name__)

ROUTER_TIMEOUT_S = 10.0
REPLAY_TIMEOUT_S = 2.0


def _call(router: Any, method: str, *args: Any) -> Any:
    fn = getattr(router, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args), timeout=ROUTER_TIMEOUT_S)
    return fn(*args)


class _Link:
    """What the subscriber sends one router."""

    def __init__(self, router: Any, worker_id: str) -> None:
        self.router = router
        self.publisher = EventPublisher(worker_id)
        self.registered = False


class KVEventSubscriber:
    def __init__(self, worker_id: str, endpoint: str, hash_spec: HashSpec, routers: list, capacity_blocks: int,
                 replay_endpoint: str | None = None, heartbeat_s: float = 1.0,
                 host_capacity_blocks: int = 0) -> None:  # fmt: skip
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if not routers:
            raise ValueError("a KV event subscriber needs at least one router")
        self.worker_id, self.endpoint, self.replay_endpoint = worker_id, endpoint, replay_endpoint
        self.hash_spec, self.capacity_blocks, self.heartbeat_s = hash_spec, capacity_blocks, heartbeat_s
        self.host_capacity_blocks = host_capacity_blocks  # the worker's CPU offload blocks ("CPU" medium)
        self.stream = WorkerStream(worker_id, hash_spec)
        self._links = [_Link(r, worker_id) for r in routers]
        self._load: LoadFigures | None = None
        self._lock = threading.Lock()  # stream and links: the thread, stats() and set_load()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self.counters = {"gaps": 0, "replays": 0, "resyncs": 0, "bad_batches": 0, "pushes": 0,
                         "registrations": 0, "router_errors": 0}  # fmt: skip

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KVEventSubscriber already started")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if "*" in self.endpoint:  # the worker's publisher connects to us (vLLM: a non-wildcard endpoint)
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._thread = threading.Thread(target=self._run, args=(sub,), name=f"kv-sub-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take the worker out of every router (it leaves)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        for link in self._links:
            try:
                _call(link.router, "remove_replica", self.worker_id)
            except Exception as exc:  # a router that is down forgets it when it restarts
                log.info("worker %s: could not unregister (%r)", self.worker_id, exc)

    def set_load(self, load: LoadFigures) -> None:
        """The worker's load figures (polled elsewhere): they ride on the next message."""
        with self._lock:
            self._load = load
            for link in self._links:
                link.publisher.add(KVEvents(self.worker_id, 0, load=load))

    def ingest(self, frames: list[bytes]) -> None:
        """One message of the worker's stream, ``(topic, seq, payload)``, into every
        router (what the thread does with each message it receives)."""
        with self._lock:
            self._on_frames(frames)
            self._send_all()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s, c = self.stream, self.stream.cache.counters
            last = None if s.next_seq is None else s.next_seq - 1
            return {"events": c.events, "batches": s.batches, "last_seq": last, "restarts": s.restarts,
                    "orphans": c.orphans, "unsupported": c.unsupported, "unknown_removals": c.unknown_removals,
                    "blocks": len(s.cache.refs[wire.DEVICE]), "host_blocks": len(s.cache.refs[wire.HOST]),
                    **self.counters}  # fmt: skip

    # ------------------------------------------------------------------ thread
    def _run(self, sub: zmq.Socket) -> None:
        with self._lock:
            if self.replay_endpoint:  # catch up with what the worker did before we connected
                self._replay(0)
            self._send_all()
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.is_set():
            if sub.poll(timeout=min(100, int(self.heartbeat_s * 1000))):
                self.ingest(sub.recv_multipart())
                next_beat = time.monotonic() + self.heartbeat_s
            elif time.monotonic() >= next_beat:
                with self._lock:
                    self._send_all(heartbeat=True)
                next_beat = time.monotonic() + self.heartbeat_s
        sub.close(linger=0)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
            seq = wire.decode_seq(frames[1])
            out = self.stream.feed(seq, frames[2])
            if isinstance(out, Gap):
                self.counters["gaps"] += 1
                if not (self.replay_endpoint and self._replay(out.first) and self.stream.next_seq >= seq):
                    self._resync(seq)
                out = self.stream.feed(seq, frames[2])
            self._fold(out)
        except ValueError as exc:
            self.counters["bad_batches"] += 1
            log.warning("worker %s: bad KV event message dropped: %s", self.worker_id, exc)

    def _replay(self, first: int) -> bool:
        """Feed the worker's buffered batches from ``first`` on; False when they do not
        start at ``first`` (no longer buffered) or the worker does not answer."""
        self.counters["replays"] += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", wire.encode_seq(first)))
            ok, start = True, True
            while sock.poll(timeout=int(REPLAY_TIMEOUT_S * 1000)):
                _, _, seq_bytes, payload = sock.recv_multipart()
                seq = wire.decode_seq(seq_bytes)
                if seq == wire.END_SEQ:
                    return ok
                if start and first > 0 and seq != first:
                    ok = False
                start = False
                out = self.stream.feed(seq, payload, replayed=True)
                if isinstance(out, Gap):
                    ok = False
                else:
                    self._fold(out)
            log.warning("worker %s: replay endpoint %s did not answer", self.worker_id, self.replay_endpoint)
            return False
        finally:
            sock.close(linger=0)

    def _resync(self, next_seq: int) -> None:
        """History lost: drop the worker's blocks from every router, go on from ``next_seq``."""
        self.counters["resyncs"] += 1
        self.stream.reset(next_seq)
        for link in self._links:
            link.registered = False

    def _fold(self, events: KVEvents | None) -> None:
        if events is not None:
            for link in self._links:
                link.publisher.add(events)

    def _send_all(self, heartbeat: bool = False) -> None:
        for link in self._links:
            if link.registered and not (heartbeat or link.publisher.has_changes):
                continue
            try:
                if not link.registered:
                    self._register(link)
                    continue
                self.counters["pushes"] += 1
                if not _call(link.router, "push", link.publisher.take()):
                    self._register(link)
            except Exception as exc:  # router down or restarting: register again next time
                link.registered = False
                self.counters["router_errors"] += 1
                log.info("worker %s: router unreachable (%r)", self.worker_id, exc)

    def _register(self, link: _Link) -> None:
        cache = self.stream.cache
        seq = link.publisher.snapshot_seq()
        _call(link.router, "register", self.worker_id, self.hash_spec, self.capacity_blocks,
              cache.hashes(wire.DEVICE), seq, self._load, self.host_capacity_blocks, cache.hashes(wire.HOST))  # fmt: skip
        link.registered = True
        self.counters["registrations"] += 1
