"""``kvroute serve --workers``: the Serve ingress and router actors of a real local Ray
cluster in front of real ``kvroute serve-replica --emulate`` processes, driven with the
official ``openai`` client and plain HTTP on loopback."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from kvroute.cluster.router_lookup import app_router, kill_router_actor  # noqa: E402
from kvroute.deploy.app import build_app, parse_args  # noqa: E402
from kvroute.cluster.worker_load import parse_load  # noqa: E402
from tests.conftest import end_serve_app, free_port, wait_until  # noqa: E402
from tests.deploy.server import start_cli  # noqa: E402

MODEL = "tiny-workers"
KEY = "sk-workers-test"
BLOCK = 8
APP = "kvworkers"
WORKER_ARGS = ["--block-size", str(BLOCK), "--num-kv-blocks", "256", "--emulate", "gpu_h100_llama3_8b", "--time-scale", "5",
               "--served-model-name", MODEL]  # fmt: skip


def _start_worker(model_path, port: int) -> subprocess.Popen:
    proc, _ = start_cli(["serve-replica", "--model", str(model_path), "--port", str(port), "--replica-id", f"w{port}",
                         *WORKER_ARGS], "serving")  # fmt: skip
    wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), 120, f"worker on port {port}", 0.1)
    return proc


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        _wait_stopped(proc)


def _wait_stopped(proc: subprocess.Popen) -> None:
    """Wait up to 30 s for a worker sent Ctrl-C, then kill it."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_llama_path):
    ports = [free_port() for _ in range(3)]
    procs: dict[int, subprocess.Popen] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            procs.update(zip(ports, ex.map(lambda p: _start_worker(tiny_llama_path, p), ports)))
        yield from _app(ray_cluster, ports, procs, tiny_llama_path)
    finally:
        for proc in procs.values():  # Ctrl-C every worker first: they stop side by side
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            _wait_stopped(proc)


def _app(ray_cluster: str, ports: list[int], procs: dict, tiny_llama_path):
    args = {
        "app_name": APP,
        "llm_configs": [{"model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)},
                         "engine_kwargs": {"block_size": BLOCK, "emulate": "gpu_h100_llama3_8b"}, "num_routers": 2}],
        "ingress": {"api_key": KEY},
        "workers": [{"url": f"http://127.0.0.1:{p}"} for p in ports[:2]],
        "worker_poll_interval_s": 0.2,
    }  # fmt: skip
    try:
        serve.run(build_app(parse_args(args)), name=APP, route_prefix="/")
        routers = [app_router(APP, i) for i in (0, 1)]
        wait_until(lambda: all(len(ray.get(r.replicas.remote())) == 2 for r in routers), 60, "both workers registered")
        yield {"url": ray_cluster, "ports": ports, "procs": procs, "routers": routers, "model_path": tiny_llama_path}
    finally:
        end_serve_app(APP)


def _client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _admin(fleet, method: str, path: str = "", key: str = KEY, **kw) -> httpx.Response:
    return httpx.request(method, fleet["url"] + "/admin/workers" + path, headers={"Authorization": f"Bearer {key}"},
                         timeout=30, **kw)  # fmt: skip


def _workers(fleet) -> dict[str, dict]:
    return {w["id"]: w for w in _admin(fleet, "GET").json()["data"]}


def test_completions_and_chat_streamed_or_not_pass_the_workers_answers_through(fleet):
    client = _client(fleet["url"])
    r = client.completions.create(model=MODEL, prompt="Hello through the workers", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" and r.model == MODEL
    assert r.usage.prompt_tokens_details is not None  # the worker's usage, cached_tokens included
    two = client.completions.create(model=MODEL, prompt="Two choices please", max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt="Stream it", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 5 and "".join(c.choices[0].text for c in chunks if c.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    stream = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                                 stream=True))  # fmt: skip
    assert stream[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
    # a worker's own 400 passes through in OpenAI's shape
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert "num_kv_blocks=256" in exc.value.body["message"], exc.value.body  # the worker's own words
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt="x", max_tokens=2)


def test_the_ingress_validates_a_forwarded_request_as_any_other(fleet):
    """The workers' backend gets the request the OpenAI layer prepared: every check of
    the engine path refuses a bad one at the ingress (our words, before any worker)."""
    client = _client(fleet["url"])
    cases = [
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=1, best_of=2), "best_of"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"frobnicate": 1}),
         "frobnicate"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "(a"}),
         "guided_regex"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 3}),
         "min_tokens"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=200_000), "max_tokens"),
        (lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "Hi"}], max_tokens=2,
                                                extra_body={"continue_final_message": True}), "continue_final_message"),
    ]  # fmt: skip
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        body = exc.value.body
        assert body["param"] == param, body
        if param == "max_tokens":  # past the ingress's context length, not only the worker's KV blocks
            assert body["code"] == "context_length_exceeded" and "num_kv_blocks" not in body["message"], body


