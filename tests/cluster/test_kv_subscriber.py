"""``serve-replica --kv-events-config`` publishing vLLM's wire format over real ZMQ into a
``KVEventSubscriber`` feeding a real ``RouterService``: after each request, with
evictions, the router's directory equals the engine's cached blocks; a subscriber that
joins later catches up through the replay endpoint."""

import dataclasses
import time

import pytest
import zmq
from openai import OpenAI

from kvroute.cluster.kv_subscriber import KVEventSubscriber
from kvroute.cluster.router_actor import RouterService
from kvroute.deploy.kv_event_publisher import KVEventsConfig
from kvroute.deploy.replica_server import build_replica_server
from kvroute.replica.block_hash import hash_blocks
from kvroute.replica.config import EngineConfig
from kvroute.replica.kv_events import LoadFigures
from kvroute.benchmarks.vllm_workers import free_ports
from tests.conftest import wait_until
from tests.deploy.server import running

NUM_BLOCKS = 14


def _prompts() -> list[tuple[list[int], str | None]]:
    shared = list(range(200, 224))  # 3 blocks of 8
    out = [(shared + [300 + i] * 17, None) for i in range(4)]  # 5 full blocks each
    out.append((shared + [300] * 17, "tenant-b"))
    return out + [(list(range(400, 441)), None), (shared + [301] * 17, None)]


def _local(cfg: KVEventsConfig) -> KVEventsConfig:
    """The worker's endpoints as a subscriber on this host reaches them."""
    return dataclasses.replace(cfg, endpoint=cfg.endpoint.replace("*", "127.0.0.1"),
                               replay_endpoint=cfg.replay_endpoint.replace("*", "127.0.0.1"))  # fmt: skip


def _subscriber(spec, svc, cfg, replay=True):
    sub = KVEventSubscriber("w0", cfg.endpoint, spec, [svc], NUM_BLOCKS,
                            replay_endpoint=cfg.replay_endpoint if replay else None, heartbeat_s=0.2)  # fmt: skip
    sub.start()
    return sub


@pytest.fixture(scope="module")
def worker(tiny_llama_path):
    """A serve-replica app publishing KV events: (client, engine, events config)."""
    p1, p2 = free_ports(2)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{p1}", replay_endpoint=f"tcp://*:{p2}")
    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=NUM_BLOCKS, max_model_len=128,
                          dtype="float32", hash_seed=11)  # fmt: skip
    app, engine = build_replica_server(config, kv_events=cfg, served_model_name="tiny")
    with running(app) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="x"), engine, _local(cfg)
    assert engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS  # nothing leaked


