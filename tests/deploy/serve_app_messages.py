"""Anthropic's Messages API through the Ray Serve application, with the official
``anthropic`` client: the ingress translates the message onto the chat path, the
client hashes the prompt and the router places it, a replica answers, and the ingress
shapes the chat answer back into a message or Anthropic's events.

The tests here run in test_serve_app.py, which imports them: they use that module's
application (``app``: 2 replicas of the tiny random Llama, the ``chatml_tools``
template and the hermes parser, block size 8) rather than starting one of their own,
before the module's hostile input. This file's name does not start with ``test_``, so
pytest collects them there only. Each answer is checked against what the same
application's chat path gives for the same conversation (greedy, so the texts must be
equal), and a repeated long prompt must come back with the first one's full blocks as
``cache_read_input_tokens``: the router sent it to the replica that holds them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

MODEL = "tiny-served"  # test_serve_app.py's served name
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
BLOCK = 8  # test_serve_app.py's engine block size
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}  # fmt: skip
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def _clients(url: str) -> tuple[Any, Any]:
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    return (anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60),
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))  # fmt: skip


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_messages_through_serve_answer_as_the_chat_path_and_hit_the_cache(app):
    """A message with a long system prompt, whole and streamed, is the chat path's greedy
    answer; sent again, its prompt's full blocks are cache reads (routed to the holder)."""
    url = app[0]
    client, chat = _clients(url)
    system = " ".join(f"Rule {i}: the archive keeps record number {i} for the visitors." for i in range(12))
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=12, **GREEDY, system=system,
                              messages=[{"role": "user", "content": "Which records are kept?"}])  # fmt: skip
    first = client.messages.create(**kw)
    assert first.type == "message" and first.id.startswith("msg_") and first.model == MODEL
    want = chat.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Which records are kept?"}]).choices[0]  # fmt: skip
    assert _text(first) == want.message.content and _text(first)
    assert first.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert prompt > 100
    time.sleep(0.5)  # the holder's KV events reach the router
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        again = stream.get_final_message()
    assert streamed == _text(again) == _text(first)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.usage.cache_read_input_tokens == (prompt - 1) // BLOCK * BLOCK
    assert again.usage.output_tokens == first.usage.output_tokens


def test_messages_tool_loop_through_serve(app):
    """tool_use (``any``: a forced call, whose input the grammar makes valid whatever the
    weights; streamed, so the tool_use block comes as Anthropic's events) ->
    tool_result -> the final answer, which is what the chat path answers to the same
    conversation."""
    jsonschema = pytest.importorskip("jsonschema")
    url = app[0]
    client, chat = _clients(url)
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=60, **GREEDY, tools=[WEATHER])
    with client.messages.stream(messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw) as s:
        first = s.get_final_message()
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = json.dumps({"city": use.input["city"], "temperature": 18, "unit": use.input["unit"]})
    convo = [*ASK, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]  # fmt: skip
    final = client.messages.create(messages=convo, tool_choice={"type": "none"}, **kw)
    assert [b.type for b in final.content] == ["text"] and final.stop_reason in ("end_turn", "max_tokens")
    chat_convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}]  # fmt: skip
    want = chat.chat.completions.create(model=MODEL, messages=chat_convo, max_tokens=60, temperature=0,
                                        tools=[CHAT_WEATHER], tool_choice="none").choices[0].message  # fmt: skip
    assert _text(final) == want.content and want.content
