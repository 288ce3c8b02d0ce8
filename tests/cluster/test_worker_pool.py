"""The worker pool of ``kvroute serve --workers`` (``cluster/worker_pool.py``) on a real
local Ray cluster, with real router actors, in front of small real HTTP servers that
answer as a worker does (``/health``, ``/v1/models``, ``/metrics``): runtime-added workers
survive a crash of the pool actor; an event endpoint that takes no connection is shown
as unreachable until a publisher listens there; loopback addresses are refused on a
cluster of several nodes; the pool reports its own liveness."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ray = pytest.importorskip("ray")
zmq = pytest.importorskip("zmq")

from kvroute.cluster.config import ClusterConfig  # noqa: E402
from kvroute.cluster.router_actor import get_or_create_router_actors  # noqa: E402
from kvroute.cluster.router_lookup import kill_router_actors  # noqa: E402
from kvroute.cluster import worker_probe  # noqa: E402
from kvroute.cluster.worker_pool import WorkerPool, get_or_create_worker_pool  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.conftest import free_port, restart_actor, wait_until  # noqa: E402

MODEL = "tiny-pool"
BLOCK = 8
PAGE = (f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="64"}} 1.0\n'
        'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n')  # fmt: skip


class _Worker(BaseHTTPRequestHandler):
    """A worker's HTTP face: healthy, serving MODEL, with a small vLLM-format page."""

    def do_GET(self) -> None:  # noqa: N802
        body = {"/health": b"{}", "/metrics": PAGE.encode(),
                "/v1/models": json.dumps({"data": [{"id": MODEL, "root": MODEL}]}).encode()}.get(self.path)  # fmt: skip
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_workers():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Worker) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # shutdown() waits a poll
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def _config(tiny_llama_path, app: str) -> ClusterConfig:
    return ClusterConfig(engine=EngineConfig(model=str(tiny_llama_path), block_size=BLOCK, num_kv_blocks=64,
                                             max_model_len=128, dtype="float32", hash_seed=5), app_name=app)  # fmt: skip


def _described(pool) -> dict:
    return ray.get(pool.describe.remote(), timeout=10)


def _workers(pool) -> dict[str, dict]:
    return {w["id"]: w for w in _described(pool)["workers"]}


def test_runtime_added_workers_survive_a_pool_actor_restart(ray_cluster, tiny_llama_path, http_workers):
    app = "poolrestart"
    config = _config(tiny_llama_path, app)
    first, added, dropped = http_workers
    try:
        pool = get_or_create_worker_pool(config, [{"url": first, "id": "first"}], [MODEL], 0.2)
        wait_until(lambda: _workers(pool)["first"]["state"] == "up", 20, "the configured worker up")
        assert ray.get(pool.add.remote({"url": added, "id": "added"}))["worker"]["state"] == "up"
        assert ray.get(pool.add.remote({"url": dropped, "id": "dropped"}))["worker"]["state"] == "up"
        assert ray.get(pool.remove.remote("dropped")) is True
        liveness = _described(pool)["pool"]
        assert liveness["ticks"] > 0 and liveness["last_tick_age_s"] < 5 and liveness["num_up"] == 2
        restart_actor(pool)  # a crash: Ray starts it again from the config's worker list
        assert set(_workers(pool)) == {"first", "added"}  # the saved list: the runtime add kept, the removal too
        wait_until(lambda: all(w["state"] == "up" for w in _workers(pool).values()), 20, "both workers up again")
        routers = get_or_create_router_actors(config)
        wait_until(lambda: all({"first", "added"} <= set(ray.get(r.replicas.remote())) for r in routers), 20,
                   "the restored workers registered")  # fmt: skip
        ticks = _described(pool)["pool"]["ticks"]
        wait_until(lambda: _described(pool)["pool"]["ticks"] >= ticks + 3, 10, "the restarted pool ticking")
    finally:
        kill_router_actors(app)


def test_an_unreachable_event_endpoint_is_shown_until_a_publisher_listens(ray_cluster, tiny_llama_path, http_workers):
    app = "poolevents"
    config = _config(tiny_llama_path, app)
    port = free_port()
    ctx = zmq.Context()
    try:
        pool = get_or_create_worker_pool(config, [], [MODEL], 0.2)
        answer = ray.get(pool.add.remote({"url": http_workers[0], "id": "evented",
                                          "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}))["worker"]  # fmt: skip
        # the worker serves (it answers over HTTP), but nobody publishes its events
        assert answer["state"] == "up" and answer["kv_events"] == "unreachable", answer
        assert str(port) in answer["kv_events_error"] and answer["kv_events_messages"] == 0
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")  # the publisher comes up: the next check sees it, the subscriber joins
        wait_until(lambda: _workers(pool)["evented"]["kv_events"] is True, 15, "the endpoint seen reachable")
        from kvroute.router import vllm_events as wire

        def delivered() -> bool:
            pub.send_multipart([b"", wire.encode_seq(0), wire.encode_batch(0.0, [wire.block_stored([1], None, list(range(BLOCK)), BLOCK)])])  # fmt: skip
            return _workers(pool)["evented"]["kv_events_messages"] > 0

        wait_until(delivered, 15, "an event through the subscriber", 0.2)
        assert _workers(pool)["evented"]["kv_events_error"] is None
    finally:
        kill_router_actors(app)
        ctx.destroy(linger=0)


def test_loopback_addresses_are_refused_on_a_cluster_of_several_nodes(tiny_llama_path):
    config = _config(tiny_llama_path, "poolnodes")
    for spec, what in (({"url": "http://127.0.0.1:8000"}, "url"), ({"url": "http://localhost:8000"}, "url"),
                       ({"url": "http://0.0.0.0:8000"}, "url"), ({"url": "http://[::1]:8000"}, "url"),
                       ({"url": "http://10.0.0.5:8000", "kv_events_endpoint": "tcp://127.0.0.1:5557"}, "endpoint")):  # fmt: skip
        with pytest.raises(ValueError, match=f"worker {what} .* names this machine .* 2 nodes"):
            WorkerPool(config, [spec], [MODEL], routers=[], nodes=2)
        WorkerPool(config, [spec], [MODEL], routers=[], nodes=1)  # one host: loopback is that host
    # routable addresses pass; a wildcard endpoint is bound by the pool itself
    WorkerPool(config, [{"url": "http://10.0.0.5:8000", "kv_events_endpoint": "tcp://*:5557"},
                        {"url": "http://worker-b.internal:8000", "kv_events_endpoint": "tcp://10.0.0.6:5557"}],
               [MODEL], routers=[], nodes=3)  # fmt: skip

    async def add() -> dict:
        pool = WorkerPool(config, [], [MODEL], routers=[], nodes=2)
        try:
            return await pool.add({"url": "http://127.0.0.1:9", "id": "local"})
        finally:
            await pool.stop()

    answer = asyncio.run(add())
    assert answer["status"] == 400 and "names this machine" in answer["error"]


def test_endpoint_reachability_is_a_bounded_tcp_connect():
    port = free_port()
    error = asyncio.run(worker_probe.endpoint_error(f"tcp://127.0.0.1:{port}", 1.0))
    assert error and str(port) in error
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        assert asyncio.run(worker_probe.endpoint_error(f"tcp://127.0.0.1:{port}", 1.0)) is None
        assert asyncio.run(worker_probe.endpoint_error("tcp://*:1", 1.0)) is None  # bound by the subscriber: not checked
    finally:
        ctx.destroy(linger=0)
