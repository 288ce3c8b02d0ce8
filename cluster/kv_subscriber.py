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
worker out of every router (``remove_replica``). It may be called more than once and
from several threads at once (a worker pool's failed poll and an ingress' report of the
same dead worker): the first call does the work, the others wait for it, and every call
returns within about ``timeout_s``. The ZMQ context is only ever terminated by one
thread, after its sockets closed (the thread's own on its way out), since two threads
terminating one context can leave one blocked in ``zmq_ctx_term`` for good.

``counters["messages"]`` and ``last_message_at`` say whether anything arrived from the
worker (a message on the stream, or a replay answer): a subscriber connects whether or
not a publisher listens, so they are how a caller tells a silent endpoint.
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
STOP_TIMEOUT_S = 5.0  # stop() returns within about this (plus the routers' unregistration, as long again)


def _call(router: Any, method: str, *args: Any) -> Any:
    fn = getattr(router, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args), timeout=ROUTER_TIMEOUT_S)
    return fn(*args)


def _call_all(routers: list, method: str, args: tuple, timeout_s: float) -> list[Exception]:
    """``method(*args)`` on every router at once (actors: one wait of ``timeout_s`` for
    all); the errors."""
    errors: list[Exception] = []
    refs = []
    for router in routers:
        fn = getattr(router, method)
        try:
            if hasattr(fn, "remote"):
                refs.append(fn.remote(*args))
            else:
                fn(*args)
        except Exception as exc:
            errors.append(exc)
    if refs:
        import ray

        try:
            ray.get(refs, timeout=timeout_s)
        except Exception as exc:  # a router down or slow: it forgets the worker when it restarts or expires it
            errors.append(exc)
    return errors


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
        self._ctx.linger = 0  # closing a socket never waits for unsent messages
        self._stop_lock = threading.Lock()
        self._term_lock = threading.Lock()  # the context is terminated once, by one thread
        self._stopping = False  # a stop() has begun (guarded by _stop_lock)
        self._stopped = threading.Event()  # ... and finished
        self.last_message_at: float | None = None  # time.monotonic() of the last message or replay answer
        self.counters = {"gaps": 0, "replays": 0, "resyncs": 0, "bad_batches": 0, "pushes": 0,
                         "registrations": 0, "router_errors": 0, "messages": 0, "replay_answers": 0}  # fmt: skip

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Open the SUB socket and start the thread. ``zmq.ZMQError`` when the endpoint
        cannot be bound or is malformed (nothing is left open then)."""
        if self._thread is not None or self._stop.is_set():
            raise RuntimeError("KVEventSubscriber already started or stopped")
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if "*" in self.endpoint:  # the worker's publisher connects to us (vLLM: a non-wildcard endpoint)
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, args=(sub,), name=f"kv-sub-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop the thread and take the worker out of every router (it leaves). Safe to
        call twice and from several threads at once (module docstring); True once
        stopped, False when it gave up waiting (the thread still busy in a router call:
        it ends and frees its sockets by itself)."""
        self._stop.set()
        with self._stop_lock:
            first, self._stopping = not self._stopping, True
        if not first:
            return self._stopped.wait(2 * timeout_s + 1.0)  # the first call's bound: join, then unregister
        try:
            thread = self._thread
            if thread is None:
                self._term()  # no socket was ever opened (or start() closed it)
            else:
                thread.join(timeout=timeout_s)  # the thread closes its socket and terminates the context
                if thread.is_alive():
                    log.warning("worker %s: the KV event thread did not stop within %.1f s", self.worker_id, timeout_s)
            for exc in _call_all([link.router for link in self._links], "remove_replica", (self.worker_id,), timeout_s):
                log.info("worker %s: could not unregister (%r)", self.worker_id, exc)
            return thread is None or not thread.is_alive()
        finally:
            self._stopped.set()

    def set_load(self, load: LoadFigures) -> None:
        """The worker's load figures (polled elsewhere): they ride on the next message."""
        with self._lock:
            self._load = load
            for link in self._links:
                link.publisher.add(KVEvents(self.worker_id, 0, load=load))

    def ingest(self, frames: list[bytes]) -> None:
        """One message of the worker's stream, ``(topic, seq, payload)``, into every
        router (what the thread does with each message it receives)."""
        self.counters["messages"] += 1
        self.last_message_at = time.monotonic()
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
        """The thread: owns ``sub`` (and replay sockets) and, on its way out, closes
        them and terminates the context, so no other thread ever touches them."""
        try:
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
        except Exception:
            log.exception("worker %s: the KV event thread failed", self.worker_id)
        finally:
            sub.close(linger=0)
            self._term()

    def _term(self) -> None:
        """Terminate the context once its sockets are closed: a second caller waits for
        the first, then finds it closed (two concurrent ``zmq_ctx_term`` can hang)."""
        with self._term_lock:
            if not self._ctx.closed:
                self._ctx.term()

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
                self.counters["replay_answers"] += 1
                self.last_message_at = time.monotonic()
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
            if self._stop.is_set():  # stopping: never register the worker again behind stop()'s back
                return
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
