"""The ``kvroute`` command line: in-process on a tiny model, once as the installed script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvroute.deploy.cli import build_parser, main
from tests.deploy.server import start_cli, stop_cli

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "kvroute"
ENGINE_ARGS = ["--num-kv-blocks", "32", "--block-size", "8", "--dtype", "float32"]


def _generate(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--prompt", "The quick brown fox", "--max-tokens", "8",
            *ENGINE_ARGS, *extra]


def test_generate_json_on_a_tiny_model(tiny_llama_path, capsys):
    from kvroute.replica.llm import LLM
    from kvroute.replica.sampling_params import SamplingParams

    assert main(_generate(tiny_llama_path, "--json", "--logprobs", "2")) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) == {"text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "logprobs",
                        "model_path"}

    llm = LLM(str(tiny_llama_path), num_kv_blocks=32, block_size=8, dtype="float32")
    prompt = llm.tokenizer.encode("The quick brown fox")
    (want,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert out["token_ids"] == want.token_ids and len(want.token_ids) == 8
    assert out["text"] == want.text == llm.tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert out["finish_reason"] == "length"
    assert out["num_prompt_tokens"] == len(prompt) and out["num_cached_tokens"] == 0
    assert out["model_path"] == str(tiny_llama_path.resolve())
    assert [lp["token_id"] for lp in out["logprobs"]] == want.token_ids
    assert all(len(lp["top"]) == 2 for lp in out["logprobs"])
    assert all(lp["logprob"] == max(lp["top"].values()) for lp in out["logprobs"])  # greedy
    assert captured.err == ""

    # Without --json: the text and a newline, nothing else.
    assert main(_generate(tiny_llama_path)) == 0
    assert capsys.readouterr().out == want.text + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], r"kvroute: error: max_tokens must be an integer >= 1, got 0"),
        (["--top-p", "0"], r"kvroute: error: top_p must be in (0, 1], got 0.0"),
        (["--block-size", "3"], r"kvroute: error: block_size must be a power of two >= 1, got 3"),
    ],
)
def test_bad_values_exit_2_with_the_field_on_stderr(args, message, tiny_llama_path, capsys):
    assert main(_generate(tiny_llama_path) + args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == message


def test_unparseable_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--max-tokens", "many"])
    assert exc.value.code == 2
    assert "argument --max-tokens: invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--max-tokens", "4"])
    assert exc.value.code == 2
    assert "the following arguments are required: --prompt" in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "is neither an embedded model name" in capsys.readouterr().err


def test_installed_script_chats_with_the_embedded_model(smollm2_path, smollm2_tokenizer):
    assert SCRIPT.is_file(), f"console script not installed at {SCRIPT}"
    question = "What is the capital of France?"
    # A small KV cache keeps start-up fast on CPU (the default sizes it to 1 GiB).
    proc = subprocess.run(
        [str(SCRIPT), "generate", "--chat", "--prompt", question, "--json", "--num-kv-blocks", "64"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO.parent,  # not the repo: the installed package must be found on its own
        env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    chat_ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )["input_ids"]
    assert out["num_prompt_tokens"] == len(chat_ids)
    assert out["num_cached_tokens"] == 0
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == smollm2_tokenizer.eos_token_id
    assert out["text"] == smollm2_tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert out["logprobs"] is None
    assert out["model_path"] == str(smollm2_path)


def test_serve_replica_command_serves_and_stops_on_ctrl_c(tiny_llama_path):
    import httpx

    from tests.conftest import free_port

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--port", str(port), *ENGINE_ARGS,
                          "--served-model-name", "tiny", "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes"], "serving")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):  # the engine loads before uvicorn binds
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/get_model_info").json()["is_generation"] is True
        tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Ping?"}], "tools": [tool],
                       "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["ping"]
    finally:
        output = stop_cli(proc, lines)
    assert proc.returncode == 0, output


# `kvroute serve` (runs the cluster, answers, stops on Ctrl-C) is tested in test_chaos.py, on the one
# `kvroute serve` process that module starts.


def test_serve_replica_with_a_host_kv_tier_reports_the_restored_tokens(tiny_llama_path):
    """A prefix pushed out of a tiny device cache comes back from the host tier: the
    response's usage and /metrics name the host part (through the real openai client)."""
    import httpx
    import openai

    from tests.conftest import free_port

    port = free_port()
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--port", str(port), "--num-kv-blocks", "8",
                             "--host-kv-blocks", "64", "--block-size", "8", "--dtype", "float32",
                             "--served-model-name", "tiny"], "serving")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        a, b = list(range(100, 141)), list(range(300, 341))  # 41 tokens: 5 full blocks of 8 each

        def usage(prompt: list[int]):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).usage

        assert usage(a).prompt_tokens_details.cached_tokens == 0
        usage(b)  # b's blocks take the 8-block device cache: a's go to the host tier
        again = usage(a)
        details = again.prompt_tokens_details
        assert details.cached_tokens == 40 and details.model_extra["host_cached_tokens"] > 0
        metrics = httpx.get(url + "/metrics").text
        hits = [ln for ln in metrics.splitlines() if ln.startswith("kvroute:prefix_cache_host_hits_total")]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) == details.model_extra["host_cached_tokens"]
    finally:
        output = stop_cli(proc, lines)
    assert proc.returncode == 0, output


