"""``kvroute serve-replica --kv-events-config JSON``: the engine's cache changes on
vLLM's ZMQ KV event wire format (``router/vllm_events.py``), so one ingestion path
(``cluster/kv_subscriber.py``) serves vLLM workers and ours alike.

The option takes vLLM's ``KVEventsConfig`` keys. Each engine step that changed the
cache becomes one ``KVEventBatch``: ``AllBlocksCleared`` first if the cache was reset,
then one ``BlockStored`` per stored block (its own hash as 16 big-endian bytes, its
parent's, its token ids, its adapter as ``lora_name``, and as extra keys the adapter on every block of its chain and the ``cache_salt`` on the first),
then one ``BlockRemoved`` for the evicted ones (the step's net change: stored and
removed are disjoint). The host tier's changes are not published. As in vLLM, an
``endpoint`` with a wildcard address (``tcp://*:5557``) is bound and any other one
connected to (a subscriber then binds it). A thread owns the
PUB socket and the optional replay ROUTER socket (ZMQ sockets are not thread-safe) and
keeps the last ``buffer_steps`` batches for replay.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.kv_events import KVEvents
from kvroute.router import vllm_events as wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` keys (same names, same defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv events enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv events {name} must be a string, got {getattr(self, name)!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**raw)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc or inproc is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def engine_hash(h: int) -> bytes:
    return int(h).to_bytes(16, "big")


def vllm_events(kv: KVCacheManager, events: KVEvents) -> list[dict[str, Any]]:
    """One engine step's net changes as vLLM events; read at the step's end (the stored
    blocks are in the cache then: a block stored and evicted within the step cancels)."""
    out: list[dict[str, Any]] = [wire.all_blocks_cleared()] if events.cleared else []
    bs = kv.block_size
    for h in events.stored:
        block = kv.cached_block(h)
        assert block is not None, "a stored block is cached at the end of its step"
        parent = None if block.parent_hash is None else engine_hash(block.parent_hash)
        # vLLM's extra keys: the adapter's name on every block of its chain, the salt on the first
        keys = [k for k in (block.lora_name, block.salt) if k is not None]
        out.append(wire.block_stored([engine_hash(h)], parent, block.token_ids, bs, extra_keys=[keys] if keys else None,
                                     lora_name=block.lora_name))  # fmt: skip
    if events.removed:
        out.append(wire.block_removed([engine_hash(h) for h in events.removed]))
    return out


class ZmqKVEventPublisher:
    """PUB + replay on a thread of its own; ``publish`` only enqueues."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if is_bind_endpoint(config.endpoint):
            self._pub.bind(config.endpoint)
        else:  # as vLLM: a host name means the subscriber binds and we connect
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        if events:
            try:
                self._queue.put_nowait(events)
            except queue.Full:  # the subscriber sees the gap and replays or resyncs
                log.warning("kv event queue full: a batch is dropped")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = wire.encode_batch(time.time(), events)
            self._pub.send_multipart((self._topic, wire.encode_seq(self.seq), payload))
            self._buffer.append((self.seq, payload))
            self.seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv event replay: bad request of %d frames", len(frames))
            return
        client, start = frames[0], wire.decode_seq(frames[2])
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, wire.encode_seq(seq), payload))
        self._replay.send_multipart((client, b"", b"", wire.encode_seq(wire.END_SEQ), b""))