def _delivered(fleet) -> float:
    """``kvroute:reuse_tokens{figure="delivered"}``: the cached tokens the workers reported
    on requests the router predicted."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(fleet["url"] + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvroute:reuse_tokens_total" and s.labels["figure"] == "delivered")  # fmt: skip


def test_prefix_sharing_prompts_land_on_the_worker_that_cached_them(fleet):
    client = _client(fleet["url"])
    before, hits = _delivered(fleet), 0
    for i in range(4):
        prompt = f"Shared system prompt number {i} about the archive's many rules and its keepers. " * 10
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        # a poll of the workers' /metrics (every 0.2 s) counts the finished request; until
        # then the router still counts it as the holder's queued prefill (no KV events here)
        time.sleep(0.5)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt + " And one more question?", max_tokens=2,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
        n = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        why = (i, _workers(fleet), [ray.get(r.stats.remote())["decisions_by_reason"] for r in fleet["routers"]])
        hits += chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK, why  # the holder
    # decision quality counts what the workers reported, streamed answers included
    assert _delivered(fleet) - before == hits
    metrics = httpx.get(fleet["url"] + "/metrics", timeout=10).text
    assert 'kvroute:router_replicas{model_name="tiny-workers"} 2.0' in metrics
    assert "kvroute:routing_decisions_total" in metrics
    # the routers price each worker by its engine's measured rates (serve-replica's own gauges)
    loads = [w["load"] for w in _workers(fleet).values() if w["state"] == "up"]
    assert any(ld["prefill_tokens_per_s"] > 0 for ld in loads) and all(ld["decode_step_s"] >= 0 for ld in loads), loads


def test_admin_routes_add_list_and_remove_workers(fleet):
    url3 = f"http://127.0.0.1:{fleet['ports'][2]}"
    assert _admin(fleet, "GET", key="wrong").status_code == 401
    listed = _workers(fleet)
    assert len(listed) == 2 and all(w["state"] == "up" and w["model"] == MODEL for w in listed.values())
    assert all(w["capacity_blocks"] == 256 and w["polls"] > 0 for w in listed.values())
    added = _admin(fleet, "POST", json={"url": url3, "id": "third"})
    assert added.status_code == 201 and added.json()["state"] == "up", added.text
    wait_until(lambda: all("third" in ray.get(r.replicas.remote()) for r in fleet["routers"]), 10, "third registered")
    # every worker now serves: distinct cold prompts spread over the three
    client = _client(fleet["url"])
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"cold prompt {i} " * 8, max_tokens=2)
    assert _workers(fleet)["third"]["state"] == "up"
    # bad input: OpenAI's error envelope
    dup = _admin(fleet, "POST", json={"url": url3})
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "worker_rejected"
    bad = _admin(fleet, "POST", json={"url": "ftp://nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    extra = _admin(fleet, "POST", json={"url": "http://127.0.0.1:1", "colour": "red"})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "colour"
    gone = _admin(fleet, "DELETE", "/nobody")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"
    # an unreachable worker is kept, down, until its health probe passes
    dead = _admin(fleet, "POST", json={"url": f"http://127.0.0.1:{free_port()}", "id": "ghost"})
    assert dead.status_code == 201 and dead.json()["state"] == "down" and dead.json()["last_error"]
    assert _admin(fleet, "DELETE", "/ghost").json()["deleted"] is True
    assert _admin(fleet, "DELETE", "/third").status_code == 200
    assert set(_workers(fleet)) == set(listed)
    wait_until(lambda: all("third" not in ray.get(r.replicas.remote()) for r in fleet["routers"]), 10, "third removed")


def test_a_killed_workers_requests_are_retried_elsewhere_and_it_comes_back(fleet):
    port = fleet["ports"][2]
    url3 = f"http://127.0.0.1:{port}"
    assert _admin(fleet, "POST", json={"url": url3, "id": "victim"}).status_code == 201
    client = _client(fleet["url"])

    def ask(i: int) -> int:
        return client.completions.create(model=MODEL, prompt=f"request {i} to a fleet " * 6, max_tokens=40).usage.completion_tokens

    def victim_running() -> bool:
        text = httpx.get(url3 + "/metrics", timeout=5).text
        return parse_load(text, 0)[0].num_running > 0

    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        futures = [ex.submit(ask, i) for i in range(12)]
        wait_until(victim_running, 30, "requests running on the victim")
        os.kill(fleet["procs"][port].pid, signal.SIGKILL)
        fleet["procs"][port].wait()
        answers = [f.result() for f in futures]  # 0 client errors
    assert answers == [40] * 12
    wait_until(lambda: _workers(fleet)["victim"]["state"] == "down", 10, "the victim taken out")
    assert all("victim" not in ray.get(r.replicas.remote()) for r in fleet["routers"])
    assert ask(99) == 40
    fleet["procs"][port] = _start_worker(fleet["model_path"], port)  # same address: its probe passes again
    wait_until(lambda: _workers(fleet)["victim"]["state"] == "up", 30, "the victim back up")
    wait_until(lambda: all("victim" in ray.get(r.replicas.remote()) for r in fleet["routers"]), 10, "victim registered")
    assert _admin(fleet, "DELETE", "/victim").status_code == 200


def test_the_pool_keeps_polling_through_kills_of_an_evented_worker_under_streaming_load(fleet):
    """A worker with KV events killed while requests stream through it is taken out by
    two paths at once: each failed stream's ingress reports it (``mark_down``) and the
    pool's next poll fails. Both once stopped its subscriber, two threads destroying one
    ZMQ context, and one hung for good with the pool's loop waiting on it: no worker was
    polled again. Over a few kill and restart cycles the pool keeps polling the
    survivors (their poll counts grow), reports its rounds, and brings the victim back
    up with its events each time."""
    port, events = fleet["ports"][2], free_port()
    url = f"http://127.0.0.1:{port}"
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d"}' % events
    client = _client(fleet["url"])
    survivors = set(_workers(fleet))

    def start_victim() -> subprocess.Popen:
        proc, _ = start_cli(["serve-replica", "--model", str(fleet["model_path"]), "--port", str(port), "--replica-id",
                             "victim", *WORKER_ARGS, "--kv-events-config", config], "serving")  # fmt: skip
        fleet["procs"][port] = proc  # the fixture stops it
        wait_until(lambda: _healthy(url), 60, "the victim serving", 0.1)
        return proc

    def stream(i: int) -> str:
        n, last = 0, None  # chunks, finish reason
        try:
            for c in client.completions.create(model=MODEL, prompt=f"stream {i} through the fleet " * 5, max_tokens=60,
                                               stream=True):  # fmt: skip
                n, last = n + 1, c.choices[0].finish_reason if c.choices else last
            return "done" if (n, last) == (60, "length") else f"short {n} {last}"
        except openai.APIError:  # it streamed from the victim: an error event, then [DONE]
            return "cut"

    def victim_running() -> bool:
        try:
            return parse_load(httpx.get(url + "/metrics", timeout=5).text, 0)[0].num_running > 0
        except httpx.HTTPError:
            return False

    _stop(fleet["procs"][port])  # the plain worker an earlier test left on this port
    proc = start_victim()
    spec = {"url": url, "id": "victim", "kv_events_endpoint": f"tcp://127.0.0.1:{events}"}
    assert _admin(fleet, "POST", json=spec).status_code == 201
    try:
        for cycle in range(4):
            wait_until(lambda: _workers(fleet)["victim"]["state"] == "up" and _workers(fleet)["victim"]["kv_events"] is True,
                       30, f"the victim up with its events (cycle {cycle})")  # fmt: skip
            with concurrent.futures.ThreadPoolExecutor(10) as ex:
                futures = [ex.submit(stream, 10 * cycle + i) for i in range(10)]
                wait_until(victim_running, 30, "streams running on the victim", 0.02)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                polls = {wid: w["polls"] for wid, w in _workers(fleet).items() if wid in survivors}
                outcomes = [f.result(timeout=60) for f in futures]
            # a stream cut after its first byte ends in an error event; one cut before it was retried elsewhere
            assert set(outcomes) <= {"done", "cut"} and "done" in outcomes, outcomes
            wait_until(lambda: _workers(fleet)["victim"]["state"] == "down", 10, "the victim taken out")
            wait_until(lambda: all(w["polls"] >= polls[wid] + 5 for wid, w in _workers(fleet).items() if wid in survivors),
                       10, f"the survivors polled again after kill {cycle}")  # fmt: skip
            proc = start_victim()
        wait_until(lambda: _workers(fleet)["victim"]["state"] == "up", 30, "the victim back after the last kill")
        listed = _admin(fleet, "GET").json()
        assert listed["pool"]["last_tick_age_s"] < 5 and listed["pool"]["ticks"] > 0, listed["pool"]
        assert _workers(fleet)["victim"]["downs"] == 4 and _workers(fleet)["victim"]["kv_events"] is True
        metrics = httpx.get(fleet["url"] + "/metrics", timeout=10).text
        assert f'kvroute:worker_up{{model_name="{MODEL}",worker="victim"}} 1.0' in metrics
        age = [line for line in metrics.splitlines() if line.startswith("kvroute:worker_pool_last_tick_age_seconds{")]
        assert age and float(age[0].rsplit(" ", 1)[1]) < 5, age
    finally:
        _admin(fleet, "DELETE", "/victim")


def test_a_worker_with_kv_events_feeds_the_directory_exactly(fleet):
    """A worker added with ``kv_events_endpoint`` (``serve-replica --kv-events-config``:
    vLLM's wire format) is registered by its KV event subscriber: the routers' directory
    holds the blocks it cached, and the next request's cached tokens are the router's
    prediction (the other workers are set aside meanwhile, then put back)."""
    port, events = free_port(), free_port()
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d"}' % events
    proc, _ = start_cli(["serve-replica", "--model", str(fleet["model_path"]), "--port", str(port), "--replica-id", "evented",
                         *WORKER_ARGS, "--kv-events-config", config], "serving")  # fmt: skip
    originals = _workers(fleet)
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), 120, "the evented worker", 0.1)
        for wid in originals:
            assert _admin(fleet, "DELETE", f"/{wid}").status_code == 200
        added = _admin(fleet, "POST", json={"url": f"http://127.0.0.1:{port}", "id": "evented",
                                            "kv_events_endpoint": f"tcp://127.0.0.1:{events}"})  # fmt: skip
        assert added.status_code == 201 and added.json()["kv_events"] is True, added.text
        router = fleet["routers"][0]
        wait_until(lambda: ray.get(router.replicas.remote()) == ["evented"], 15, "the evented worker registered")
        client = _client(fleet["url"])
        prompt = "An evented worker's long shared preamble, repeated for several blocks. " * 6
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        full = (first.usage.prompt_tokens - 1) // BLOCK  # the blocks it caches (the last token is computed)
        for r in fleet["routers"]:
            wait_until(lambda: len(ray.get(r.directory.remote("evented"))) >= full, 15, "the worker's blocks in the directory")
        again = client.completions.create(model=MODEL, prompt=prompt + " Then a question?", max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == full * BLOCK
        decided = [ray.get(r.stats.remote())["decisions_by_reason"] for r in fleet["routers"]]
        assert sum(d.get("prefix", 0) for d in decided) >= 1, decided
    finally:
        _admin(fleet, "DELETE", "/evented")
        for wid, w in originals.items():
            _admin(fleet, "POST", json={"url": w["url"], "id": wid})
        _stop(proc)
    wait_until(lambda: all(len(ray.get(r.replicas.remote())) == 2 for r in fleet["routers"]), 30, "the workers back")


def test_a_workers_lora_adapter_is_served_and_keyed_by_the_adapter(fleet, tmp_path):
    """A worker that serves a LoRA adapter (``serve-replica --enable-lora``, KV events
    on): the ingress lists the adapter, sends its requests only to workers that serve
    it, under the adapter's name, and hashes their blocks with the adapter as the
    worker's engine does: the directory holds the adapter-keyed hashes, not the base
    model's, and the next request of that adapter reuses them."""
    from kvroute.benchmarks.lora_adapters import save_random_adapter
    from kvroute.replica.block_hash import hash_blocks
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(fleet["model_path"]))
    adapter = save_random_adapter(tmp_path / "sql", arch, rank=4, seed=5)
    port, events = free_port(), free_port()
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d"}' % events
    proc, _ = start_cli(["serve-replica", "--model", str(fleet["model_path"]), "--port", str(port), "--replica-id", "lora",
                         "--block-size", str(BLOCK), "--num-kv-blocks", "256", "--served-model-name", MODEL,
                         "--dtype", "float32", "--enable-lora", "--lora-modules", f"sql={adapter}",
                         "--kv-events-config", config], "serving")  # fmt: skip
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), 120, "the LoRA worker", 0.1)
        added = _admin(fleet, "POST", json={"url": f"http://127.0.0.1:{port}", "id": "lora",
                                            "kv_events_endpoint": f"tcp://127.0.0.1:{events}"})  # fmt: skip
        assert added.status_code == 201, added.text
        client = _client(fleet["url"])
        wait_until(lambda: "sql" in {m.id for m in client.models.list().data}, 30, "the adapter listed")
        listed = {m.id: m for m in client.models.list().data}
        assert listed["sql"].parent == MODEL
        ids = [(7 * i) % 500 + 3 for i in range(6 * BLOCK + 3)]
        first = client.completions.create(model="sql", prompt=ids, max_tokens=2, temperature=0)
        assert first.model == "sql" and first.usage.prompt_tokens == len(ids)
        router = fleet["routers"][0]
        spec = ray.get(router.__ray_call__.remote(lambda actor: actor.hash_spec))
        keyed = hash_blocks(spec, ids, lora_name="sql")[: (len(ids) - 1) // BLOCK]
        for r in fleet["routers"]:
            wait_until(lambda: set(keyed) <= set(ray.get(r.directory.remote("lora"))), 15, "the adapter's blocks")
        assert not set(hash_blocks(spec, ids)) & set(ray.get(router.directory.remote("lora")))
        again = client.completions.create(model="sql", prompt=ids + [9, 9, 9], max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == len(keyed) * BLOCK
        # Ray Serve LLM's "<base>:<adapter>" names the same adapter, completions and chat
        ray_named = client.completions.create(model=f"{MODEL}:sql", prompt=ids + [9, 9, 9], max_tokens=2, temperature=0)
        assert ray_named.model == "sql" and ray_named.choices[0].text == again.choices[0].text
        assert ray_named.usage.prompt_tokens_details.cached_tokens >= len(keyed) * BLOCK  # the adapter's own blocks
        chat = client.chat.completions.create(model=f"{MODEL}:sql", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2, temperature=0)  # fmt: skip
        assert chat.model == "sql"
        with pytest.raises(openai.NotFoundError, match=f"LoRA adapter 'nope' of '{MODEL}' does not exist"):
            client.completions.create(model=f"{MODEL}:nope", prompt=ids, max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="model 'other-base:sql' does not exist"):
            client.completions.create(model="other-base:sql", prompt=ids, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt=ids, max_tokens=2)
        # loaded and unloaded through the ingress: on the workers that can (the emulated ones refuse)
        other = save_random_adapter(tmp_path / "sql2", arch, rank=4, seed=6)
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(fleet["url"] + "/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(other)},
                       headers=auth, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        assert client.completions.create(model="sql2", prompt=ids, max_tokens=2, temperature=0).model == "sql2"
        r = httpx.post(fleet["url"] + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql2", prompt=ids, max_tokens=2)
    finally:
        _admin(fleet, "DELETE", "/lora")
        _stop(proc)