def test_serve_replica_publishes_kv_events_like_vllm(tiny_llama_path):
    """``--kv-events-config`` with vLLM's keys: a subscriber on the endpoint rebuilds
    the prompt's blocks, and a bad config exits 2 before the engine loads."""
    import httpx

    from kvroute.cluster.kv_subscriber import KVEventSubscriber
    from kvroute.cluster.router_actor import RouterService
    from kvroute.replica.block_hash import HashSpec, hash_blocks
    from tests.conftest import free_port, wait_until

    port, events_port = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"})
    proc, lines = start_cli(["serve-replica", "--model", str(tiny_llama_path), "--port", str(port), *ENGINE_ARGS,
                             "--served-model-name", "tiny", "--kv-events-config", cfg], "serving")  # fmt: skip
    spec = HashSpec(8, seed=1, model_id="any")  # the directory's own keys, whatever the worker hashes with
    svc = RouterService(spec)
    sub = KVEventSubscriber("w", f"tcp://127.0.0.1:{events_port}", spec, [svc], 32)
    sub.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url), 240, "the server")
        prompt = list(range(10, 30))
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        wait_until(lambda: svc.directory("w") == hash_blocks(spec, prompt), 30, "the prompt's blocks")
    finally:
        sub.stop()
        output = stop_cli(proc, lines)
    assert proc.returncode == 0, output
    assert main(["serve-replica", "--model", str(tiny_llama_path), "--kv-events-config", '{"endpont": 1}']) == 2


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.ConnectError:
        return False


