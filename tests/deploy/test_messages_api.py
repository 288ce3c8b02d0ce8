"""Anthropic's Messages API end to end: the official ``anthropic`` client against the
single-engine ``kvroute serve-replica`` on the embedded SmolLM2 (``--chat-template
chatml_tools --enable-auto-tool-choice --tool-call-parser hermes``; the package's
``smol_tools_server``). Each answer is checked against
what the chat path gives for the same conversation (greedy, so the texts must be
equal), which shows the translation renders the same prompt: the system prompt, stop
sequences, prefill, streamed events, cache reads in usage, forced tool use whose input
validates against its schema, and the whole tool loop. Bad input gets a 4xx in
Anthropic's error envelope; the API key is taken from ``x-api-key``."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")

from kvroute.deploy.openai.errors import error_body  # noqa: E402
from kvroute.deploy.openai.messages.answer import message_events  # noqa: E402
from kvroute.deploy.replica_server import build_replica_server  # noqa: E402
from kvroute.deploy.openai.serving import ServerLimits  # noqa: E402
from kvroute.replica.config import EngineConfig  # noqa: E402
from tests.deploy.conftest import SMOL_MODEL  # noqa: E402
from tests.deploy.server import running  # noqa: E402

MODEL = SMOL_MODEL
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}  # fmt: skip
# an array and an enum: the shapes a hand-rolled call reader got wrong before
TRIP = {"name": "plan_trip", "description": "Plan a trip through some cities", "input_schema": {
    "type": "object", "properties": {
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "mode": {"type": "string", "enum": ["train", "plane", "car"]}},
    "required": ["cities", "mode"]}}  # fmt: skip
# Recent clients take the sampling fields only as extra body fields (they are still the API's).
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
TRIP_ASK = [{"role": "user", "content": "Plan a train trip from Paris to Rome."}]


@pytest.fixture(scope="module")
def server(smol_tools_server):
    """The package's ``kvroute serve-replica`` with the tool flags (tests/deploy/conftest.py)."""
    return smol_tools_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def _chat(server: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """The chat path's greedy answer to the same conversation."""
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0, **kw},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ---------------------------------------------------------------------- text
def test_plain_message(client, server):
    m = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, messages=[{"role": "user", "content": "Hello!"}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    chat = _chat(server, [{"role": "user", "content": "Hello!"}], max_tokens=24)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert m.stop_sequence is None
    usage = chat["usage"]
    assert m.usage.output_tokens == usage["completion_tokens"] <= 24
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert m.usage.cache_creation_input_tokens == 0


def test_system_prompt_string_and_blocks(client, server):
    system = "You are a pirate. Answer every question like a pirate would."
    ask = [{"role": "user", "content": "Where is the treasure?"}]
    as_string = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, system=system, messages=ask)
    as_blocks = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, messages=ask,
                                       system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])  # fmt: skip
    plain = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, messages=ask)
    chat = _chat(server, [{"role": "system", "content": system}, *ask], max_tokens=30)
    assert _text(as_string) == _text(as_blocks) == chat["choices"][0]["message"]["content"]
    total = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    # (SmolLM2's template puts its own system prompt in when none is given)
    assert total(as_string) == total(as_blocks) == chat["usage"]["prompt_tokens"] != total(plain)


