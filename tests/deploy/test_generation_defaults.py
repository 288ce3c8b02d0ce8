"""The model's sampling defaults (generation_config.json) on the real HTTP server, as vLLM
applies them: defaults for the fields a request leaves unset, ``max_new_tokens`` as the
default ``max_tokens``, switched off with ``generation_config='vllm'``. Outputs are
compared token for token with the offline engine under the parameters that should apply
(seeded sampling depends only on the seed and the position)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvroute.deploy.openai.generation_defaults import GenerationDefaults  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from kvroute.replica.llm import LLM  # noqa: E402
from kvroute.replica.sampling_params import SamplingParams  # noqa: E402
from tests.deploy.server import running  # noqa: E402

MAX_MODEL_LEN = 64
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 8, "min_p": 0.02, "repetition_penalty": 1.3}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, **SAMPLING, "max_new_tokens": 10}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation config that names sampling defaults."""
    folder = tmp_path_factory.mktemp("tiny-llama-gencfg") / "model"
    shutil.copytree(tiny_llama_path, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


def _config(model: Path, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), block_size=8, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, dtype="float32", **kw)


@pytest.fixture(scope="module")
def offline(model: Path) -> LLM:
    return LLM(str(model), block_size=8, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, dtype="float32")


def _offline_text(offline: LLM, **params) -> str:
    ids = offline.tokenizer.encode(PROMPT)
    (out,) = offline.generate([ids], SamplingParams(ignore_eos=True, **params), use_tqdm=False)
    assert len(out.token_ids) == params["max_tokens"]
    return out.text


def _completion(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def test_the_models_defaults_apply_where_the_request_is_silent(model: Path, offline: LLM) -> None:
    app, _ = build_replica_server(_config(model), served_model_name="tiny")
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        # nothing set: the model's sampling and its max_new_tokens
        answer = _completion(http, seed=7)
        assert answer["usage"]["completion_tokens"] == 10
        assert _text(answer) == _offline_text(offline, seed=7, max_tokens=10, **SAMPLING)
        assert _text(answer) != _offline_text(offline, seed=7, max_tokens=10, temperature=1.0)  # (the API's defaults)
        # null is unset too
        nulls = _completion(http, seed=7, temperature=None, top_k=None)
        assert _text(nulls) == _text(answer)
        # a field the request sets wins; the others stay the model's
        own = _completion(http, seed=7, temperature=1.0, top_k=-1, max_tokens=5)
        mixed = {**SAMPLING, "temperature": 1.0, "top_k": -1}
        assert _text(own) == _offline_text(offline, seed=7, max_tokens=5, **mixed) != _offline_text(offline, seed=7, max_tokens=5, **SAMPLING)
        # greedy on request: the model's penalty still applies
        greedy = _completion(http, temperature=0)
        assert _text(greedy) == _offline_text(offline, temperature=0.0, max_tokens=10, repetition_penalty=1.3)
        # chat: max_new_tokens instead of filling the context
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go on."}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
        # at most what the context leaves after the prompt
        long_prompt = offline.tokenizer.encode(PROMPT)[:1] * (MAX_MODEL_LEN - 4)
        r = http.post("/v1/completions", json={"prompt": long_prompt, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_generation_config_vllm_switches_them_off(model: Path, offline: LLM) -> None:
    app, _ = build_replica_server(_config(model, generation_config="vllm"), served_model_name="tiny")
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        answer = _completion(http, seed=7)
        assert answer["usage"]["completion_tokens"] == 16  # the completions API's own default
        assert _text(answer) == _offline_text(offline, seed=7, max_tokens=16, temperature=1.0)
        messages = [{"role": "user", "content": "Go on."}]
        r = http.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True, "temperature": 0})
        prompt_len = len(offline.apply_chat_template(messages))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_len


def test_another_folders_generation_config(model: Path, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 3, "max_new_tokens": 2}))
    assert GenerationDefaults.load(model, str(tmp_path)).values == {"top_k": 3, "max_tokens": 2}
    assert GenerationDefaults.load(model).values == {**SAMPLING, "max_tokens": 10}
    assert GenerationDefaults.load(model, "vllm").values == {}


def test_the_embedded_model_has_no_sampling_defaults(smollm2_path: Path) -> None:
    """SmolLM2's generation_config.json names token ids only: its requests are unchanged."""
    assert (smollm2_path / "generation_config.json").is_file()
    assert GenerationDefaults.load(smollm2_path).values == {}


def test_the_serve_ingress_reads_them_too(model: Path) -> None:
    from kvroute.cluster.config import ClusterConfig
    from kvroute.deploy.ingress_model import load_model_info

    *_, defaults = asyncio.run(load_model_info(ClusterConfig(engine=_config(model))))
    assert defaults.values == {**SAMPLING, "max_tokens": 10}
    *_, defaults = asyncio.run(load_model_info(ClusterConfig(engine=_config(model, generation_config="vllm"))))
    assert defaults.values == {}


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'"),
        ('{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
        ('{"max_new_tokens": true}', "max_new_tokens must be an integer"),
        ('{"max_new_tokens": 0}', "max_tokens"),
        ('{"top_p": 1.5}', "top_p"),
        ("[1, 2]", "must hold a JSON object"),
        ("{nope", "cannot be parsed"),
    ],
)
def test_a_bad_generation_config_is_a_clear_error(content: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match="generation_config.json") as info:
        GenerationDefaults.load(tmp_path)
    assert message in str(info.value)


def test_bad_settings(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        GenerationDefaults.load(model, str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        EngineConfig(generation_config="")


def test_the_cli_flag_reaches_the_engine_config() -> None:
    from kvroute.deploy.cli import build_parser, main, serve_app_args

    args = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert serve_app_args(args).cluster_config().engine.generation_config == "vllm"
    assert serve_app_args(build_parser().parse_args(["serve"])).cluster_config().engine.generation_config == "auto"
    assert main(["serve", "--engine-kwargs", '{"generation_config": "vllm"}']) == 2
