"""LoRA adapters through the Ray Serve application, end to end: a real local Ray cluster,
requests through Serve's HTTP proxy with the official ``openai`` client and httpx, tiny
random PEFT adapters the tests save. ``model`` selects an adapter on every replica (its
output equals the offline engine's with that adapter; Ray Serve LLM's
``"<base>:<adapter>"`` names it too), /v1/models lists them, load and
unload reach every replica (one started later too), a restarted registry keeps an
adapter loaded at run time (its saved state), serve.yaml's ``lora_config`` loads
adapters from ``dynamic_lora_loading_path`` on first use (unknown: 404 naming it; a bad
folder: 400 naming the file and field), and nothing stays allocated."""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from kvroute.benchmarks.lora_adapters import save_random_adapter  # noqa: E402
from kvroute.cluster.client import KVRouteClient  # noqa: E402
from kvroute.cluster.replica_deployment import replica_version  # noqa: E402
from kvroute.cluster.router_lookup import app_router, kill_router_actor  # noqa: E402
from kvroute.deploy.app import compose_app, parse_args  # noqa: E402
from kvroute.replica.llm import LLM  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import end_serve_app, restart_actor, wait_until  # noqa: E402

APP, MODEL = "kvlora", "tiny-lora"
ENGINE = dict(block_size=8, num_kv_blocks=128, max_model_len=256, dtype="float32", hash_seed=7)
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away into the"


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    tmp = tmp_path_factory.mktemp("serve-lora")
    made = {name: save_random_adapter(tmp / name, arch, rank=4, seed=seed) for name, seed in (("a", 31), ("b", 32))}
    made["c"] = save_random_adapter(tmp / "dynamic" / "c", arch, rank=4, seed=33)
    (tmp / "dynamic" / "bad").mkdir()
    (tmp / "dynamic" / "bad" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    return made


def _args(model_path, adapters, replicas: int) -> dict:
    engine = {**ENGINE, "lora_modules": {"a": str(adapters["a"])}}
    return {"app_name": APP, "llm_configs": [{
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_path)},
        "engine_kwargs": engine,
        "lora_config": {"dynamic_lora_loading_path": str(adapters["c"].parent), "max_num_adapters_per_replica": 2},
        "deployment_config": {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 1}},
    }]}  # fmt: skip


def _deploy(model_path, adapters, replicas: int):
    parsed = parse_args(_args(model_path, adapters, replicas))
    config = parsed.cluster_config()
    serve.run(compose_app(parsed, engine_version=replica_version(config)), name=APP, route_prefix="/")
    router = app_router(APP)
    wait_until(lambda: len(ray.get(router.replicas.remote())) == replicas, 90, f"{replicas} replicas registered")
    return config, router


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path, adapters):
    config, router = _deploy(tiny_llama_path, adapters, 2)
    yield ray_cluster, config, router
    end_serve_app(APP)


@pytest.fixture(scope="module")
def offline(tiny_llama_path, adapters):
    llm = LLM(str(tiny_llama_path), **{k: v for k, v in ENGINE.items() if k != "hash_seed"}, enable_lora=True, max_loras=3)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    return {name: llm.generate(ids, params, use_tqdm=False, lora_name=name)[0].text for name in (None, "a", "b", "c")}


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(url, model, prompt=PROMPT):
    return _client(url).completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)


def _states(config, router) -> dict[str, dict]:
    handle = serve.get_deployment_handle(config.deployment_name, app_name=config.app_name)
    client = KVRouteClient(handle, config.hash_spec)
    return {rid: asyncio.run(client.debug_state(rid, 30.0)) for rid in ray.get(router.replicas.remote())}


def test_models_list_the_adapters_and_model_selects_one(app, offline, tiny_llama_path):
    url = app[0]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert set(models) == {MODEL, str(tiny_llama_path), "a"} and models["a"]["parent"] == MODEL
    assert offline["a"] != offline[None]
    for _ in range(3):  # both replicas serve it (the router spreads the repeats or they hit one: both equal)
        r = _complete(url, "a")
        assert r.choices[0].text == offline["a"] and r.model == "a"
    assert _complete(url, MODEL).choices[0].text == offline[None]


