"""What the answers carry, end to end: the official ``openai`` client against the
single-engine server running the embedded SmolLM2 with ``--chat-template chatml_tools
--enable-auto-tool-choice --tool-call-parser hermes``. Tool calls (a whole tool loop,
streamed and not; forced calls valid every time), structured outputs
(``beta.chat.completions.parse``, n documents), completions echo with logprobs in
lm-evaluation-harness's shape, and vLLM's prompt_logprobs, checked against the offline
engine."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("fastapi")

from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.deploy.openai.tools.serving import ToolServingConfig  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.deploy.server import running  # noqa: E402
from tests.deploy.tool_defs import TIME, WEATHER  # noqa: E402

MODEL = "smol"
MAX_MODEL_LEN = 1024
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), num_kv_blocks=512, max_model_len=MAX_MODEL_LEN, dtype="float32",
                          max_num_seqs=16)  # fmt: skip
    tools = ToolServingConfig.from_flags("chatml_tools", "hermes", True)
    app, engine = build_replica_server(config, ServerLimits(max_n=4), MODEL, tool_config=tools)
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(smollm2_path):
    from kvroute.replica.llm import LLM

    return LLM(str(smollm2_path), num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, dtype="float32")


def _valid_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and arguments, checked: a known tool, arguments that parse as
    JSON matching its schema, an OpenAI-shaped id."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _streamed(stream) -> tuple[dict[int, str], dict[int, list[dict[str, str]]], dict[int, str]]:
    """Content, tool calls and finish reason per choice, as a streaming client
    assembles them."""
    content: dict[int, str] = {}
    calls: dict[int, list[dict[str, str]]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                mine = calls.setdefault(ch.index, [])
                if tc.index == len(mine):
                    assert tc.id and tc.type == "function" and tc.function.name  # the header comes first
                    mine.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                mine[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return content, calls, finish


# ---------------------------------------------------------------------- tool calls
@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop(client, stream):
    """tools -> one forced call -> the tool's result -> a final answer in content."""
    kw: dict[str, Any] = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=150)
    if stream:
        stream_ = client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                                 stream=True, **kw)  # fmt: skip
        content, calls, finish = _streamed(stream_)
        [call] = calls[0]
        assert finish == {0: "tool_calls"} and not content[0]
        name, args, call_id = call["name"], json.loads(call["arguments"]), call["id"]
        jsonschema.validate(args, SCHEMAS[name])
    else:
        first = client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **kw)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(name, args)] = _valid_calls(choice.message.tool_calls)
        call_id = choice.message.tool_calls[0].id
    result = {"city": "Paris", "temperature": 18, "unit": "celsius"} if name == "get_weather" else {"time": "12:00"}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
    ]  # fmt: skip
    if stream:
        content, calls, finish = _streamed(client.chat.completions.create(messages=messages, tool_choice="none",
                                                                          stream=True, **kw))  # fmt: skip
        answer, reason = content[0], finish[0]
        assert not calls
    else:
        final = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
        answer, reason = final.choices[0].message.content, final.choices[0].finish_reason
        assert not final.choices[0].message.tool_calls
    assert answer and "<tool_call>" not in answer and reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_are_valid_every_time(client, tool_choice):
    named = isinstance(tool_choice, dict)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=4,
                                       temperature=1.0, seed=7, max_tokens=150)  # fmt: skip
    assert len(r.choices) == 4
    for choice in r.choices:
        calls = _valid_calls(choice.message.tool_calls)
        assert calls and choice.message.content is None
        assert choice.finish_reason == ("stop" if named else "tool_calls")  # OpenAI: a named call stops
        if named:
            assert [n for n, _ in calls] == ["get_time"]
    content, streamed, finish = _streamed(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=2, temperature=1.0, seed=9, max_tokens=150,
        stream=True))  # fmt: skip
    for i in range(2):
        assert not content[i] and streamed[i]
        for call in streamed[i]:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert finish[i] == ("stop" if named else "tool_calls")


