"""LoRA adapters over the OpenAI API of the single-engine server (real uvicorn on
loopback, the official ``openai`` client and httpx): ``model`` selects an adapter,
/v1/models lists them with ``parent``, adapters load and unload at run time behind the
API key, unknown adapters are 404s and bad folders 400s naming the file and field, and
nothing is left running or allocated."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from kvroute.benchmarks.lora_adapters import save_random_adapter  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from kvroute.replica.llm import LLM  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.deploy.server import running  # noqa: E402

KEY = "sk-test"
ENGINE = dict(block_size=8, num_kv_blocks=64, max_model_len=256, dtype="float32", enable_lora=True, max_loras=2)
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    from kvroute.replica.checkpoint import load_hf_config
    from kvroute.replica.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(tiny_llama_path))
    tmp = tmp_path_factory.mktemp("lora-api")
    return {name: save_random_adapter(tmp / name, arch, rank=4, seed=seed) for name, seed in (("a", 21), ("b", 22))}


@pytest.fixture(scope="module")
def server(tiny_llama_path, adapters):
    config = EngineConfig(model=str(tiny_llama_path), lora_modules={"a": str(adapters["a"])}, **ENGINE)
    app, engine = build_replica_server(config, ServerLimits(api_key=KEY), "tiny")
    with running(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def offline(tiny_llama_path, adapters):
    llm = LLM(str(tiny_llama_path), **ENGINE)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return {name: llm.generate(ids, params, use_tqdm=False, lora_name=name)[0].text for name in (None, "a", "b")}


def _client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server, path, body, key=KEY):
    return httpx.post(server[0] + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _complete(client, model):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)


def test_models_lists_the_adapters_with_their_parent(server, adapters):
    models = {m.id: m for m in _client(server).models.list().data}
    assert set(models) >= {"tiny", "a"}
    assert models["a"].model_extra["parent"] == "tiny" and models["a"].model_extra["root"] == str(adapters["a"])


def test_model_selects_the_adapter(server, offline):
    assert offline["a"] != offline[None]
    client = _client(server)
    base, lora = _complete(client, "tiny"), _complete(client, "a")
    assert base.choices[0].text == offline[None]
    assert lora.choices[0].text == offline["a"] and lora.model == "a"
    assert _complete(client, "tiny:a").choices[0].text == offline["a"]  # Ray Serve LLM's "<base>:<adapter>"
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "a" and chat.usage.completion_tokens == 4


def test_unknown_adapter_is_404_naming_it(server):
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        _complete(_client(server), "nope")
    with pytest.raises(openai.NotFoundError, match="LoRA adapter 'nope' of 'tiny' does not exist"):
        _complete(_client(server), "tiny:nope")
    with pytest.raises(openai.NotFoundError, match="model 'other:a' does not exist"):
        _complete(_client(server), "other:a")


def test_load_serve_unload_at_run_time(server, adapters, offline):
    body = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert _post(server, "/v1/load_lora_adapter", body, key="wrong").status_code == 401
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "'b' added" in r.text
    again = _post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert _complete(_client(server), "b").choices[0].text == offline["b"]
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and "'b' removed" in r.text
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404 and "'b'" in gone.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        _complete(_client(server), "b")


def test_bad_folder_is_400_naming_file_and_field(server, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(folder)})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "lora_path"
    assert "adapter_config.json" in err["message"] and "field 'r'" in err["message"]
    assert "bad" not in {m.id for m in _client(server).models.list().data}


def test_nothing_left_allocated(server):
    engine = server[1]

    def idle():
        stats = engine.engine.stats()
        return stats.num_running == 0 and stats.num_waiting == 0 and not any(stats.block_ref_counts)

    wait_until(idle, 10, "the engine to be idle")


def test_serve_replica_command_with_lora_modules(tiny_llama_path, adapters):
    from tests.conftest import free_port
    from tests.deploy.server import start_cli, stop_cli

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--port", str(port), "--num-kv-blocks", "32",
                             "--block-size", "8", "--dtype", "float32", "--served-model-name", "tiny", "--enable-lora",
                             "--max-loras", "2", "--lora-modules", f"a={adapters['a']}"], "serving")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url), 60, "the server to answer /health")
        ids = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert ids["a"]["parent"] == "tiny"
        r = httpx.post(url + "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "a"
    finally:
        output = stop_cli(proc, lines)
    assert proc.returncode == 0, output


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.ConnectError:
        return False


@pytest.mark.parametrize("spec,message", [("a", "NAME=PATH pairs, got 'a'"), ("=x", "NAME=PATH pairs")])
def test_bad_lora_modules_exit_2(spec, message, tiny_llama_path, capsys):
    from kvroute.deploy.cli import main

    assert main(["generate", "--model", str(tiny_llama_path), "--prompt", "x", "--enable-lora", "--lora-modules", spec]) == 2
    assert message in capsys.readouterr().err