def test_ray_serve_llms_base_colon_adapter_names_the_adapter(app, offline):
    url = app[0]
    client = _client(url)
    r = _complete(url, f"{MODEL}:a")
    assert r.choices[0].text == offline["a"] and r.model == "a"  # the answer names the adapter
    messages = [{"role": "user", "content": "Name a colour."}]
    chats = [client.chat.completions.create(model=m, messages=messages, max_tokens=6, temperature=0) for m in ("a", f"{MODEL}:a")]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].message.content != chats[0].choices[0].message.content  # the adapter ran
    with pytest.raises(openai.NotFoundError, match=f"LoRA adapter 'nope' of '{MODEL}' does not exist"):
        _complete(url, f"{MODEL}:nope")
    with pytest.raises(openai.NotFoundError, match="model 'other-base:a' does not exist"):
        _complete(url, "other-base:a")
    with pytest.raises(openai.NotFoundError, match="model 'other-base:a' does not exist"):
        client.chat.completions.create(model="other-base:a", messages=messages, max_tokens=2)


def test_an_adapters_prefix_is_its_own(app):
    url = app[0]
    prompt = "A long system prompt that only the adapter named b shall see, " * 3
    _complete(url, MODEL, prompt)
    body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the base model's KV never serves a
    wait_until(lambda: httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
               ["prompt_tokens_details"]["cached_tokens"] > 0, 30, "adapter a's own prefix to be cached")  # fmt: skip


def test_load_reaches_every_replica_and_a_later_one(app, adapters, offline, tiny_llama_path):
    url, config, router = app
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])}, timeout=120)
    assert r.status_code == 200, r.text
    assert _complete(url, "b").choices[0].text == offline["b"]
    wait_until(lambda: all("b" in s["loras"] for s in _states(config, router).values()), 30, "b on every replica")
    _deploy(tiny_llama_path, adapters, 3)  # same engine version: the two replicas stay, a third starts
    states = _states(config, router)
    assert len(states) == 3 and all({"a", "b"} <= set(s["loras"]) for s in states.values())


def test_a_killed_registry_keeps_the_adapters_loaded_at_run_time(app, offline):
    url, config, _ = app
    registry = ray.get_actor(f"kvroute-loras:{APP}", namespace="kvroute")
    before = ray.get(registry.snapshot.remote())
    assert "b" in before[1]  # loaded through /v1/load_lora_adapter by the test before
    restart_actor(registry)
    # read back from the GCS KV at once, not handed back later by a replica's sync: the same epoch
    assert ray.get(registry.snapshot.remote()) == before
    assert _complete(url, "b").choices[0].text == offline["b"]
    assert "b" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_dynamic_path_loads_on_first_use_and_names_the_unknown(app, offline):
    url = app[0]
    assert _complete(url, "c").choices[0].text == offline["c"]
    assert "c" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        _complete(url, "nope")
    for name in ("..", "c/../c"):
        assert httpx.post(url + "/v1/completions", json={"model": name, "prompt": "x"}, timeout=60).status_code == 404
    r = httpx.post(url + "/v1/completions", json={"model": "bad", "prompt": "x", "max_tokens": 1}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and "adapter_model.safetensors" in err["message"] and err["param"] == "model"


def test_unload_reaches_every_replica(app):
    url, config, router = app
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(url, "b")
    wait_until(lambda: not any("b" in s["loras"] for s in _states(config, router).values()), 30, "b gone everywhere")
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 404


def test_metrics_count_the_adapter_loads(app):
    from prometheus_client.parser import text_string_to_metric_families

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(app[0] + "/metrics", timeout=30).text)}

    def loads() -> list[float]:
        return [s.value for s in families()["kvroute:lora_slot_loads"].samples if s.name.endswith("_total")]

    # a, b and c ran; each replica counts its own, in a report about once a second (one may lag on a busy box)
    wait_until(lambda: sum(loads()) >= 3, 15, "the replicas' reports of 3 adapter loads at least")
    assert len(loads()) == 3
    fams = families()
    assert all(s.value <= 2 for s in fams["kvroute:lora_resident_adapters"].samples)  # max_num_adapters_per_replica


def test_nothing_left_allocated(app):
    _, config, router = app

    def idle():
        return all(s["blocks_in_use"] == 0 and s["num_running"] == 0 for s in _states(config, router).values())

    wait_until(idle, 30, "every replica idle with no block in use")
