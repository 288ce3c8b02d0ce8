"""``dynamic_lora_loading_path`` on an object store, through the Ray Serve application:
a real local Ray cluster, a real S3-compatible server (moto's, on loopback) reached by
the replicas through ``AWS_ENDPOINT_URL``, requests through Serve's HTTP proxy.

An adapter ``X`` is the objects under ``s3://<bucket>/loras/X``: the replica that loads
it fetches them into its node's cache (the ingress never looks), and its output equals
the offline engine's with the same adapter from a local folder; an adapter that is not
there is a 404 naming it (the replica's error, naming the URI and its node, is in the
ingress' log); one that is there but bad is a 400 naming the file.

The replicas are Ray workers, which take their environment from the Ray cluster started
once per session, so the endpoint variables are set when this module is imported
(collection comes before every fixture) on a port chosen then; the server starts on it
in the module fixture. The bucket's name is unique per run, and its copy is removed from
the cache afterwards.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
pytest.importorskip("boto3")
pytest.importorskip("moto.server", reason="needs moto[server] (pip install -e .[test])")
from ray import serve  # noqa: E402

from kvroute.benchmarks.lora_adapters import save_random_adapter  # noqa: E402
from kvroute.cluster.client import KVRouteClient  # noqa: E402
from kvroute.cluster.replica_deployment import replica_version  # noqa: E402
from kvroute.deploy.app import compose_app, parse_args  # noqa: E402
from kvroute.replica.model_store import cache_dir  # noqa: E402
from tests.conftest import end_serve_app, free_port, wait_until  # noqa: E402
from tests.replica.test_model_store import S3Server  # noqa: E402

APP, MODEL, BUCKET = "kvs3lora", "tiny-s3-lora", f"kvroute-loras-{secrets.token_hex(4)}"
ENGINE = dict(block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32")
PROMPT = "The quick brown fox jumps over the lazy dog and then"

_PORT = free_port()
if ray.is_initialized():  # (only if something started Ray during collection)
    pytest.skip("the S3 endpoint must be in the environment before Ray starts", allow_module_level=True)
os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_PORT}", "AWS_ACCESS_KEY_ID": "test",
                   "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip


@pytest.fixture(scope="module")
def store(tiny_llama_path, tmp_path_factory):
    """The bucket: adapter ``rem`` (random), ``broken`` (a config without weights)."""
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.models.arch import ModelArch

    server = S3Server(port=_PORT)
    server.client().create_bucket(Bucket=BUCKET)
    tmp = tmp_path_factory.mktemp("s3-loras")
    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    local = save_random_adapter(tmp / "rem", arch, rank=4, seed=41)
    server.upload(BUCKET, local, "loras/rem")
    server.client().put_object(Bucket=BUCKET, Key="loras/broken/adapter_config.json",
                               Body=b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')  # fmt: skip
    yield server, local
    server.stop()
    shutil.rmtree(cache_dir() / "s3" / BUCKET, ignore_errors=True)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_path, store):
    parsed = parse_args({"app_name": APP, "llm_configs": [{
        "model_loading_config": {"model_id": MODEL, "model_source": str(tiny_llama_path)},
        "engine_kwargs": ENGINE,
        "lora_config": {"dynamic_lora_loading_path": f"s3://{BUCKET}/loras", "max_num_adapters_per_replica": 2},
        "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
    }]})  # fmt: skip
    config = parsed.cluster_config()
    serve.run(compose_app(parsed, engine_version=replica_version(config)), name=APP, route_prefix=f"/{APP}")
    url = f"{ray_cluster}/{APP}"
    wait_until(lambda: httpx.get(url + "/health", timeout=30).status_code == 200, 90, "the replica ready")
    yield url, config
    end_serve_app(APP)


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_an_adapter_on_s3_loads_on_first_use_and_matches_the_local_folder(app, store, tiny_llama_path):
    app = app[0]
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    server, local = store
    offline = LLM(str(tiny_llama_path), **ENGINE, enable_lora=True, max_loras=1)
    offline.load_lora("rem", local)
    want = [offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False, lora_name=lora)[0].text
            for lora in ("rem", None)]  # fmt: skip
    gets = len(server.gets(BUCKET))
    r = _complete(app, "rem")
    assert r.status_code == 200, r.text
    assert [r.json()["choices"][0]["text"], _complete(app, MODEL).json()["choices"][0]["text"]] == want
    assert want[0] != want[1]  # the adapter ran
    assert len(server.gets(BUCKET)) > gets  # fetched from the store (by the replica: the ingress does not look)
    models = {m["id"]: m for m in httpx.get(app + "/v1/models", timeout=30).json()["data"]}
    assert models["rem"]["root"] == f"s3://{BUCKET}/loras/rem" and models["rem"]["parent"] == MODEL


def test_missing_and_bad_adapters_on_s3_are_404_and_400_naming_them(app):
    app, config = app
    r = _complete(app, "nope")
    err = r.json()["error"]
    assert r.status_code == 404 and err["param"] == "model" and err["code"] == "model_not_found"
    assert "'nope' does not exist" in err["message"]
    client = KVRouteClient(serve.get_deployment_handle(config.deployment_name, app_name=APP), config.hash_spec)
    with pytest.raises(ValueError, match=rf"s3://{BUCKET}/loras/nope not found on node {socket.gethostname()}"):
        asyncio.run(client.load_lora("nope", f"s3://{BUCKET}/loras/nope"))  # what the replica told the ingress
    r = _complete(app, "broken")
    assert r.status_code == 400 and "adapter_model.safetensors" in r.json()["error"]["message"], r.text
    assert _complete(app, MODEL).status_code == 200  # the replica is fine