def test_auto_answers_with_content_or_valid_calls(client):
    """``auto``: the hermes parser reads whatever the model chose; either way the answer
    is well formed (content without markers, or calls that parse)."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=150)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


# ---------------------------------------------------------------------- structured outputs
class City(pydantic.BaseModel):
    """Every field bounded: a 135M model may otherwise write digits to max_tokens."""

    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
    capital: bool


def test_parse_returns_the_model(client):
    r = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_tokens=200)  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and r.choices[0].finish_reason == "stop"


def test_json_schema_n4_gives_four_documents(client):
    schema = City.model_json_schema()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city, as JSON."}], n=4, temperature=1.0, seed=3,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})  # fmt: skip
    assert len(r.choices) == 4
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


# ---------------------------------------------------------------------- echo and prompt logprobs
def _offline_prompt_logprobs(offline, ids: list[int], k: int):
    from kvroute.replica.sampling_params import SamplingParams

    (out,) = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k), use_tqdm=False)
    return out.prompt_logprobs


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_in_lm_evals_shape(client, offline, max_tokens):
    ids = offline.tokenizer.encode("The capital of France is Paris")
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    want = _offline_prompt_logprobs(offline, ids, 1)
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i].logprob, abs=1e-3)
        assert lp.tokens[i] == offline.tokenizer.decode([ids[i]]) and lp.tokens[i] in lp.top_logprobs[i]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert choice.text.startswith(offline.tokenizer.decode(ids))
    # lm-evaluation-harness (local-completions): the continuation's loglikelihood and greediness
    ctxlen = 4
    cont = lp.token_logprobs[ctxlen : len(ids)]
    assert sum(cont) == pytest.approx(sum(w.logprob for w in want[ctxlen:]), abs=1e-2)
    greedy = all(t == pytest.approx(max(top.values())) for t, top in zip(cont, lp.top_logprobs[ctxlen : len(ids)]))
    assert greedy == all(ids[i] in want[i].top and max(want[i].top.values()) == want[i].logprob for i in range(ctxlen, len(ids)))
    if max_tokens == 0:
        assert choice.text == offline.tokenizer.decode(ids) and choice.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    else:
        assert r.usage.completion_tokens == 1 and lp.token_logprobs[-1] is not None
    streamed = list(client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                              temperature=0, stream=True))  # fmt: skip
    assert streamed[0].choices[0].logprobs.tokens[: len(ids)] == lp.tokens[: len(ids)]
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)


def _check_prompt_logprobs(got: list[Any], ids: list[int], want, k: int, tokenizer) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        position = got[i]
        first, entry = next(iter(position.items()))
        assert int(first) == ids[i] and entry["decoded_token"] == tokenizer.decode([ids[i]])
        assert entry["logprob"] == pytest.approx(want[i].logprob, abs=1e-3)
        top = list(want[i].top)  # most likely first
        assert entry["rank"] == want[i].rank >= 1 and (ids[i] not in top or entry["rank"] == top.index(ids[i]) + 1)
        ranks = sorted(e["rank"] for t, e in position.items() if int(t) != ids[i] or e["rank"] is not None)
        assert ranks[:k] == list(range(1, k + 1)) and len(position) in (k, k + 1)


def test_prompt_logprobs_on_completions_and_chat(server, client, offline):
    ids = offline.tokenizer.encode("Prompt logprobs, please")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})  # fmt: skip
    want = _offline_prompt_logprobs(offline, ids, 2)
    for choice in r.choices:
        _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, want, 2, offline.tokenizer)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})  # fmt: skip
    chat_ids = httpx.post(server + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    got = chat.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(got, chat_ids, _offline_prompt_logprobs(offline, chat_ids, 1), 1, offline.tokenizer)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=5, temperature=0, stream=True, stream_options=options,
                              extra_body={"ignore_eos": True})  # fmt: skip
    if chat:
        got = list(client.chat.completions.create(messages=[{"role": "user", "content": "Count"}], **kw))
    else:
        got = list(client.completions.create(prompt="Count with me:", **kw))
    *streamed, final = got
    assert final.choices == [] and final.usage.completion_tokens == 5
    prompt = final.usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in streamed]
    assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens
               for c in streamed)  # fmt: skip
    assert counts == sorted(counts) and counts[-1] == 5 and (counts[0] == 0 if chat else counts[0] == 1)