def test_serve_replica_events_rebuild_the_engine_cache_in_the_directory(worker):
    client, engine, cfg = worker
    spec = engine.hash_spec
    kv = engine.engine.kv
    svc = RouterService(spec)
    sub = _subscriber(spec, svc, cfg)
    try:
        wait_until(lambda: "w0" in svc.replicas(), 10, "the worker's registration")
        ever: set[int] = set()
        for tokens, salt in _prompts():
            client.completions.create(model="tiny", prompt=tokens, max_tokens=3, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)  # fmt: skip
            ever.update(hash_blocks(spec, tokens, cache_salt=salt))
            wait_until(lambda: set(svc.directory("w0")) == set(kv.cached_block_hashes()), 10,
                       "the directory to equal the engine's cache")  # fmt: skip
            assert set(hash_blocks(spec, tokens, cache_salt=salt)[: len(tokens) // 8]) <= set(svc.directory("w0"))
        final = set(svc.directory("w0"))
        assert not ever <= final, "the trace evicts blocks"
        assert sub.stats()["gaps"] == 0 and sub.stats()["orphans"] == 0 and sub.stats()["events"] > 0
        # a subscriber joining now catches up from the replay buffer, into a fresh router
        late_svc = RouterService(spec)
        late = _subscriber(spec, late_svc, cfg)
        try:
            wait_until(lambda: "w0" in late_svc.replicas() and set(late_svc.directory("w0")) == final, 10,
                       "the late subscriber's replay")  # fmt: skip
            assert late.stats()["replays"] == 1 and late.stats()["last_seq"] == sub.stats()["last_seq"]
        finally:
            late.stop()
        # without a replay endpoint it starts from what it sees next
        blind_svc = RouterService(spec)
        blind = _subscriber(spec, blind_svc, cfg, replay=False)
        try:
            wait_until(lambda: "w0" in blind_svc.replicas(), 10, "the blind subscriber's registration")
            assert blind_svc.directory("w0") == []
            tokens = list(range(500, 517))
            client.completions.create(model="tiny", prompt=tokens, max_tokens=1, temperature=0)
            wait_until(lambda: set(blind_svc.directory("w0")) == set(hash_blocks(spec, tokens)), 10,
                       "the blind subscriber's directory")  # fmt: skip
        finally:
            blind.stop()
    finally:
        sub.stop()


def _frames_of(client, sock, prompts) -> list[list[bytes]]:
    for tokens in prompts:
        client.completions.create(model="tiny", prompt=tokens, max_tokens=1, temperature=0)
    frames = []
    while sock.poll(500):
        frames.append(sock.recv_multipart())
    return frames


@pytest.mark.parametrize("replay", [True, False])
def test_a_gap_is_replayed_or_resynced(worker, replay):
    client, engine, cfg = worker
    spec = engine.hash_spec
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(cfg.endpoint)
    time.sleep(0.3)  # the SUB socket joins before the worker publishes
    try:
        base = 600 if replay else 700
        prompts = [list(range(base + 10 * i, base + 10 * i + 17)) for i in range(3)]
        frames = _frames_of(client, sock, prompts)
        assert len(frames) >= 3
        whole, gapped = RouterService(spec), RouterService(spec)
        subs = [KVEventSubscriber("w0", cfg.endpoint, spec, [whole], NUM_BLOCKS),
                KVEventSubscriber("w0", cfg.endpoint, spec, [gapped], NUM_BLOCKS,
                                  replay_endpoint=cfg.replay_endpoint if replay else None)]  # fmt: skip
        for f in frames:
            subs[0].ingest(f)
        for i, f in enumerate(frames):
            if i != 1:  # lost on the way
                subs[1].ingest(f)
        stats = subs[1].stats()
        assert stats["gaps"] == 1 and stats["last_seq"] == subs[0].stats()["last_seq"]
        if replay:
            assert stats["replays"] == 1 and stats["resyncs"] == 0
            assert set(gapped.directory("w0")) == set(whole.directory("w0"))
        else:
            assert stats["resyncs"] == 1
            assert set(gapped.directory("w0")) < set(whole.directory("w0"))
            assert not set(hash_blocks(spec, prompts[0])) & set(gapped.directory("w0"))  # dropped with the gap
        subs[1].set_load(LoadFigures(num_running=3, num_waiting=1))
        subs[1].ingest([b"", b"\x00" * 7, b""])  # a bad message: dropped, counted
        assert subs[1].stats()["bad_batches"] == 1
        assert gapped.router.loads.figures("w0") == LoadFigures(num_running=3, num_waiting=1)
        for sub in subs:
            sub.stop()
        assert whole.replicas() == [] and gapped.replicas() == []  # a stopped subscriber's worker leaves
    finally:
        ctx.destroy(linger=0)


def test_kv_events_config_errors():
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpointt": "tcp://*:1"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.from_json("{")
    with pytest.raises(ValueError, match="true or false"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": "yes"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled


def test_two_concurrent_stops_of_a_streaming_subscriber_finish_in_bounded_time():
    """A worker pool's failed poll and an ingress' report of the same dead worker stop
    its subscriber at once, from two threads: both calls return within the bound, the
    thread is gone, the worker left the router, and a later stop is a no-op. (Two
    threads terminating one ZMQ context used to leave one blocked for good.)"""
    import socket
    import threading

    from kvroute.replica.block_hash import HashSpec
    from kvroute.router import vllm_events as wire

    spec = HashSpec(8, 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    done = threading.Event()

    def publish() -> None:  # a worker's stream: one stored block per message
        seq = 0
        while not done.is_set():
            tokens = list(range(8 * seq, 8 * seq + 8))
            pub.send_multipart([b"", wire.encode_seq(seq), wire.encode_batch(0.0, [wire.block_stored([seq + 1], None, tokens, 8)])])
            seq += 1
            time.sleep(0.002)

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    try:
        for _ in range(8):
            svc = RouterService(spec)
            sub = KVEventSubscriber("w0", f"tcp://127.0.0.1:{port}", spec, [svc], 64, heartbeat_s=0.05)
            sub.start()
            wait_until(lambda: sub.counters["messages"] > 0 and "w0" in svc.replicas(), 10, "the stream to flow")
            barrier, answers = threading.Barrier(2), []

            def stop() -> None:
                barrier.wait()
                answers.append(sub.stop(timeout_s=2.0))

            stoppers = [threading.Thread(target=stop, daemon=True) for _ in range(2)]
            t0 = time.monotonic()
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join(timeout=10)
            assert not any(t.is_alive() for t in stoppers), "a stop() is stuck"
            assert time.monotonic() - t0 < 5 and answers == [True, True]
            assert not sub._thread.is_alive() and svc.replicas() == []
            t0 = time.monotonic()
            assert sub.stop() is True and time.monotonic() - t0 < 0.5  # again: nothing left to do
    finally:
        done.set()
        publisher.join(timeout=5)
        ctx.destroy(linger=0)


def test_a_subscriber_never_started_or_unable_to_bind_stops_at_once():
    import socket

    from kvroute.replica.block_hash import HashSpec

    spec = HashSpec(8, 3)
    svc = RouterService(spec)
    with socket.socket() as taken:  # a wildcard endpoint is bound by the subscriber: this port is taken
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        sub = KVEventSubscriber("w1", f"tcp://*:{taken.getsockname()[1]}", spec, [svc], 64)
        with pytest.raises(zmq.ZMQError):
            sub.start()
    t0 = time.monotonic()
    assert sub.stop() is True and sub.stop() is True and time.monotonic() - t0 < 1.0
    assert sub.counters["messages"] == 0 and sub.last_message_at is None