def test_stop_sequences(client):
    ask = [{"role": "user", "content": "Write a short story about a cat named Tom."}]
    full = _text(client.messages.create(model=MODEL, max_tokens=60, **GREEDY, messages=ask))
    # four characters from the text's middle that occur there first
    stop = next(full[k : k + 4] for k in range(len(full) // 2, len(full) - 4)
                if full.find(full[k : k + 4]) == k and full[k : k + 4].strip())  # fmt: skip
    m = client.messages.create(model=MODEL, max_tokens=60, **GREEDY, messages=ask, stop_sequences=["zzqx", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == full[: full.index(stop)]


def test_prefill_continues_the_assistant_turn(client, server):
    convo = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    m = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=convo)
    chat = _chat(server, convo, max_tokens=12, add_generation_prompt=False, continue_final_message=True)
    assert _text(m) == chat["choices"][0]["message"]["content"] and _text(m)


# ---------------------------------------------------------------------- streaming and usage
def test_stream_equals_the_whole_message(client):
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=40, **GREEDY,
                              messages=[{"role": "user", "content": "Tell me about the sea."}])  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final) and text
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens  # fmt: skip
    events = [e.type for e in client.messages.create(**kw, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_cache_read_on_a_repeated_long_prompt(client):
    system = " ".join(f"Rule {i}: always answer politely about topic number {i}." for i in range(40))
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=4, **GREEDY, system=system,
                              messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    first = client.messages.create(**kw)
    second = client.messages.create(**kw)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert prompt > 400
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt
    assert second.usage.cache_read_input_tokens > max(first.usage.cache_read_input_tokens, prompt // 2)
    with client.messages.stream(**kw) as stream:  # streamed, the final usage carries it too
        third = stream.get_final_message()
    assert third.usage.cache_read_input_tokens == second.usage.cache_read_input_tokens


# ---------------------------------------------------------------------- tools
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_validates(client, stream):
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=120, **GREEDY, messages=TRIP_ASK, tools=[WEATHER, TRIP],
                              tool_choice={"type": "tool", "name": "plan_trip"})  # fmt: skip
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "plan_trip" and use.id and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, TRIP["input_schema"])
    assert isinstance(use.input["cities"], list) and use.input["mode"] in ("train", "plane", "car")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop(client, server, stream):
    """tool_use -> tool_result -> the final answer, which is what the chat path answers
    to the same conversation."""
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=100, **GREEDY, tools=[WEATHER])
    first = client.messages.create(messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw)
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = json.dumps({"city": use.input["city"], "temperature": 18, "unit": use.input["unit"]})
    convo = [*ASK, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]  # fmt: skip
    if stream:
        with client.messages.stream(messages=convo, tool_choice={"type": "none"}, **kw) as s:
            final = s.get_final_message()
    else:
        final = client.messages.create(messages=convo, tool_choice={"type": "none"}, **kw)
    assert [b.type for b in final.content] == ["text"] and final.stop_reason in ("end_turn", "max_tokens")
    chat_convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}]  # fmt: skip
    chat = _chat(server, chat_convo, max_tokens=100, tools=[{"type": "function", "function": {
        "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        tool_choice="none")  # fmt: skip
    assert _text(final) == chat["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------- count_tokens
def _served_prompt(client: Any, **kw: Any) -> int:
    """The prompt tokens a one-token message with these fields was served with."""
    m = client.messages.create(model=MODEL, max_tokens=1, **GREEDY, **kw)
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.parametrize("case", ["plain", "system_and_tools", "tool_loop", "prefill"])
def test_count_tokens_is_the_prompt_a_message_is_served_with(client, case):
    """``messages.count_tokens`` counts what ``messages.create`` sends the engine for the
    same conversation: the same translation, template (tools included) and tokenizer."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]}
    kw: dict[str, Any] = {
        "plain": dict(messages=ASK),
        "system_and_tools": dict(system=[{"type": "text", "text": "You are a weather bot."}], messages=ASK,
                                 tools=[WEATHER, TRIP], tool_choice={"type": "tool", "name": "get_weather"}),
        "tool_loop": dict(messages=[*ASK, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}],
                          tools=[WEATHER]),
        "prefill": dict(messages=[*TRIP_ASK, {"role": "assistant", "content": "Day one:"}]),
    }[case]  # fmt: skip
    counted = client.messages.count_tokens(model=MODEL, **kw)
    assert counted.input_tokens == _served_prompt(client, **kw) > 0
    if case == "system_and_tools":  # the tools are in the count
        assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens + 50


def test_count_tokens_validates_as_messages_does(client, server):
    url = server + "/v1/messages/count_tokens"
    refused = {  # body -> the start of Anthropic's error message
        "max_tokens": ({"model": MODEL, "messages": ASK, "max_tokens": 8}, "max_tokens: unknown field"),
        "no messages": ({"model": MODEL, "messages": []}, "messages:"),
        "image": ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                  "messages[0].content[0]: image blocks"),
        "any without tools": ({"model": MODEL, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice:"),
        "unanswered result": ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "messages[0].content[0].tool_use_id"),
        "past the context": ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, "the prompt has"),
    }  # fmt: skip
    for name, (body, message) in refused.items():
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (name, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", (name, error)
        assert error["error"]["message"].startswith(message), (name, error)
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.count_tokens(model="claude-nonexistent", messages=ASK)
    assert _error(exc.value)[:2] == (404, "not_found_error")
    assert httpx.post(url, content=b"{nope", timeout=30).json()["error"]["message"].startswith("the request body is not")


# ---------------------------------------------------------------------- errors
def _error(exc: Any) -> tuple[int, str, str]:
    body = exc.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return exc.status_code, body["error"]["type"], body["error"]["message"]


def test_bad_input_is_a_4xx_in_anthropics_shape(client, server):
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "messages": ASK}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: required"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"thinking_budget": 5})
    status, kind, message = _error(exc.value)
    assert (status, kind) == (400, "invalid_request_error") and message.startswith("thinking_budget: unknown field")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])  # fmt: skip
    status, kind, message = _error(exc.value)
    assert (status, kind) == (400, "invalid_request_error") and message.startswith("messages[0].content[1]: image blocks")
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=ASK)
    assert _error(exc.value)[:2] == (404, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as exc:  # past the context: the chat path's check, this API's names
        client.messages.create(model=MODEL, max_tokens=5000, messages=ASK)
    status, kind, message = _error(exc.value)
    assert status == 400 and message.startswith("max_tokens=5000 plus the prompt's") and "max_completion" not in message


def test_x_api_key_and_body_cap(tiny_llama_path):
    """The guard's own refusals (401, 413) on /v1/messages are in Anthropic's envelope too."""
    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=64, max_model_len=256, dtype="float32")
    app, _ = build_replica_server(config, ServerLimits(api_key="s3cret", max_body_bytes=4096), MODEL)
    with running(app) as url:
        ok = anthropic.Anthropic(base_url=url, api_key="s3cret", max_retries=0, timeout=60)
        m = ok.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens >= 1
        assert ok.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens == \
            m.usage.input_tokens + m.usage.cache_read_input_tokens  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError) as exc:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        assert _error(exc.value)[:2] == (401, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
                model=MODEL, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        bearer = httpx.post(url + "/v1/messages", headers={"Authorization": "Bearer s3cret"}, timeout=60,
                            json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert bearer.status_code == 200, bearer.text
        # x-api-key opens /v1/messages only; the OpenAI routes keep their Bearer rule
        other = httpx.get(url + "/v1/models", headers={"x-api-key": "s3cret"}, timeout=30)
        assert other.status_code == 401
        with pytest.raises(anthropic.APIStatusError) as exc:
            ok.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi " * 3000}])
        assert _error(exc.value)[:2] == (413, "request_too_large")


# ---------------------------------------------------------------------- the event translation
def _events(raw: bytes, cut: int) -> list[tuple[str, dict[str, Any]]]:
    """Anthropic's events made from a chat stream's bytes fed ``cut`` bytes at a time
    (a forwarding backend passes a worker's bytes as they came)."""
    async def pieces() -> Any:
        for i in range(0, len(raw), cut):
            yield raw[i : i + cut]

    async def run() -> bytes:
        return b"".join([e async for e in message_events(pieces(), "msg_1", MODEL, 30, ["zzqx"])])

    out = []
    for frame in asyncio.run(run()).decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def test_events_from_chat_bytes_however_cut(server):
    """The chat stream's real bytes, cut anywhere, give the same events; an error frame
    in the chat stream is an ``error`` event, and so is a stream that ends unfinished."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 20,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    raw = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).content
    whole = _chat(server, body["messages"], max_tokens=20)
    events = _events(raw, len(raw))
    assert _events(raw, 7) == events == _events(raw.replace(b"\n", b"\r\n"), 5)
    assert [n for n, _ in events][:2] == ["message_start", "content_block_start"]
    assert [n for n, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
    assert text == whole["choices"][0]["message"]["content"]
    delta = events[-2][1]
    assert delta["usage"]["output_tokens"] == whole["usage"]["completion_tokens"]
    assert delta["delta"]["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[whole["choices"][0]["finish_reason"]]

    first = raw.index(b"\n\n", re.search(rb'"content":"[^"]', raw).start()) + 2  # through the first text chunk
    failed = raw[:first] + b"data: " + json.dumps(error_body(429, "overloaded")).encode() + b"\n\ndata: [DONE]\n\n"
    events = _events(failed, 11)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "overloaded"}})
    assert [n for n, _ in events][:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert "message_stop" not in [n for n, _ in events]
    assert _events(raw[:first], 3)[-1][1]["error"]["type"] == "api_error"  # ended before it finished