def test_engine_flags_people_from_vllm_expect():
    from kvroute.deploy.cli import _engine_kwargs, build_parser
    from kvroute.replica.config import EngineConfig

    for command in ("serve", "serve-replica"):
        args = build_parser().parse_args([command, "--max-num-seqs", "8", "--no-enable-chunked-prefill",
                                          "--max-num-batched-tokens", "4096",
                                          "--engine-kwargs", '{"page_aligned": false, "kv_cache_memory_gb": 0.5}'])  # fmt: skip
        config = EngineConfig(**_engine_kwargs(args))
        assert (config.max_num_seqs, config.enable_chunked_prefill, config.max_num_batched_tokens) == (8, False, 4096)
        assert (config.page_aligned, config.kv_cache_memory_gb) == (False, 0.5)
        # without the flags: EngineConfig's own defaults
        config = EngineConfig(**_engine_kwargs(build_parser().parse_args([command, "--enable-chunked-prefill"])))
        default = EngineConfig()
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (default.max_num_seqs, default.max_num_batched_tokens)
        assert config.enable_chunked_prefill is True


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--engine-kwargs", "{nope"], "--engine-kwargs is not valid JSON"),
        (["--engine-kwargs", "[1]"], "--engine-kwargs must be a JSON object of EngineConfig fields, got '[1]'"),
        (["--engine-kwargs", '{"colour": 1}'], "--engine-kwargs: unknown EngineConfig fields ['colour']"),
        (["--engine-kwargs", '{"max_num_seqs": 4}'], "--engine-kwargs names ['max_num_seqs']; use their own flags (--max-num-seqs)"),
        (["--engine-kwargs", '{"kv_cache_memory_gb": -1}'], "kv_cache_memory_gb"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--workers", "http://127.0.0.1:8101,ftp://x"], "workers.1.url: Value error, url must be http(s)://"),
        (["--workers", "http://127.0.0.1:8101", "--router", "power_of_two"], "with --workers use kvroute or round_robin"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--chat-template", "no-such-template"], "--chat-template: 'no-such-template' is no file"),
    ],
)
def test_bad_serve_flags_exit_2_before_anything_starts(extra, message, capsys):
    assert main(["serve", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute: error: ") and message in err


def test_serve_workers_builds_the_workers_application():
    from kvroute.deploy.cli import build_parser, serve_app_args

    args = build_parser().parse_args(["serve", "--workers", "http://10.0.0.5:8000, http://10.0.0.6:8000/", "--block-size",
                                      "32", "--worker-poll-interval-s", "0.5", "--num-routers", "2"])  # fmt: skip
    app = serve_app_args(args)
    assert [w.url for w in app.workers] == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    assert app.worker_poll_interval_s == 0.5 and app.llm_configs[0].num_routers == 2
    assert app.cluster_config().hash_spec.block_size == 32
    assert serve_app_args(build_parser().parse_args(["serve", "--workers", ""])).workers == []
    evented = serve_app_args(build_parser().parse_args(
        ["serve", "--workers", "http://a:8000=tcp://a:5557=tcp://a:5558,http://b:8000=tcp://b:5557"])).workers  # fmt: skip
    assert [(w.url, w.kv_events_endpoint, w.replay_endpoint) for w in evented] == [
        ("http://a:8000", "tcp://a:5557", "tcp://a:5558"), ("http://b:8000", "tcp://b:5557", None)]
    assert serve_app_args(build_parser().parse_args(["serve"])).workers is None


def test_serve_tool_flags_reach_the_ingress_args():
    from kvroute.deploy.cli import build_parser, serve_app_args

    args = build_parser().parse_args(["serve", "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])  # fmt: skip
    ingress = serve_app_args(args).ingress
    assert "<tool_call>" in ingress.chat_template  # the template's text: the ingress needs no file
    tools = ingress.tool_config()
    assert tools.tool_call_parser == "hermes" and tools.enable_auto_tool_choice and tools.chat_template == ingress.chat_template


def test_serve_dynamic_lora_path_is_lora_config():
    from kvroute.deploy.cli import build_parser, serve_app_args

    app = serve_app_args(build_parser().parse_args(["serve", "--dynamic-lora-path", "/adapters", "--max-loras", "3"]))
    llm = app.llm_configs[0]
    assert llm.lora_config.dynamic_lora_loading_path == "/adapters"
    engine = app.cluster_config().engine
    assert engine.enable_lora and engine.max_loras == 3


def test_serve_proxy_environment_defaults_and_refusals(monkeypatch):
    from kvroute.deploy import serve_proxy

    for key in serve_proxy.FAST_PATH_ENV:
        monkeypatch.delenv(key, raising=False)
    for key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        monkeypatch.delenv(key, raising=False)
    env = serve_proxy.apply("haproxy")
    assert {k: env[k] for k in serve_proxy.FAST_PATH_ENV} == serve_proxy.FAST_PATH_ENV
    # HAProxy's side listeners get free ports, so two clusters on one machine can run
    assert int(env["RAY_SERVE_HAPROXY_STATS_PORT"]) != 8404 and int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]) != 9101
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "3"  # one node: HAProxy knows at once
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"  # a slow start on a busy box is no failure
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")  # what the caller set wins
    for key in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"):
        monkeypatch.delenv(key)
    assert serve_proxy.apply("python") == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
                                           "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "0",
                                           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    with pytest.raises(ValueError, match="proxy must be one of haproxy, python"):
        serve_proxy.apply("nginx")
    with pytest.raises(SystemExit, match="--proxy applies to a cluster this command starts"):
        main(["serve", "--address", "auto", "--proxy", "python"])
    with pytest.raises(SystemExit):  # argparse refuses an unknown proxy
        build_parser().parse_args(["serve", "--proxy", "nginx"])


def test_push_interval_is_checked():
    from kvroute.cluster.config import ClusterConfig
    from kvroute.replica.config import EngineConfig

    assert ClusterConfig(engine=EngineConfig(), num_replicas=1).push_interval_s > 0
    for bad in (-0.1, 0.5, 2.0):  # at or past the heartbeat (0.5 s) would starve it
        with pytest.raises(ValueError, match="push_interval_s must be >= 0 and below heartbeat_s"):
            ClusterConfig(engine=EngineConfig(), num_replicas=1, push_interval_s=bad)
